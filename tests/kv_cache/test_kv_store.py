"""The KV cache store (--enable_kvcache_store) over a real Mooncake master on loopback
(scripts/mooncake.sh): a second instance finds the first one's blocks with the same greedy tokens;
puts wait for the step that computes a block and skip a block renamed since; a fetch that fails is
a miss; the launch checks fail fast naming the flag."""
from __future__ import annotations

import json
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from heterollm.config import ConfigError, load_config
from heterollm.kv_cache import KVCacheManager
from heterollm.kv_cache.store_tier import StoreTier, block_key, probe_store, store_problems

from helpers import FakeStore, build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
BS = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mooncake")
    out = subprocess.run([str(ROOT / "scripts" / "mooncake.sh"), "start", "--dir", str(folder)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    master, metadata = out.stdout.split()
    yield master, metadata
    subprocess.run([str(ROOT / "scripts" / "mooncake.sh"), "stop", "--dir", str(folder)], timeout=30)


def test_puts_wait_for_the_step_that_computes_the_block_and_skip_renamed_blocks():
    tier = StoreTier(FakeStore(), "p", ranks=1, batch_size=2, timeout_ms=0)
    m = KVCacheManager(4, BS, enable_prefix_cache=True, store=tier)
    tokens = list(range(100, 100 + 2 * BS + 1))
    m.match_prefix("a", tokens)
    m.allocate("a", len(tokens))
    m.commit("a", tokens, len(tokens))  # in-batch commit: the step being built computes them
    first = m.take_transfers()
    assert first is None, "not put by the step that computes them"
    second = m.take_transfers()["mooncake_store"]
    assert [b for b, _ in second.save] == m.tables["a"][:2]
    assert m.take_transfers() is None
    # a block evicted (and so renamed) before its put is skipped
    m.free("a")
    other = list(range(500, 500 + 2 * BS + 1))
    m.match_prefix("b", other)
    m.allocate("b", len(other))
    m.commit("b", other, len(other))
    m.free("b")
    m.match_prefix("c", list(range(900, 900 + 4 * BS)))
    m.allocate("c", 4 * BS)  # evicts b's cached blocks before their put
    m.take_transfers()
    t = m.take_transfers()
    assert t is None or not t["mooncake_store"].save


def test_a_fetch_that_fails_for_one_rank_is_a_miss_from_that_block():
    store = FakeStore()
    tier = StoreTier(store, "p", ranks=2, batch_size=1, timeout_ms=0)
    m = KVCacheManager(8, BS, enable_prefix_cache=True, store=tier)
    tokens = list(range(100, 100 + 3 * BS + 1))
    hashes = m._chain("x", tokens, 3)
    for i, h in enumerate(hashes):
        for r in range(2):
            if not (i == 1 and r == 1):  # rank 1's share of block 1 is missing
                store.data[block_key("p", h, r)] = bytes([i, r])
    assert m.match_prefix("a", tokens) == BS, "block 0 only: block 1 is incomplete, block 2 is past the gap"
    m.allocate("a", len(tokens))
    t = m.take_transfers()["mooncake_store"]
    assert t.load == [(hashes[0], m.tables["a"][0])] and t.data == {hashes[0]: [bytes([0, 0]), bytes([0, 1])]}
    assert m.store_hits == BS and tier.fetched == 1


def test_a_chain_goes_device_then_host_then_store_and_each_tier_loads_its_own_blocks():
    """Block 0 on the device, block 1 in the host tier, block 2 only in the store: the store is asked
    from block 2 on, and each block lands in its own slot of the request's table."""
    store = FakeStore()
    tier = StoreTier(store, "p", ranks=1, batch_size=4, timeout_ms=0)
    m = KVCacheManager(4, BS, enable_prefix_cache=True, record_events=True, host_slots=4, store=tier)
    tokens = list(range(100, 100 + 3 * BS + 1))  # 3 full blocks and one more token: limit 3
    h0, h1, h2 = m._chain("x", tokens, 3)
    store.data[block_key("p", h2, 0)] = b"s2"
    first = tokens[:2 * BS] + [9999]
    m.match_prefix("a", first)
    a_blocks = list(m.allocate("a", len(first)))  # 3 of the 4 blocks: h0, h1 and a partial one
    m.commit("a", first, len(first))
    m.free("a")  # the tail goes first: h1's block is older than h0's on the LRU list
    m.match_prefix("f", list(range(700, 700 + 3 * BS)))
    m.allocate("f", 3 * BS)  # the partial block, the untouched one, then h1's block (evicted: spilled)
    m.free("f")
    spill = m.take_transfers()["host"].save
    assert spill == [(a_blocks[1], 0)], "h1's block went to host slot 0"
    m.take_events()

    assert m.match_prefix("r", tokens) == 3 * BS
    table = m.allocate("r", len(tokens))
    assert len(table) == 4 and table[0] == a_blocks[0], "block 0 shared from the device"
    t = m.take_transfers()
    assert t["host"].load == [(0, table[1])] and t["host"].save == []
    assert t["mooncake_store"].load == [(h2, table[2])] and t["mooncake_store"].data == {h2: [b"s2"]}
    assert tier.fetched == 1, "only h2 was fetched"
    # looked up: a's 9 tokens, f's 12 and r's 13; found: r's 3 blocks, one from each tier
    assert (m.queries, m.hits, m.host_hits, m.store_hits) == (9 + 12 + 13, 3 * BS, BS, BS)
    # the loaded blocks name their prefixes on the device again: both announced as stored
    stored = [e for e in m.take_events() if e[0] == "stored"]
    assert stored == [("stored", [h1], h0, tokens[BS:2 * BS], BS), ("stored", [h2], h1, tokens[2 * BS:3 * BS], BS)]
    assert m.match_prefix("r2", tokens) == 3 * BS and m.take_transfers() is None, "all on the device now"


def test_a_device_only_match_never_asks_the_store():
    """A PUSH reservation's match (`device_only`): block 0 on the device counts, block 1 in the store
    neither counts nor is fetched; an ordinary match then finds both."""
    store = FakeStore()
    tier = StoreTier(store, "p", ranks=1, batch_size=4, timeout_ms=0)
    m = KVCacheManager(8, BS, enable_prefix_cache=True, store=tier)
    tokens = list(range(100, 100 + 2 * BS + 1))
    h0, h1 = m._chain("x", tokens, 2)
    store.data[block_key("p", h1, 0)] = b"s1"
    first = tokens[:BS] + [9999]
    m.match_prefix("a", first)
    m.allocate("a", len(first))
    m.commit("a", first, len(first))
    m.free("a")  # block 0 stays cached on the device
    assert m.match_prefix("res", tokens, device_only=True) == BS
    assert m.host_blocks_past_limit and tier.fetched == 0, "the store was not asked"
    m.allocate("res", len(tokens))
    assert m.take_transfers() is None, "nothing to load"
    m.free("res")
    assert m.match_prefix("r", tokens) == 2 * BS and tier.fetched == 1


def test_a_later_match_forgets_store_blocks_an_earlier_one_fetched():
    """A waiting request matched against the store, then (before its admission) the same blocks came
    onto the device with another request: its next match finds them there and its admission loads
    nothing from the store."""
    store = FakeStore()
    tier = StoreTier(store, "p", ranks=1, batch_size=4, timeout_ms=0)
    m = KVCacheManager(8, BS, enable_prefix_cache=True, store=tier)
    tokens = list(range(100, 100 + 2 * BS + 1))
    for h in m._chain("x", tokens, 2):
        store.data[block_key("p", h, 0)] = b"k"
    assert m.match_prefix("r", tokens) == 2 * BS  # from the store; r waits
    assert m.match_prefix("s", tokens) == 2 * BS
    s_table = list(m.allocate("s", len(tokens)))
    m.commit("s", tokens, len(tokens))
    assert len(m.take_transfers()["mooncake_store"].load) == 2
    m.free("s")
    assert m.match_prefix("r", tokens) == 2 * BS  # on the device now
    table = m.allocate("r", len(tokens))
    assert table[:2] == s_table[:2]
    assert m.take_transfers() is None, "nothing to load for r"
    assert tier.fetched == 4 and m.store_hits == 2 * BS, "r's first fetch and s's; only s's counted as admitted"


def test_a_waiting_request_is_fetched_for_once_until_it_is_admitted():
    """The store is asked once per request and position: matching a waiting request again, or after
    an admission refused for want of blocks, reuses the first fetch."""
    store = FakeStore()
    calls = []

    def get_batch(keys):
        calls.append(keys)
        return [store.data.get(k, b"") for k in keys]
    store.get_batch = get_batch
    tier = StoreTier(store, "p", ranks=1, batch_size=4, timeout_ms=0)
    m = KVCacheManager(3, BS, enable_prefix_cache=True, store=tier)
    tokens = list(range(100, 100 + 2 * BS + 1))  # needs 3 blocks: 2 from the store and 1
    for h in m._chain("x", tokens, 2):
        store.data[block_key("p", h, 0)] = b"k"
    m.allocate("o", 1)  # holds 1 of the 3 blocks
    assert m.match_prefix("r", tokens) == 2 * BS and len(calls) == 1
    assert m.match_prefix("r", tokens) == 2 * BS and len(calls) == 1, "not fetched again"
    assert m.allocate("r", len(tokens)) is None  # 3 needed, 2 free
    assert m.match_prefix("r", tokens) == 2 * BS and len(calls) == 1, "kept across the refusal"
    m.free("o")
    table = m.allocate("r", len(tokens))
    assert [blk for _, blk in m.take_transfers()["mooncake_store"].load] == table[:2]
    assert tier.fetched == 2 and m.store_hits == 2 * BS


def test_a_store_block_gone_by_the_next_match_is_a_miss_and_the_first_fetch_is_forgotten():
    """r waits on two store blocks; meanwhile block 0 comes onto the device (with s) and block 1 leaves
    the store. r's next match: block 0 on the device, block 1 nowhere: one block, nothing to load."""
    store = FakeStore()
    tier = StoreTier(store, "p", ranks=1, batch_size=4, timeout_ms=0)
    m = KVCacheManager(8, BS, enable_prefix_cache=True, store=tier)
    tokens = list(range(100, 100 + 2 * BS + 1))
    h0, h1 = m._chain("x", tokens, 2)
    store.data[block_key("p", h0, 0)] = store.data[block_key("p", h1, 0)] = b"k"
    assert m.match_prefix("r", tokens) == 2 * BS  # r waits
    short = tokens[:BS] + [5]
    assert m.match_prefix("s", short) == BS
    s_table = list(m.allocate("s", len(short)))
    assert m.take_transfers()["mooncake_store"].load == [(h0, s_table[0])]
    m.free("s")
    del store.data[block_key("p", h1, 0)]
    assert m.match_prefix("r", tokens) == BS, "block 0 from the device; block 1 is a miss"
    table = m.allocate("r", len(tokens))
    assert table[0] == s_table[0] and len(table) == 3
    assert m.take_transfers() is None, "nothing to load for r"
    assert m.store_hits == BS, "s's one block; r found none in the store"


def test_store_hit_counters_add_up_over_requests():
    store = FakeStore()
    tier = StoreTier(store, "p", ranks=1, batch_size=4, timeout_ms=0)
    m = KVCacheManager(8, BS, enable_prefix_cache=True, store=tier)
    first, second = list(range(100, 100 + BS + 1)), list(range(200, 200 + BS + 1))  # one full block each
    for tokens in (first, second):
        store.data[block_key("p", m._chain(f"x{tokens[0]}", tokens, 1)[0], 0)] = b"k"
    for rid, tokens in (("a", first), ("b", second)):
        assert m.match_prefix(rid, tokens) == BS
        m.allocate(rid, len(tokens))
    assert (m.queries, m.hits, m.store_hits) == (2 * (BS + 1), 2 * BS, 2 * BS)


def test_store_blocks_must_continue_a_fully_committed_table():
    store = FakeStore()
    tier = StoreTier(store, "p", ranks=1, batch_size=4, timeout_ms=0)
    m = KVCacheManager(8, BS, enable_prefix_cache=True, store=tier)
    tokens = list(range(100, 100 + 2 * BS + 1))
    store.data[block_key("p", m._chain("x", tokens, 2)[1], 0)] = b"k"  # block 1 only
    m.allocate("r", BS)  # block 0 of r: written, not committed
    assert m.match_prefix("r", tokens, start_block=1) == BS
    with pytest.raises(RuntimeError, match="^r: store blocks must continue a fully committed table$"):
        m.allocate("r", len(tokens))


def test_a_block_evicted_and_named_again_is_put_once():
    """A one-block pool: a's block is registered, evicted before its put, then holds the same prefix
    again (a2). Only the second registration is put: the first one's generation is gone."""
    tier = StoreTier(FakeStore(), "p", ranks=1, batch_size=4, timeout_ms=0)
    m = KVCacheManager(1, BS, enable_prefix_cache=True, store=tier)
    tokens = list(range(100, 100 + BS))
    m.allocate("a", BS)
    m.commit("a", tokens, BS)
    m.free("a")
    assert m.take_transfers() is None  # registered by the step being built
    m.allocate("c", BS)  # evicts a's block
    m.free("c")
    table = m.allocate("a2", BS)
    m.commit("a2", tokens, BS)  # the same block, the same prefix, a new generation
    assert m.take_transfers() is None, "a's registration is stale"
    assert m.take_transfers()["mooncake_store"].save == [(table[0], m._chain("x", tokens, 1)[0])]
    assert tier.put == 1


def test_fetch_asks_in_batches_of_the_batch_size_and_a_failing_store_is_a_miss(caplog):
    store = FakeStore()
    calls = []

    def get_batch(keys):
        calls.append(len(keys))
        return [store.data.get(k, b"") for k in keys]
    store.get_batch = get_batch
    for h in (1, 2, 3):
        for r in range(2):
            store.data[block_key("p", h, r)] = b"x"
    tier = StoreTier(store, "p", ranks=2, batch_size=1, timeout_ms=0)
    assert (tier.put, tier.fetched, tier.failed) == (0, 0, 0)
    assert tier.fetch([1, 2, 3])[0] == [1, 2, 3]
    assert calls == [2, 2, 2], "one block (both ranks' keys) per request"
    calls.clear()
    assert StoreTier(store, "p", ranks=2, batch_size=0, timeout_ms=0).fetch([1, 2, 3])[0] == [1, 2, 3]
    assert calls == [2, 2, 2], "a batch size under 1 is 1"

    for h in (1, 2, 3):
        for r in range(2):
            store.data[block_key("p", h, r)] = bytes([h, r])
    calls.clear()
    found, data = StoreTier(store, "p", ranks=2, batch_size=3, timeout_ms=0).fetch([1, 2, 3])
    assert calls == [6] and found == [1, 2, 3]
    assert data == {h: [bytes([h, 0]), bytes([h, 1])] for h in (1, 2, 3)}, "each block's own two shares"

    def broken(keys):
        raise RuntimeError("store down")
    store.get_batch = broken
    with caplog.at_level("WARNING", logger="heterollm.kv_cache.store"):
        assert tier.fetch([1, 2]) == ([], {}) and tier.failed == 1
    assert caplog.messages == ["KV store fetch failed: store down"]
    assert tier.fetch([1]) == ([], {}) and tier.failed == 2 and tier.fetched == 3


def test_puts_add_up_and_skip_blocks_no_longer_named():
    tier = StoreTier(FakeStore(), "p", ranks=1, batch_size=1, timeout_ms=0)
    tier.committed(0, 10, 0)
    tier.committed(1, 11, 0)
    assert tier.take_puts(lambda *_: True) == [], "computed by the step being built"
    assert tier.take_puts(lambda *_: True) == [(0, 10), (1, 11)] and tier.put == 2
    tier.committed(2, 12, 0)
    tier.committed(3, 13, 5)
    tier.take_puts(lambda *_: True)
    assert tier.take_puts(lambda block, h, generation: generation == 0) == [(2, 12)] and tier.put == 3


def test_the_store_needs_the_prefix_cache_and_drop_forgets_store_matches():
    store = FakeStore()
    tier = StoreTier(store, "p", ranks=1, batch_size=4, timeout_ms=0)
    with pytest.raises(ValueError, match=r"^the KV cache store keeps prefix-cache blocks: it needs the prefix cache$"):
        KVCacheManager(4, BS, store=tier)
    m = KVCacheManager(8, BS, enable_prefix_cache=True, store=tier)
    tokens = list(range(100, 100 + 2 * BS + 1))
    for h in m._chain("x", tokens, 2):
        store.data[block_key("p", h, 0)] = b"k"
    assert m.match_prefix("r", tokens) == 2 * BS and tier.fetched == 2
    m.drop("r")  # e.g. aborted while waiting
    assert len(m.allocate("r", len(tokens))) == 3
    assert m.take_transfers() is None, "nothing to load: the match was dropped"


def test_prefetch_batches_stop_after_the_timeout():
    store = FakeStore()
    slow = FakeStore()
    slow.data = store.data

    def get_batch(keys):
        time.sleep(0.05)
        return store.get_batch(keys)
    slow.get_batch = get_batch
    hashes = list(range(1, 7))
    for h in hashes:
        store.data[block_key("p", h, 0)] = b"x"
    assert len(StoreTier(slow, "p", 1, batch_size=2, timeout_ms=0).fetch(hashes)[0]) == 6
    found, _ = StoreTier(slow, "p", 1, batch_size=2, timeout_ms=60).fetch(hashes)
    assert len(found) == 4, "the batch in flight at the deadline completes; no new one starts"


def cfg(*argv):
    return load_config(["--model", "m", "--enable_kvcache_store", *argv]).config


def test_launch_checks_name_the_flag():
    assert any("--store_master_server_address" in p for p in store_problems(cfg()))
    assert any("--store_metadata_server" in p for p in store_problems(cfg("--store_master_server_address", "h:1")))
    assert any("etcd://" in p for p in store_problems(cfg("--store_master_server_address", "etcd://h:1",
                                                          "--store_metadata_server", "P2PHANDSHAKE")))
    assert any("--enable_prefix_cache" in p for p in store_problems(cfg("--enable_prefix_cache", "false")))
    rdma = store_problems(cfg("--store_protocol", "rdma", "--store_master_server_address", "h:1",
                              "--store_metadata_server", "P2PHANDSHAKE"))
    if not Path("/sys/class/infiniband").exists():
        assert rdma and "--store_protocol=rdma: this machine has no RDMA device" in rdma[0]


def test_launch_checks_say_the_whole_problem(monkeypatch):
    """store_problems, message by message: each names its flag first and says what to do."""
    from heterollm.kv_cache import store_tier

    good = ("--store_master_server_address", "h:1", "--store_metadata_server", "P2PHANDSHAKE")
    assert store_problems(load_config(["--model", "m"]).config) == [], "the store off: nothing to check"
    assert store_problems(cfg(*good)) == []
    assert store_problems(cfg()) == [
        "--enable_kvcache_store: needs --store_master_server_address HOST:PORT (mooncake_master's RPC address)",
        "--enable_kvcache_store: needs --store_metadata_server (an http://HOST:PORT/metadata URL, e.g. "
        "mooncake_master's own with --enable_http_metadata_server, or P2PHANDSHAKE)"]
    assert store_problems(cfg(*good, "--enable_prefix_cache", "false")) == [
        "--enable_kvcache_store: the store keeps prefix-cache blocks (by hash): it needs --enable_prefix_cache"]
    assert store_problems(cfg("--store_master_server_address", "etcd://h:1", "--store_metadata_server", "x")) == [
        "--store_master_server_address=etcd://h:1: the highly available master (etcd://) is not built; give the "
        "one master's HOST:PORT"]
    assert store_problems(cfg(*good, "--store_rdma_devices", "mlx5_0")) == [
        "--store_rdma_devices: only read with --store_protocol=rdma"]
    assert store_problems(cfg(*good, "--draft_model", "d")) == [
        "--enable_kvcache_store: a draft model keeps its own KV cache, which the store does not hold: not served "
        "with --draft_model"]
    assert store_problems(cfg(*good, "--dp_size", "2", "--ep_size", "2")) == [
        "--enable_kvcache_store: not built for attention data parallelism (each DP rank keeps its own pool)"]
    monkeypatch.setattr(store_tier, "_rdma_devices", lambda: [])
    assert store_problems(cfg(*good, "--store_protocol", "rdma")) == [
        "--store_protocol=rdma: this machine has no RDMA device (/sys/class/infiniband is empty); use "
        "--store_protocol=tcp"]
    monkeypatch.setattr(store_tier, "_rdma_devices", lambda: ["mlx5_0", "mlx5_1"])
    assert store_problems(cfg(*good, "--store_protocol", "rdma")) == []
    assert store_problems(cfg(*good, "--store_protocol", "rdma", "--store_rdma_devices", "mlx5_1,,mlx5_0")) == []
    assert store_problems(cfg(*good, "--store_protocol", "rdma", "--store_rdma_devices", "mlx5_7,mlx5_0,mlx5_9")) == [
        "--store_rdma_devices=mlx5_7,mlx5_0,mlx5_9: no such RDMA device mlx5_7, mlx5_9 (present: mlx5_0, mlx5_1)"]


class FakeHF:
    def __init__(self, text: str = '{"model_type": "llama"}') -> None:
        self.text = text

    def to_json_string(self, use_diff: bool = True) -> str:
        return self.text if not use_diff else "{}"


def test_the_key_prefix_names_the_model_layout_and_nothing_else():
    from heterollm.kv_cache.store_tier import key_prefix

    def prefix(*argv, hf=FakeHF()):
        return key_prefix(load_config(["--model", "m", *argv]).config, hf)

    base = prefix()
    assert base == prefix() and re.fullmatch(r"heterollm/[0-9a-f]{16}", base)
    assert base == prefix("--max_model_len", "64", "--swap_space", "1"), "flags outside the layout do not matter"
    others = [prefix("--block_size", "32"), prefix("--dtype", "float16"), prefix("--kv_cache_dtype", "int8"),
              prefix("--tp_size", "2"), prefix("--xxh3_128bits_seed", "7"), prefix(hf=FakeHF('{"model_type": "qwen2"}'))]
    assert len({base, *others}) == 7, "each of them names another layout"
    assert block_key("heterollm/ab", 255, 3) == "heterollm/ab/000000000000000000000000000000ff/3"


class FakeClient:
    """Mooncake's put_batch / get_batch over a dict."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.setups = []

    def setup(self, *args):
        self.setups.append(args)
        return 0

    def put_batch(self, keys, values):
        self.data.update(zip(keys, values))
        return [0] * len(keys)

    def get_batch(self, keys):
        return [self.data.get(k, b"") for k in keys]


def connector(monkeypatch, client, rank, caches, world_size=2):
    from types import SimpleNamespace

    from heterollm.kv_cache import store_tier

    config = cfg("--store_master_server_address", "h:1", "--store_metadata_server", "P2PHANDSHAKE")
    monkeypatch.setitem(store_tier._CLIENTS, ("h:1", "P2PHANDSHAKE", "tcp"), client)
    launch = SimpleNamespace(rank=rank, world_size=world_size, config=config, source=SimpleNamespace(hf_config=FakeHF()))
    return store_tier.MooncakeStoreConnector(launch, caches, 2, 0)


def test_each_rank_puts_its_share_under_its_own_key_and_loads_it_back(monkeypatch):
    from heterollm.interfaces.kv_connector import KVTransfers
    from heterollm.kv_cache.store_tier import key_prefix

    client = FakeClient()
    shape = (2, 2, 5, BS, 3)  # (K/V, heads, blocks, block size, head dim), 2 layers per rank
    caches = {r: [torch.randn(shape) for _ in range(2)] for r in range(2)}
    conns = {r: connector(monkeypatch, client, r, caches[r]) for r in range(2)}
    prefix = key_prefix(cfg(), FakeHF())
    assert conns[0].prefix == prefix and conns[1].rank == 1
    for r in range(2):
        conns[r].save([(1, 0xA), (3, 0xB)])
    assert sorted(client.data) == sorted(block_key(prefix, h, r) for h in (0xA, 0xB) for r in range(2))
    # a share is every layer's slice of the block, in layer order: 2 x (2 x 2 x BS x 3) float32
    assert len(client.data[block_key(prefix, 0xA, 1)]) == 2 * 2 * 2 * BS * 3 * 4
    data = {h: [client.data[block_key(prefix, h, r)] for r in range(2)] for h in (0xA, 0xB)}
    for r in range(2):
        fresh = [torch.zeros(shape) for _ in range(2)]
        conn = connector(monkeypatch, client, r, fresh)
        conn.load([(0xB, 0), (0xA, 4)], data)
        for layer in range(2):
            assert torch.equal(fresh[layer][:, :, 0], caches[r][layer][:, :, 3])
            assert torch.equal(fresh[layer][:, :, 4], caches[r][layer][:, :, 1])
            assert not fresh[layer][:, :, 1:4].any(), "other blocks untouched"
    fresh = [torch.zeros(shape) for _ in range(2)]
    conn = connector(monkeypatch, client, 0, fresh)
    conn.apply(KVTransfers(save=[(2, 0xC)], load=[(0xA, 2)], data=data))  # the save runs first: it sees zeros
    assert client.data[block_key(prefix, 0xC, 0)] == bytes(len(data[0xA][0]))
    assert torch.equal(fresh[1][:, :, 2], caches[0][1][:, :, 1])
    conn.close()
    assert conn.caches == []


def test_the_store_connectors_apply_returns_no_failed_requests(monkeypatch):
    """The KVConnector contract: apply returns request id -> why for requests it failed (none here)."""
    from heterollm.interfaces.kv_connector import KVTransfers

    conn = connector(monkeypatch, FakeClient(), 0, [torch.zeros(2, 1, 2, BS, 2)])
    assert conn.apply(KVTransfers(save=[(0, 1)])) == {}
    problems = store_problems(cfg())
    assert problems and type(conn).validate(cfg()) == problems, "the connector's launch checks are the store's"


def test_only_a_single_process_engine_mounts_memory_into_the_store(monkeypatch):
    """A one-rank engine's connector shares the engine's client, which mounts 512 MiB into the store;
    with several ranks each rank's client mounts none (its puts and gets use the master's segments)."""
    from types import SimpleNamespace

    from heterollm.kv_cache import store_tier

    opened = []
    monkeypatch.setattr(store_tier, "open_store", lambda config, segment: opened.append(segment) or FakeClient())
    for world_size in (1, 2, 4):
        launch = SimpleNamespace(rank=0, world_size=world_size, config=cfg(), source=SimpleNamespace(hf_config=FakeHF()))
        store_tier.MooncakeStoreConnector(launch, [torch.zeros(2, 1, 2, BS, 2)], 2, 0)
    assert opened == [512 << 20, 0, 0]


def test_failed_puts_are_counted_and_logged(monkeypatch, caplog):
    """Mooncake's put_batch answers one code for the whole batch (its signature: -> int): a nonzero
    code or an exception fails every key of that batch, counted and logged."""
    client = FakeClient()
    conn = connector(monkeypatch, client, 0, [torch.zeros(2, 1, 3, BS, 2)])
    client.put_batch = lambda keys, values: 0
    conn.save([(0, 1), (1, 2), (2, 3)])
    assert conn.puts_failed == 0
    client.put_batch = lambda keys, values: -600

    def down(keys, values):
        raise RuntimeError("master gone")
    with caplog.at_level("WARNING", logger="heterollm.kv_cache.store"):
        conn.save([(0, 1), (1, 2)])
        assert conn.puts_failed == 2, "a nonzero code fails the batch's keys"
        client.put_batch = down
        conn.save([(0, 1), (1, 2)])
    assert conn.puts_failed == 4
    assert caplog.messages == ["KV store: putting 2 blocks failed (-600); they will be misses",
                               "KV store: putting 2 blocks failed (master gone); they will be misses"]


def test_a_one_block_cache_saves_and_loads(monkeypatch):
    client = FakeClient()
    cache = torch.randn(2, 1, 1, BS, 2)  # a pool of one block
    conn = connector(monkeypatch, client, 0, [cache], world_size=1)
    conn.save([(0, 0x5)])
    fresh = torch.zeros_like(cache)
    connector(monkeypatch, client, 0, [fresh], world_size=1).load(
        [(0x5, 0)], {0x5: [client.data[block_key(conn.prefix, 0x5, 0)]]})
    assert torch.equal(fresh, cache)


def test_open_store_sets_a_client_up_once_per_address(monkeypatch):
    import types

    from heterollm.kv_cache import store_tier

    made = []

    class Store(FakeClient):
        def __init__(self):
            super().__init__()
            made.append(self)

    module = types.ModuleType("mooncake.store")
    module.MooncakeDistributedStore = Store
    monkeypatch.setitem(sys.modules, "mooncake.store", module)
    probed = []
    monkeypatch.setattr(store_tier, "probe_store", probed.append)
    monkeypatch.setattr(store_tier, "_CLIENTS", {})
    config = cfg("--store_master_server_address", "m:9", "--store_metadata_server", "P2PHANDSHAKE")
    client = store_tier.open_store(config, 1234)
    assert made == [client] and store_tier.open_store(config, 99) is client, "once per address"
    assert probed == [config], "probed (fail fast) before the client is made, once"
    assert client.setups == [("127.0.0.1", "P2PHANDSHAKE", 1234, 64 << 20, "tcp", "", "m:9")]
    other = cfg("--store_master_server_address", "m:9", "--store_metadata_server", "P2PHANDSHAKE",
                "--store_local_hostname", "node7")
    monkeypatch.setattr(store_tier, "_CLIENTS", {})
    assert store_tier.open_store(other, 0).setups == [("node7", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", "m:9")]

    monkeypatch.setattr(store_tier, "_CLIENTS", {})
    Store.setup = lambda self, *args: -1
    with pytest.raises(ConfigError, match=r"^--enable_kvcache_store: the Mooncake store client did not start \(code "
                                          r"-1\) with --store_master_server_address=m:9 --store_metadata_server="
                                          r"P2PHANDSHAKE$"):
        store_tier.open_store(config, 0)
    assert store_tier._CLIENTS == {}
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(ConfigError, match=r"^--enable_kvcache_store: Mooncake's store is not installed \(.*\); pip "
                                          r"install 'heterollm\[kv\]' \(mooncake-transfer-engine-non-cuda\)$"):
        store_tier.open_store(config, 0)


def test_close_store_closes_the_addresss_client_once_and_a_failing_close_is_a_warning(monkeypatch, caplog):
    import logging

    from heterollm.kv_cache import store_tier

    config = cfg("--store_master_server_address", "m:9", "--store_metadata_server", "P2PHANDSHAKE")
    monkeypatch.setattr(store_tier, "_CLIENTS", {})
    store_tier.close_store(config)  # no client for the address: nothing to close, no error
    closed = []

    class Client:
        def close(self):
            closed.append(self)

    class Failing:
        def close(self):
            raise RuntimeError("the master went away")

    client, other = Client(), Client()
    store_tier._CLIENTS.update({("m:9", "P2PHANDSHAKE", "tcp"): client, ("n:9", "P2PHANDSHAKE", "tcp"): other})
    store_tier.close_store(config)
    store_tier.close_store(config)
    assert closed == [client] and list(store_tier._CLIENTS.values()) == [other], "once, and only its address's"
    store_tier._CLIENTS[("m:9", "P2PHANDSHAKE", "tcp")] = Failing()
    with caplog.at_level(logging.WARNING, logger="heterollm.kv_cache.store"):
        store_tier.close_store(config)
    assert [r.getMessage() for r in caplog.records] == ["closing the KV store client: the master went away"]
    assert list(store_tier._CLIENTS.values()) == [other]


def test_rdma_devices_are_the_entries_of_sys_class_infiniband_sorted(monkeypatch):
    import os

    from heterollm.kv_cache.store_tier import _rdma_devices

    def listdir(path):
        if path == "/sys/class/infiniband":
            return ["mlx5_1", "mlx5_0"]
        raise FileNotFoundError(path)
    monkeypatch.setattr(os, "listdir", listdir)
    assert _rdma_devices() == ["mlx5_0", "mlx5_1"]
    monkeypatch.setattr(os, "listdir", lambda path: (_ for _ in ()).throw(FileNotFoundError(path)))
    assert _rdma_devices() == [], "no such folder: no device"


def test_a_master_that_is_down_fails_at_once():
    started = time.monotonic()
    with pytest.raises(ConfigError, match="--store_master_server_address=127.0.0.1:.*does not answer"):
        probe_store(cfg("--store_master_server_address", f"127.0.0.1:{free_port()}", "--store_metadata_server",
                        "P2PHANDSHAKE"))
    assert time.monotonic() - started < 5


def test_the_master_address_is_host_colon_port_split_at_the_last_colon():
    from heterollm.kv_cache.store_tier import _hostport

    assert _hostport("h:50051") == ("h", 50051)
    assert _hostport("::1:50051") == ("::1", 50051), "an IPv6 host keeps its colons"
    for bad in ("h", ":50051", "h:", "h:x1"):
        with pytest.raises(ConfigError, match=rf"^--store_master_server_address={bad}: expected HOST:PORT$"):
            _hostport(bad)


def test_the_probe_checks_an_http_metadata_server_and_takes_a_4xx_as_an_answer():
    import http.server
    import threading

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(404)

        def log_message(self, *args):
            pass

    master = socket.socket()
    master.bind(("127.0.0.1", 0))
    master.listen()
    metadata = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=metadata.serve_forever, daemon=True).start()
    try:
        address = f"127.0.0.1:{master.getsockname()[1]}"
        for url in ("P2PHANDSHAKE", f"http://127.0.0.1:{metadata.server_address[1]}/metadata"):
            probe_store(cfg("--store_master_server_address", address, "--store_metadata_server", url))
        for scheme in ("http", "https"):
            url = f"{scheme}://127.0.0.1:{free_port()}/metadata"
            with pytest.raises(ConfigError, match=rf"^--store_metadata_server={url}: the metadata server does not "
                                                  r"answer \("):
                probe_store(cfg("--store_master_server_address", address, "--store_metadata_server", url))
    finally:
        metadata.shutdown()
        metadata.server_close()
        master.close()


@pytest.mark.slow  # a CLI process (~5-12 s); the in-process launch check stays in the default run
def test_the_cli_refuses_an_unreachable_master_with_exit_code_2(tmp_path):
    folder = build_tiny_model(tmp_path / "m", "llama")
    out = subprocess.run([str(Path(sys.executable).parent / "heterollm"), "generate", "--model", str(folder),
                          "--prompt", "hi", "--enable_kvcache_store", "--store_master_server_address",
                          f"127.0.0.1:{free_port()}", "--store_metadata_server", "P2PHANDSHAKE"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--store_master_server_address" in out.stderr and "Traceback" not in out.stderr


SECOND = """
import json, sys
from heterollm import LLM, SamplingParams
folder, master, metadata, prompts = json.loads(sys.argv[1])
llm = LLM(folder, dtype="float32", block_size=8, num_gpu_blocks_override=24, max_model_len=128,
          enable_kvcache_store=True, store_master_server_address=master, store_metadata_server=metadata)
outs = [o.outputs[0].token_ids for p in prompts
        for o in llm.generate([p], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))]
print("RESULT " + json.dumps([outs, llm.engine.stats()["prefix_store_hits"]]))
"""


def store_llm(folder: Path, master: str, metadata: str):
    """A tiny-model LLM on the store (the same launch as SECOND's)."""
    from heterollm import LLM
    return LLM(str(folder), dtype="float32", block_size=8, num_gpu_blocks_override=24, max_model_len=128,
               enable_kvcache_store=True, store_master_server_address=master, store_metadata_server=metadata)


@pytest.mark.slow  # real etcd / Mooncake timing (3-14 s): run in the slow CI step
def test_a_second_instance_hits_the_first_ones_blocks(mooncake, tmp_path):
    from heterollm import SamplingParams

    master, metadata = mooncake
    folder = build_tiny_model(tmp_path / "m", "llama")
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 20000) for _ in range(45)] for _ in range(4)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = store_llm(folder, master, metadata)
    try:
        outs = [o.outputs[0].token_ids for p in prompts for o in first.generate([p], params)]
        first.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # the step that puts the last prompt's blocks
        assert first.engine.kv_store.put >= 4 * 5
        # another process: its own store client, its own cache, nothing in common but the store
        run = subprocess.run([sys.executable, "-c", SECOND, json.dumps([str(folder), master, metadata, prompts])],
                             capture_output=True, text=True, timeout=300)
        line = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
        assert line, run.stderr[-3000:]
        second, store_hits = json.loads(line[0][len("RESULT "):])
    finally:
        first.shutdown()
    assert second == outs
    assert store_hits == 4 * 5 * 8, "each 45-token prompt: its 5 full blocks from the store"


class RecordingClient:
    """Mooncake's put_batch contract, recording the batches (and refusing one over a byte limit, as
    the client refuses a batch larger than its transfer buffer)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.batches = limit, []

    def put_batch(self, keys, values):
        self.batches.append(len(keys))
        return -600 if sum(len(v) for v in values) > self.limit else 0


def test_puts_go_in_batches_that_fit_the_clients_buffer(monkeypatch):
    import torch

    import heterollm.kv_cache.store_tier as st

    caches = [torch.zeros(2, 2, 8, 4, 16) for _ in range(3)]  # a block: 3 layers x 2 x 2 x 4 x 16 x 4 bytes
    block = 3 * 2 * 2 * 4 * 16 * 4
    conn = st.MooncakeStoreConnector.__new__(st.MooncakeStoreConnector)
    conn.caches, conn.block_dim, conn.rank, conn.prefix, conn.puts_failed = caches, 2, 0, "p", 0
    conn._block_bytes = block
    conn.client = RecordingClient(limit=3 * block)
    monkeypatch.setattr(st, "BUFFER_BYTES", 6 * block)  # half of it: 3 blocks per put_batch
    conn.save([(b, 100 + b) for b in range(7)])
    assert conn.client.batches == [3, 3, 1] and conn.puts_failed == 0
    conn.client.limit = 2 * block  # the client refuses the full batches: their blocks are counted, not lost silently
    conn.save([(b, 200 + b) for b in range(7)])
    assert conn.puts_failed == 6


def test_fetch_batches_fit_the_clients_buffer(monkeypatch):
    import heterollm.kv_cache.store_tier as st

    monkeypatch.setattr(st, "BUFFER_BYTES", 1000)
    tier = StoreTier(FakeStore(), "p", ranks=2, batch_size=8, timeout_ms=0)
    tier.fit_batches(100)  # a block: 2 ranks x 100 bytes; half the buffer holds 2 blocks
    assert tier.batch_size == 2
    tier.fit_batches(10_000)  # larger than the buffer: one block at a time, never none
    assert tier.batch_size == 1
    calls = []
    tier.client.get_batch = lambda keys: calls.append(len(keys)) or [b"x"] * len(keys)
    assert len(tier.fetch([1, 2, 3])[0]) == 3 and calls == [2, 2, 2]


@pytest.mark.slow  # a real Mooncake master and two launches (~20 s): the slow CI step
def test_shutdown_closes_the_store_client_and_its_blocks_leave_the_store(mooncake, tmp_path):
    """A one-rank instance's client mounts its memory into the store, and the blocks it puts live
    there: LLM.shutdown closes the client, so those blocks leave with it (README), and a later
    instance in the same process opens a client of its own and finds none of them."""
    from heterollm import SamplingParams
    from heterollm.kv_cache import store_tier

    master, metadata = mooncake
    folder = build_tiny_model(tmp_path / "m", "llama")
    prompt = [random.Random(2).randrange(100, 20000) for _ in range(45)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    key = (master, metadata, "tcp")
    first = store_llm(folder, master, metadata)
    try:
        first.generate([prompt], params)
        first.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # the step that puts the prompt's blocks
        assert first.engine.kv_store.put >= 5
        client = store_tier._CLIENTS[key]
    finally:
        first.shutdown()
    assert key not in store_tier._CLIENTS
    second = store_llm(folder, master, metadata)
    try:
        assert store_tier._CLIENTS[key] is not client
        second.generate([prompt], params)
        assert second.engine.stats()["prefix_store_hits"] == 0  # 40 (5 blocks of 8) with the client left open
    finally:
        second.shutdown()


@pytest.mark.slow  # a real Mooncake master and two launches (~15 s): the slow CI step
def test_a_launch_that_fails_after_the_store_opened_closes_its_client(mooncake, tmp_path, monkeypatch):
    """The store client opens before the weights load (an unreachable master fails fast); a launch
    that fails after that (here: planted in the KV cache's sizing) closes the client, so its mounted
    memory does not stay in the store for the rest of the process, and the next launch opens its own."""
    from heterollm import SamplingParams
    from heterollm.config import ConfigError
    from heterollm.engine.llm_engine import LLMEngine
    from heterollm.kv_cache import store_tier

    master, metadata = mooncake
    folder = build_tiny_model(tmp_path / "m", "llama")
    key = (master, metadata, "tcp")
    opened = []
    real_open = store_tier.open_store

    def recording_open(config, segment_bytes):
        opened.append(real_open(config, segment_bytes))
        return opened[-1]

    def failing_plan(self, config, max_len):
        raise ConfigError("planted: sizing failed")

    monkeypatch.setattr("heterollm.engine.llm_engine.open_store", recording_open)
    with monkeypatch.context() as patch:
        patch.setattr(LLMEngine, "_plan_kv_cache", failing_plan)
        with pytest.raises(ConfigError, match="planted"):
            store_llm(folder, master, metadata)
    assert len(opened) == 1 and key not in store_tier._CLIENTS
    second = store_llm(folder, master, metadata)
    try:
        assert len(opened) == 2 and store_tier._CLIENTS[key] is opened[1] is not opened[0]
        [out] = second.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 3
    finally:
        second.shutdown()
