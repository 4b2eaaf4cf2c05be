"""KV events at the edges the mutation run (tests/MUTATION.md, `kv_cache/`) found untested. The
expected values follow from kv_cache/events.py's module docstring (vLLM's wire format), worked out
by hand in the comments; most tests need no socket."""
from __future__ import annotations

import json
import time

import msgspec
import pytest
import zmq

from heterollm.config.cache import parse_kv_events_config
from heterollm.kv_cache import events as ev

from helpers import free_port_block

LOW = 0x0123456789ABCDEF
H = (0xFEDC << 64) | LOW  # a 128-bit hash; the wire carries LOW


def stored(hashes, parent, tokens, size, **kw) -> ev.BlockStored:
    return ev.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=size,
                          lora_id=None, medium="GPU", lora_name=None, **kw)


# --- raw events to vLLM's ----------------------------------------------------------------------

def test_the_wire_hash_is_the_low_64_bits():
    assert ev.HASH_MASK == 2**64 - 1
    assert ev.external_block_hash(H) == LOW
    assert ev.external_block_hash(2**64) == 0
    assert ev.external_block_hash(2**64 - 1) == 2**64 - 1
    assert ev.external_block_hash(5) == 5


def test_raw_events_become_vllm_events():
    raw = [("stored", [H, 7], None, (1, 2, 3, 4), 2), ("stored", [8], H, [5, 6], 2),
           ("removed", [H, 9]), ("cleared",)]
    assert ev.to_events(raw) == [
        stored([LOW, 7], None, [1, 2, 3, 4], 2),
        stored([8], LOW, [5, 6], 2),
        ev.BlockRemoved(block_hashes=[LOW, 9], medium="GPU"),
        ev.AllBlocksCleared(),
    ]
    assert ev.to_events([]) == []
    [event] = ev.to_events([("stored", [1], 0, [0], 1)])
    assert event.parent_block_hash == 0, "a parent hash of 0 is a parent, not None"
    assert type(event.token_ids) is list


def test_bad_raw_events_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"^stored event: 3 token ids for 2 blocks of 2$"):
        ev.to_events([("stored", [1, 2], None, [1, 2, 3], 2)])
    with pytest.raises(ValueError, match=r"^stored event: 5 token ids for 2 blocks of 2$"):
        ev.to_events([("stored", [1, 2], None, [1, 2, 3, 4, 5], 2)])
    with pytest.raises(ValueError, match=r"^unknown KV event 'evicted' \(expected stored, removed or cleared\)$"):
        ev.to_events([("evicted", [1])])


# --- residency and snapshots -------------------------------------------------------------------

def test_residency_follows_the_events():
    r = ev.KVResidency()
    assert len(r) == 0 and r.block_hashes() == set()
    r.apply(stored([1, 2, 3], None, [10, 11, 12, 13, 14, 15], 2))
    r.apply(stored([4], 2, [20, 21], 2))
    assert len(r) == 4 and r.block_hashes() == {1, 2, 3, 4}
    r.apply(stored([2], 9, [99, 99], 2))  # already resident: the first record stays
    r.apply(ev.BlockRemoved(block_hashes=[3, 77], medium="GPU"))  # 77 was never resident
    assert r.block_hashes() == {1, 2, 4}
    # the snapshot: 1 -> 2 is one chain (one event), 4 continues 2 (and follows it directly)
    assert r.snapshot_events() == [ev.AllBlocksCleared(), stored([1, 2, 4], None, [10, 11, 12, 13, 20, 21], 2)]
    r.apply(ev.AllBlocksCleared())
    assert len(r) == 0 and r.snapshot_events() == [ev.AllBlocksCleared()]


def test_snapshot_splits_chains_at_a_missing_parent_and_a_new_block_size():
    r = ev.KVResidency()
    r.apply(stored([1, 2], None, [1, 1, 2, 2], 2))
    r.apply(stored([3], 2, [3, 3, 3], 3))        # same chain, another block size
    r.apply(stored([5], 4, [5, 5], 2))           # its parent 4 is not resident
    r.apply(stored([6], None, [6, 6], 2))        # another chain's first block
    assert r.snapshot_events() == [
        ev.AllBlocksCleared(),
        stored([1, 2], None, [1, 1, 2, 2], 2),
        stored([3], 2, [3, 3, 3], 3),
        stored([5], 4, [5, 5], 2),
        stored([6], None, [6, 6], 2),
    ]


def test_snapshot_puts_a_re_stored_parent_before_its_children():
    r = ev.KVResidency()
    r.apply(stored([1, 2, 3], None, [0, 0, 1, 1, 2, 2], 2))
    r.apply(ev.BlockRemoved(block_hashes=[1, 2], medium="GPU"))
    r.apply(stored([1, 2], None, [0, 0, 1, 1], 2))  # inserted after 3, its child
    snapshot = r.snapshot_events()
    assert snapshot == [ev.AllBlocksCleared(), stored([1, 2, 3], None, [0, 0, 1, 1, 2, 2], 2)]
    # the snapshot's tokens are copies: applying it elsewhere, or extending it, leaves r alone
    snapshot[1].token_ids.append(42)
    assert r.snapshot_events()[1].token_ids == [0, 0, 1, 1, 2, 2]


# --- encodings ---------------------------------------------------------------------------------

BATCH = ev.KVEventBatch(ts=1.5, events=[stored([1, 2], None, [1, 2, 3, 4], 2),
                                        ev.BlockRemoved(block_hashes=[2], medium="GPU"),
                                        ev.AllBlocksCleared()], data_parallel_rank=3)


def test_map_encoding_is_vllms_tagged_maps():
    ts, events, rank = msgspec.msgpack.decode(ev.encode_batch(BATCH))
    assert (ts, rank) == (1.5, 3)
    # fields with a default are left out at their default (omit_defaults), the others always sent
    assert events == [
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
         "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ]
    assert ev.encode_batch(BATCH, "map") == ev.encode_batch(BATCH)


def test_array_encoding_drops_trailing_fields_at_their_default():
    ts, events, rank = msgspec.msgpack.decode(ev.encode_batch(BATCH, "array"))
    assert (ts, rank) == (1.5, 3)
    # [tag, values in field order]; the trailing extra_keys .. kv_cache_spec_sliding_window are at
    # their default (None) and left out, lora_name (no default) is kept
    assert events == [["BlockStored", [1, 2], None, [1, 2, 3, 4], 2, None, "GPU", None],
                      ["BlockRemoved", [2], "GPU"],
                      ["AllBlocksCleared"]]
    grouped = ev.KVEventBatch(ts=0.0, events=[stored([1], None, [1], 1, group_idx=3),
                                              ev.BlockRemoved(block_hashes=[1], medium=None, group_idx=0)])
    _, events, rank = msgspec.msgpack.decode(ev.encode_batch(grouped, "array"))
    # group_idx is not at its default: it and the defaults before it stay, the ones after it go
    assert events == [["BlockStored", [1], None, [1], 1, None, "GPU", None, None, 3],
                      ["BlockRemoved", [1], None, 0]]
    assert rank is None


# --- the publisher -----------------------------------------------------------------------------

def config(**fields) -> ev.KVEventsConfig:
    return parse_kv_events_config(json.dumps(fields))


def test_the_factory_publishes_as_rank_0_unless_told():
    base = free_port_block(2)
    text = json.dumps({"endpoint": f"tcp://127.0.0.1:{base}"})
    publisher = ev.make_kv_event_publisher(text)
    try:
        assert publisher.dp_rank == 0 and publisher.endpoint == f"tcp://127.0.0.1:{base}"
    finally:
        publisher.shutdown()
    publisher = ev.make_kv_event_publisher(text, 1)
    try:
        assert publisher.dp_rank == 1 and publisher.endpoint == f"tcp://127.0.0.1:{base + 1}"
    finally:
        publisher.shutdown()


def test_a_shut_down_publisher_refuses_events_but_not_an_empty_step():
    base = free_port_block(1)
    publisher = ev.KVEventPublisher(config(endpoint=f"tcp://127.0.0.1:{base}"))
    publisher.shutdown()
    publisher.publish([])  # nothing to publish: no error
    with pytest.raises(RuntimeError, match=r"^the KV event publisher is shut down$"):
        publisher.publish([("cleared",)])


def test_a_replay_request_without_an_empty_frame_gets_the_snapshot():
    """The ROUTER sees [identity, request] from a DEALER that sends no empty frame; the answer is
    [seq, snapshot] then vLLM's end marker, without an empty delimiter."""
    base = free_port_block(2)
    publisher = ev.KVEventPublisher(config(endpoint=f"tcp://127.0.0.1:{base}",
                                           replay_endpoint=f"tcp://127.0.0.1:{base + 1}"), encoding="array")
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(publisher.replay_endpoint)
        publisher.publish([("stored", [H], None, [1, 2], 2)])
        deadline = time.monotonic() + 5
        while True:  # until the replay includes the published batch (seq 1, after the opening snapshot)
            dealer.send((0).to_bytes(8, "big"))
            assert dealer.poll(2000), "no replay answer"
            seq, payload = dealer.recv_multipart()
            assert dealer.poll(2000) and dealer.recv_multipart() == [ev.END_SEQ, b""]
            if int.from_bytes(seq, "big") == 1 or time.monotonic() > deadline:
                break
        assert seq == (1).to_bytes(8, "big"), "8 bytes big-endian, as on the live stream"
        ts, events, rank = msgspec.msgpack.decode(payload)
        assert events == [["AllBlocksCleared"], ["BlockStored", [LOW], None, [1, 2], 2, None, "GPU", None]]
        assert rank == 0 and abs(ts - time.time()) < 5
    finally:
        ctx.destroy(linger=0)
        publisher.shutdown()


class _StuckThread:
    """Stands in for a publisher thread that does not stop in time."""

    def __init__(self) -> None:
        self.joined: list[float | None] = []

    def join(self, timeout=None) -> None:
        self.joined.append(timeout)

    def is_alive(self) -> bool:
        return True


def test_shutdown_waits_the_timeout_then_warns_and_leaves_the_sockets_open(caplog):
    base = free_port_block(1)
    publisher = ev.KVEventPublisher(config(endpoint=f"tcp://127.0.0.1:{base}"))
    thread, publisher._thread = publisher._thread, _StuckThread()
    try:
        with caplog.at_level("WARNING", logger="heterollm.kv_events"):
            publisher.shutdown(timeout_s=0.5)
        assert publisher._thread.joined == [0.5], "a bounded wait"
        assert [r.getMessage() for r in caplog.records if r.name == "heterollm.kv_events"] == [
            "KV event publisher thread still running after 0.5 s; its sockets stay open"]
        assert not publisher._ctx.closed, "the thread may still use its sockets"
        publisher.shutdown()  # idempotent: no second wait, no second warning
        assert publisher._thread.joined == [0.5]
    finally:
        thread.join(5)  # the real thread got the stop signal and ends on its own
        publisher._ctx.destroy(linger=0)
