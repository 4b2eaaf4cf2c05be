"""KV cache events for KV-aware routers: vLLM's event format over ZeroMQ (`--kv_events_config`).

Wiring in the engine (the publisher is None when the flag is empty; dp_rank is 0 until DP lands):

    publisher = make_kv_event_publisher(config.kv_cache.kv_events_config, dp_rank)   # engine init
    publisher.publish(kv.take_events())                                             # after each step
    publisher.shutdown()                                                            # engine shutdown

Without a publisher nobody drains the manager's events, so it should not record them then.

`kv.take_events()` drains the raw events the KV cache manager recorded since the last call,
oldest first, as plain tuples (`RawEvent`):

    ("stored", block_hashes, parent_block_hash | None, token_ids, block_size)
        consecutive full blocks of one request that just became cached; token_ids are theirs,
        concatenated (block_size * len(block_hashes)); the parent is the hash of the block before
        the first one (None at the start of a sequence); an image's placeholder tokens appear as
        one negative id per image, drawn from its content hash (heterollm.multimodal.cache_token_ids)
    ("removed", block_hashes)
    ("cleared",)

`publish` turns one step's list into one batch and queues it; a background thread owns the
sockets, so a step never waits on the network. Wire format (vLLM's, vllm/distributed/kv_events.py):

- Live stream: a PUB socket bound to `endpoint` (port + dp_rank; always bound, where vLLM
  connects when the host has no wildcard), one multipart message per batch: [topic, sequence
  number as 8 bytes big-endian, msgpack payload]. Sequence numbers count 0, 1, 2, ... over every
  batch this publisher sends, snapshots included.
- Payload: `KVEventBatch`, the positional array [ts, events, data_parallel_rank]; each event a
  msgpack map tagged by "type" ("BlockStored", "BlockRemoved", "AllBlocksCleared"), as vLLM
  sends them since its PR #42892 (releases after 0.23). `encoding="array"` sends the tagged
  arrays of vLLM <= 0.23 instead, for consumers that only read those.
- Block hashes: our hashes are 128-bit xxh3 values; the wire carries their low 64 bits as an
  unsigned msgpack int, which is vLLM's default external form (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1:
  the digest read big-endian, masked to 64 bits). `medium` is "GPU", vLLM's name for the primary
  KV tier, whatever the device.
- Snapshot: AllBlocksCleared followed by BlockStored for every resident block (parents first,
  a chain in one event), so a consumer that applies batches in order resyncs on it. The stream
  opens with one (empty: seq 0) and repeats it every `snapshot_interval_seconds`.
- Replay: a ROUTER socket on `replay_endpoint` (port + dp_rank). A request is one frame from a REQ
  socket (a DEALER sends an empty frame first); vLLM's 8-byte start sequence number is accepted,
  and ignored: the answer is always [seq, snapshot payload], the current full residency and the
  sequence number of the last live batch it includes (apply live batches after seq), followed by
  vLLM's end marker [-1 as 8 bytes signed, empty frame]. A REQ socket keeps the first reply and
  drops the marker; a DEALER receives both.

The publisher tracks residency from the events it sends, never reading the cache manager.
"""
from __future__ import annotations

import logging
import queue
from array import array
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import zmq

from heterollm.config.cache import KVEventsConfig, parse_kv_events_config, rank_endpoint
from heterollm.config.errors import ConfigError

logger = logging.getLogger("heterollm.kv_events")

RawEvent = tuple[Any, ...]
Encoding = Literal["map", "array"]

MEDIUM = "GPU"
HASH_MASK = (1 << 64) - 1
END_SEQ = (-1).to_bytes(8, "big", signed=True)
TICK_S = 0.05
"""How long the publisher thread waits for a batch before it looks at replay requests again."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events; the class name is the "type" tag."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_block_hash(block_hash: int) -> int:
    """The wire form of a block hash: its low 64 bits (vLLM's int form of a wider digest)."""
    return block_hash & HASH_MASK


def to_events(raw_events: list[RawEvent]) -> list[KVCacheEvent]:
    """The KV cache manager's raw tuples as vLLM events, in order."""
    return [_to_event(raw) for raw in raw_events]


def _to_event(raw: RawEvent) -> KVCacheEvent:
    kind = raw[0]
    if kind == "stored":
        _, block_hashes, parent, token_ids, block_size = raw
        if len(token_ids) != block_size * len(block_hashes):
            raise ValueError(f"stored event: {len(token_ids)} token ids for {len(block_hashes)} blocks "
                             f"of {block_size}")
        return BlockStored(block_hashes=[external_block_hash(h) for h in block_hashes],
                           parent_block_hash=None if parent is None else external_block_hash(parent),
                           token_ids=list(token_ids), block_size=block_size, lora_id=None, medium=MEDIUM,
                           lora_name=None)
    if kind == "removed":
        return BlockRemoved(block_hashes=[external_block_hash(h) for h in raw[1]], medium=MEDIUM)
    if kind == "cleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event {kind!r} (expected stored, removed or cleared)")


@dataclass(frozen=True)
class _Block:
    parent: int | None
    token_ids: array  # int64: 8 bytes a token, where a list of ints costs ~36 (a big cache holds millions)
    block_size: int


class KVResidency:
    """Which blocks are cached, rebuilt from the events alone (wire hashes as keys)."""

    def __init__(self) -> None:
        self._blocks: dict[int, _Block] = {}  # insertion order; a re-stored parent can follow its children

    def __len__(self) -> int:
        return len(self._blocks)

    def block_hashes(self) -> set[int]:
        return set(self._blocks)

    def apply(self, event: KVCacheEvent) -> None:
        if isinstance(event, BlockStored):
            parent, size = event.parent_block_hash, event.block_size
            for i, block_hash in enumerate(event.block_hashes):
                tokens = array("q", event.token_ids[i * size:(i + 1) * size])
                self._blocks.setdefault(block_hash, _Block(parent, tokens, size))
                parent = block_hash
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                self._blocks.pop(block_hash, None)
        else:
            self._blocks.clear()

    def snapshot_events(self) -> list[KVCacheEvent]:
        """AllBlocksCleared, then BlockStored for every resident block: each block after its
        resident ancestors, consecutive blocks of a chain in one event."""
        events: list[KVCacheEvent] = [AllBlocksCleared()]
        emitted: set[int] = set()
        for start in self._blocks:
            chain = []
            block_hash: int | None = start
            while block_hash in self._blocks and block_hash not in emitted:
                emitted.add(block_hash)
                chain.append(block_hash)
                block_hash = self._blocks[block_hash].parent
            for block_hash in reversed(chain):
                self._append_stored(events, block_hash)
        return events

    def _append_stored(self, events: list[KVCacheEvent], block_hash: int) -> None:
        block = self._blocks[block_hash]
        last = events[-1]
        if (isinstance(last, BlockStored) and last.block_hashes[-1] == block.parent
                and last.block_size == block.block_size):
            last.block_hashes.append(block_hash)
            last.token_ids.extend(block.token_ids)
            return
        events.append(BlockStored(block_hashes=[block_hash], parent_block_hash=block.parent,
                                  token_ids=list(block.token_ids), block_size=block.block_size, lora_id=None,
                                  medium=MEDIUM, lora_name=None))


def encode_batch(batch: KVEventBatch, encoding: Encoding = "map") -> bytes:
    """The msgpack payload of one batch: vLLM >= 0.24's tagged maps, or <= 0.23's tagged arrays."""
    if encoding == "map":
        return msgspec.msgpack.encode(batch)
    events = [_as_tagged_array(event) for event in batch.events]
    return msgspec.msgpack.encode([batch.ts, events, batch.data_parallel_rank])


def _as_tagged_array(event: KVCacheEvent) -> list[Any]:
    """[tag, field values in order], trailing fields at their default left out (msgspec's rule)."""
    fields = msgspec.structs.fields(type(event))
    values = [getattr(event, f.name) for f in fields]
    keep = len(values)
    while keep and fields[keep - 1].default is not msgspec.NODEFAULT and values[keep - 1] == fields[keep - 1].default:
        keep -= 1
    return [type(event).__name__, *values[:keep]]


class KVEventPublisher:
    """Publishes one DP rank's KV events (wire format: the module docstring).

    `publish` and `shutdown` are the engine thread's; the publisher's own thread owns the sockets,
    the sequence counter and the residency, so none of them needs a lock."""

    def __init__(self, config: KVEventsConfig, dp_rank: int = 0, *, encoding: Encoding = "map") -> None:
        self.dp_rank = dp_rank
        self.endpoint = rank_endpoint(config.endpoint, dp_rank)
        self.replay_endpoint = rank_endpoint(config.replay_endpoint, dp_rank) if config.replay_endpoint else None
        self._topic = config.topic.encode()
        self._snapshot_interval_s = float(config.snapshot_interval_seconds)
        self._encoding: Encoding = encoding
        self._queue: queue.SimpleQueue[KVEventBatch | None] = queue.SimpleQueue()
        self._residency = KVResidency()
        self._next_seq = 0
        self._closed = False
        self._ctx = zmq.Context()
        try:
            self._pub = self._bind(zmq.PUB, self.endpoint, "endpoint", config.hwm)
            self._replay = (self._bind(zmq.ROUTER, self.replay_endpoint, "replay_endpoint", config.hwm)
                            if self.replay_endpoint else None)
        except ConfigError:
            self._ctx.destroy(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, name=f"kv-events-dp{dp_rank}", daemon=True)
        self._thread.start()
        logger.info("publishing KV events on %s (topic %r, replay: %s, snapshot every %d s)", self.endpoint,
                    config.topic, self.replay_endpoint or "off", config.snapshot_interval_seconds)

    def publish(self, raw_events: list[RawEvent]) -> None:
        """Queue one step's raw events as one batch (nothing for an empty list); never waits."""
        if not raw_events:
            return
        if self._closed:
            raise RuntimeError("the KV event publisher is shut down")
        batch = KVEventBatch(ts=time.time(), events=to_events(raw_events), data_parallel_rank=self.dp_rank)
        self._queue.put(batch)

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Send what is queued, stop the thread, close the sockets without lingering. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("KV event publisher thread still running after %.1f s; its sockets stay open", timeout_s)
            return
        self._ctx.destroy(linger=0)

    def _bind(self, kind: int, endpoint: str, field: str, hwm: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            raise ConfigError(f"--kv_events_config: field {field!r}: cannot bind {endpoint} "
                              f"(DP rank {self.dp_rank}): {exc}") from None
        return sock

    # --- the publisher thread ---

    def _run(self) -> None:
        next_snapshot = time.monotonic()  # the stream opens with a snapshot, so replay always has a seq
        while True:
            if time.monotonic() >= next_snapshot:
                next_snapshot = time.monotonic() + self._snapshot_interval_s
                self._guarded(self._send_snapshot)
            if self._replay is not None:
                self._guarded(self._serve_replay)
            try:
                batch = self._queue.get(timeout=max(0.0, min(TICK_S, next_snapshot - time.monotonic())))
            except queue.Empty:
                continue
            if batch is None:
                return
            self._guarded(self._apply_and_send, batch)

    def _guarded(self, step: Any, *args: Any) -> None:
        try:
            step(*args)
        except Exception:  # a failed send must not end the thread: the next snapshot resyncs consumers
            logger.exception("KV event publisher: %s failed", step.__name__)

    def _apply_and_send(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            self._residency.apply(event)
        self._send(batch)

    def _send_snapshot(self) -> None:
        self._send(self._snapshot_batch())

    def _snapshot_batch(self) -> KVEventBatch:
        return KVEventBatch(ts=time.time(), events=self._residency.snapshot_events(),
                            data_parallel_rank=self.dp_rank)

    def _send(self, batch: KVEventBatch) -> None:
        payload = encode_batch(batch, self._encoding)
        self._pub.send_multipart([self._topic, self._next_seq.to_bytes(8, "big"), payload])  # PUB drops at hwm
        self._next_seq += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            # [identity, b"", request] from REQ (or a DEALER that sends the empty frame), else [identity, request]
            envelope = frames[:2] if len(frames) > 2 and frames[1] == b"" else frames[:1]
            payload = encode_batch(self._snapshot_batch(), self._encoding)
            last_seq = self._next_seq - 1
            self._replay.send_multipart([*envelope, last_seq.to_bytes(8, "big"), payload])
            self._replay.send_multipart([*envelope, END_SEQ, b""])


def make_kv_event_publisher(config_text: str, dp_rank: int = 0) -> KVEventPublisher | None:
    """The publisher `--kv_events_config` asks for (binds its sockets now), or None when it is empty."""
    if not config_text:
        return None
    return KVEventPublisher(parse_kv_events_config(config_text), dp_rank)
