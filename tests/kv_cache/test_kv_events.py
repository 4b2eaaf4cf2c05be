"""KV cache events over real ZeroMQ sockets on 127.0.0.1, decoded as a vLLM consumer decodes them."""
from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from helpers import free_port_block
from heterollm.config import ConfigError, load_config
from heterollm.config.cache import kv_events_port_problems, parse_kv_events_config
from heterollm.kv_cache import events as ev

H128 = (0xDEADBEEF << 64) | 0x1111  # a 128-bit block hash: the wire carries its low 64 bits
TIMEOUT_MS = 2000


# --- a consumer's own copy of vLLM's structs (vllm/distributed/kv_events.py, map-encoded events) ---

class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# --- the same for vLLM <= 0.23's tagged arrays (its example subscriber's structs) ---

class LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class LegacyStored(LegacyEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class LegacyRemoved(LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class LegacyCleared(LegacyEvent, tag="AllBlocksCleared"):
    pass


class LegacyBatch(EventBatch):
    events: list[LegacyStored | LegacyRemoved | LegacyCleared]


DECODE = msgspec.msgpack.Decoder(KVEventBatch)


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def make_publisher():
    made = []

    def make(dp_rank: int = 0, encoding: ev.Encoding = "map", **fields: Any) -> ev.KVEventsConfig:
        base = free_port_block(4)
        fields.setdefault("endpoint", f"tcp://127.0.0.1:{base}")
        fields.setdefault("replay_endpoint", f"tcp://127.0.0.1:{base + 2}")
        publisher = ev.KVEventPublisher(parse_kv_events_config(json.dumps(fields)), dp_rank, encoding=encoding)
        made.append(publisher)
        return publisher

    yield make
    for publisher in made:
        publisher.shutdown()


def subscribe(ctx: zmq.Context, endpoint: str, topic: bytes = b"") -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


def receive(sub: zmq.Socket, timeout_ms: int = TIMEOUT_MS) -> tuple[bytes, int, bytes]:
    assert sub.poll(timeout_ms), "no batch arrived"
    topic, seq, payload = sub.recv_multipart()
    assert len(seq) == 8, "vLLM's wire format: the sequence number in 8 bytes, big-endian"
    return topic, int.from_bytes(seq, "big"), payload


def sync(publisher: ev.KVEventPublisher, sub: zmq.Socket) -> int:
    """Publish AllBlocksCleared until the subscription is live (PUB drops messages while a SUB is
    still joining), then drain; returns the last sequence number seen."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        publisher.publish([("cleared",)])
        if sub.poll(50):
            last = -1
            while sub.poll(150):
                last = int.from_bytes(sub.recv_multipart()[1], "big")
            return last
    raise AssertionError("the subscription never became live")


def apply(state: dict[int, tuple[int | None, list[int]]], batch: KVEventBatch) -> None:
    """A consumer's residency: {block hash: (parent, token ids)}."""
    for event in batch.events:
        if isinstance(event, BlockStored):
            parent, size = event.parent_block_hash, event.block_size
            for i, h in enumerate(event.block_hashes):
                state[h] = (parent, event.token_ids[i * size:(i + 1) * size])
                parent = h
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                state.pop(h, None)
        else:
            state.clear()


def chain_links(seqs: list[list[int]], block_size: int, seed: int) -> dict[int, tuple[int | None, list[int]]]:
    """{wire hash: (wire hash of the parent block, token ids)} of every full block of `seqs`, by
    walking each sequence's hash chain from its first block."""
    from heterollm.kv_cache.manager import hash_block

    links: dict[int, tuple[int | None, list[int]]] = {}
    for seq in seqs:
        parent = None
        for start in range(0, len(seq) - block_size + 1, block_size):
            block = seq[start:start + block_size]
            h = hash_block(parent, block, seed)
            links[h & ev.HASH_MASK] = (None if parent is None else parent & ev.HASH_MASK, block)
            parent = h
    return links


def request_snapshot(ctx: zmq.Context, endpoint: str) -> tuple[int, KVEventBatch]:
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(endpoint)
    req.send((0).to_bytes(8, "big"))  # vLLM's request: a start sequence number
    assert req.poll(TIMEOUT_MS), "no replay answer"
    seq, payload = req.recv_multipart()
    req.close()
    assert len(seq) == 8, "vLLM's wire format: the sequence number in 8 bytes, big-endian"
    return int.from_bytes(seq, "big"), DECODE.decode(payload)


STEP_1 = [("stored", [H128, 2], None, [10, 11, 12, 13], 2), ("stored", [3], H128, [14, 15], 2)]
STEP_2 = [("removed", [2, 3]), ("stored", [4], H128, [20, 21], 2)]
EXPECTED = {H128 & ev.HASH_MASK: (None, [10, 11]), 4: (H128 & ev.HASH_MASK, [20, 21])}


# --- tests ---

def test_batches_decode_as_vllm_events_in_sequence(make_publisher, ctx):
    publisher = make_publisher(topic="kv-events")
    sub = subscribe(ctx, publisher.endpoint, b"kv-events")
    last = sync(publisher, sub)
    publisher.publish([])  # an empty step publishes nothing
    publisher.publish(STEP_1)
    publisher.publish(STEP_2)
    (topic1, seq1, p1), (topic2, seq2, p2) = receive(sub), receive(sub)
    assert topic1 == topic2 == b"kv-events"
    assert (seq1, seq2) == (last + 1, last + 2)
    first, second = DECODE.decode(p1), DECODE.decode(p2)
    assert first.data_parallel_rank == 0 and abs(first.ts - time.time()) < 5
    stored = first.events[0]
    assert stored == BlockStored(block_hashes=[0x1111, 2], parent_block_hash=None, token_ids=[10, 11, 12, 13],
                                 block_size=2, lora_id=None, medium="GPU", lora_name=None)
    assert first.events[1].parent_block_hash == 0x1111
    assert [type(e) for e in second.events] == [BlockRemoved, BlockStored]
    state: dict = {}
    apply(state, first)
    apply(state, second)
    assert state == EXPECTED
    assert not sub.poll(100)


def test_topic_filtering(make_publisher, ctx):
    publisher = make_publisher(topic="kv-events")
    matching = subscribe(ctx, publisher.endpoint, b"kv-events")
    other = subscribe(ctx, publisher.endpoint, b"other")
    sync(publisher, matching)
    publisher.publish(STEP_1)
    assert receive(matching)[0] == b"kv-events"
    assert not other.poll(200)


def test_replay_returns_snapshot_and_live_sequence(make_publisher, ctx):
    publisher = make_publisher()
    sub = subscribe(ctx, publisher.endpoint)
    sync(publisher, sub)
    publisher.publish(STEP_1)
    publisher.publish(STEP_2)
    live: dict = {}
    apply(live, DECODE.decode(receive(sub)[2]))
    _, last_seq, payload = receive(sub)
    apply(live, DECODE.decode(payload))

    seq, snapshot = request_snapshot(ctx, publisher.replay_endpoint)
    assert seq == last_seq
    assert isinstance(snapshot.events[0], AllBlocksCleared)
    rebuilt: dict = {}
    apply(rebuilt, snapshot)
    assert rebuilt == live == EXPECTED

    publisher.publish([("cleared",)])
    assert receive(sub)[1] == seq + 1  # the live stream goes on right after the snapshot's seq
    assert request_snapshot(ctx, publisher.replay_endpoint)[1].events == [AllBlocksCleared()]


def test_replay_to_a_dealer_ends_with_vllms_end_marker(make_publisher, ctx):
    publisher = make_publisher()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(publisher.replay_endpoint)
    dealer.send_multipart([b"", (5).to_bytes(8, "big")])
    assert dealer.poll(TIMEOUT_MS)
    empty, seq, payload = dealer.recv_multipart()
    assert empty == b"" and int.from_bytes(seq, "big") == 0  # only the opening snapshot was sent
    assert DECODE.decode(payload).events == [AllBlocksCleared()]
    assert dealer.poll(TIMEOUT_MS)
    assert dealer.recv_multipart() == [b"", ev.END_SEQ, b""]


def test_periodic_snapshot(make_publisher, ctx):
    publisher = make_publisher(snapshot_interval_seconds=1)
    sub = subscribe(ctx, publisher.endpoint)
    sync(publisher, sub)
    publisher.publish(STEP_1 + STEP_2)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        batch = DECODE.decode(receive(sub)[2])
        if isinstance(batch.events[0], AllBlocksCleared) and len(batch.events) > 1:
            break
    else:
        pytest.fail("no snapshot within 3 s")
    state: dict = {}
    apply(state, batch)
    assert state == EXPECTED


def test_snapshot_puts_parents_first_and_chains_in_one_event():
    residency = ev.KVResidency()
    for raw in [("stored", [1, 2, 3], None, [0, 1, 2, 3, 4, 5], 2), ("removed", [1]),
                ("stored", [1], None, [0, 1], 2), ("stored", [9], 2, [6, 7], 2)]:
        residency.apply(ev.to_events([raw])[0])
    assert residency.block_hashes() == {1, 2, 3, 9}
    snapshot = residency.snapshot_events()
    assert snapshot[0] == ev.AllBlocksCleared()
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in snapshot[1:]] == [
        ([1, 2, 3], None, [0, 1, 2, 3, 4, 5]), ([9], 2, [6, 7])]


def test_dp_rank_publishes_on_base_port_plus_rank(make_publisher, ctx):
    base = free_port_block(4)
    publisher = make_publisher(dp_rank=1, endpoint=f"tcp://127.0.0.1:{base}",
                               replay_endpoint=f"tcp://127.0.0.1:{base + 2}")
    assert publisher.endpoint == f"tcp://127.0.0.1:{base + 1}"
    assert publisher.replay_endpoint == f"tcp://127.0.0.1:{base + 3}"
    sub = subscribe(ctx, publisher.endpoint)
    sync(publisher, sub)
    publisher.publish(STEP_1)
    assert DECODE.decode(receive(sub)[2]).data_parallel_rank == 1
    assert request_snapshot(ctx, publisher.replay_endpoint)[1].data_parallel_rank == 1


def test_legacy_array_encoding(make_publisher, ctx):
    publisher = make_publisher(encoding="array")
    sub = subscribe(ctx, publisher.endpoint)
    sync(publisher, sub)
    publisher.publish(STEP_1 + STEP_2 + [("cleared",)])
    batch = msgspec.msgpack.decode(receive(sub)[2], type=LegacyBatch)
    assert batch.events[0] == LegacyStored([0x1111, 2], None, [10, 11, 12, 13], 2, None, "GPU")
    assert batch.events[2] == LegacyRemoved([2, 3], "GPU")
    assert isinstance(batch.events[-1], LegacyCleared) and batch.data_parallel_rank == 0


def test_port_ranges_checked_at_launch():
    cfg = parse_kv_events_config('{"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}')
    assert kv_events_port_problems(cfg, 1) == []
    [problem] = kv_events_port_problems(cfg, 2)
    assert "--kv_events_config" in problem and "'replay_endpoint' ports 5558-5559" in problem
    assert "'endpoint' ports 5557-5558" in problem
    same = parse_kv_events_config('{"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://127.0.0.1:5557"}')
    assert kv_events_port_problems(same, 1)
    top = parse_kv_events_config('{"endpoint": "tcp://*:65535"}')
    assert "65535" in kv_events_port_problems(top, 2)[0]


@pytest.mark.parametrize("fields,needle", [
    ({"endpoint": "tcp://*:5557", "motor_pool_endpoint": "tcp://*:7557"}, "motor_pool_endpoint"),
    ({"endpoint": "tcp://*:*"}, "endpoint"),
    ({"endpoint": "tcp://*:5557", "replay_endpoint": "ipc:///tmp/x"}, "replay_endpoint"),
])
def test_bad_fields_are_named(fields, needle):
    with pytest.raises(ConfigError, match=f"--kv_events_config.*{needle}"):
        load_config(["--kv_events_config", json.dumps(fields)])


def test_port_in_use_is_a_config_error(make_publisher):
    first = make_publisher()
    with pytest.raises(ConfigError, match="'endpoint': cannot bind"):
        make_publisher(endpoint=first.endpoint)


def test_bad_raw_events_are_refused(make_publisher):
    publisher = make_publisher()
    with pytest.raises(ValueError, match="token ids"):
        publisher.publish([("stored", [1, 2], None, [1, 2, 3], 2)])
    with pytest.raises(ValueError, match="unknown KV event"):
        publisher.publish([("evicted", [1])])


def test_shutdown_is_prompt_and_frees_the_ports(make_publisher, ctx):
    publisher = make_publisher()
    subscribe(ctx, publisher.endpoint)  # a connected subscriber must not hold shutdown up either
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(publisher.replay_endpoint)
    req.send(b"")  # a request left unanswered or not, shutdown must not wait on it
    for _ in range(100):
        publisher.publish(STEP_1)
    start = time.monotonic()
    publisher.shutdown()
    publisher.shutdown()
    assert time.monotonic() - start < 1.5
    with pytest.raises(RuntimeError, match="shut down"):
        publisher.publish(STEP_1)
    again = make_publisher(endpoint=publisher.endpoint, replay_endpoint=publisher.replay_endpoint)
    assert again.endpoint == publisher.endpoint


def test_factory():
    assert ev.make_kv_event_publisher("") is None
    base = free_port_block(1)
    publisher = ev.make_kv_event_publisher(json.dumps({"endpoint": f"tcp://127.0.0.1:{base}"}))
    try:
        assert isinstance(publisher, ev.KVEventPublisher) and publisher.replay_endpoint is None
    finally:
        publisher.shutdown()


def test_readme_subscriber_snippet_runs(make_publisher):
    """The README's subscriber, run as written (ports swapped): it resyncs from the replay
    snapshot, then follows the live stream. Batch k >= 2 adds one block, so after seq N it
    holds N + 1 blocks (2 from the batch at seq 1, whatever came through the snapshot)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    snippet = re.search(r"```python\n(.*?)```", readme[readme.index("A minimal subscriber"):], re.S).group(1)
    publisher = make_publisher(topic="kv-events")
    snippet = snippet.replace("tcp://localhost:5557", publisher.endpoint)
    snippet = snippet.replace("tcp://localhost:5558", publisher.replay_endpoint)
    publisher.publish([("stored", [1, 2], None, [5, 6, 7, 8], 2)])
    proc = subprocess.Popen([sys.executable, "-c", snippet], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        first = None
        for block in range(100, 300):  # one stored block per batch until the subscriber reports
            publisher.publish([("stored", [block], None, [0, 0], 2)])
            try:
                first = lines.get(timeout=0.1)
                break
            except queue.Empty:
                assert proc.poll() is None, "the snippet exited"
        assert first is not None, "the snippet printed nothing in 20 s"
        if not first.startswith("missed"):  # a batch can slip by while the subscription joins
            seq, count = map(int, re.fullmatch(r"seq (\d+): (\d+) blocks resident\n", first).groups())
            assert count == seq + 1
        publisher.publish([("cleared",)])
        while not (line := lines.get(timeout=5)).endswith(": 0 blocks resident\n"):
            assert re.fullmatch(r"seq \d+: \d+ blocks resident\n|missed \d+ batches.*\n", line), line
    finally:
        proc.kill()
        proc.wait()


def test_engine_events_match_the_cache_residency(tmp_path, ctx):
    """The real engine: what a subscriber rebuilds from the live stream, and what a replay
    returns, is exactly the prefix cache's residency, through hits and LRU evictions."""
    import random

    from helpers import build_tiny_model
    from heterollm import LLM, SamplingParams

    base = free_port_block(2)
    config = {"endpoint": f"tcp://127.0.0.1:{base}", "replay_endpoint": f"tcp://127.0.0.1:{base + 1}"}
    llm = LLM(str(build_tiny_model(tmp_path / "m", "llama")), dtype="float32", block_size=8,
              num_gpu_blocks_override=20, max_model_len=128, kv_events_config=json.dumps(config))
    engine = llm.engine
    try:
        sub = subscribe(ctx, config["endpoint"])
        sync(engine.kv_events, sub)
        rng = random.Random(1)
        system = [rng.randrange(100, 20000) for _ in range(30)]
        prompts = [system + [rng.randrange(100, 20000) for _ in range(rng.randrange(2, 30))] for _ in range(8)]
        seqs = []  # every token sequence whose blocks the cache may hold
        for i in range(0, 8, 2):  # 4 rounds: the 20-block cache must evict
            outs = llm.generate(prompts[i:i + 2], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
            seqs += [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
        resident = {h & ev.HASH_MASK for h in engine.kv.pool.cached}
        assert engine.kv.hits > 0 and len(resident) > 0

        state: dict[int, tuple[int | None, list[int]]] = {}
        removed = 0
        while sub.poll(300):
            _, _, payload = sub.recv_multipart()
            batch = DECODE.decode(payload)
            removed += sum(isinstance(e, BlockRemoved) for e in batch.events)
            apply(state, batch)
        assert removed > 0, "the workload must exercise eviction"
        assert set(state) == resident
        assert all(len(tokens) == 8 for _, tokens in state.values())
        links = chain_links(seqs, 8, engine.kv.hash_seed)
        assert state == {h: links[h] for h in state}, "each block names its true parent and holds its tokens"
        assert any(parent is None for parent, _ in state.values())
        _, snapshot = request_snapshot(ctx, config["replay_endpoint"])
        replayed: dict[int, tuple[int | None, list[int]]] = {}
        apply(replayed, snapshot)
        assert replayed == state
    finally:
        llm.engine.shutdown()
