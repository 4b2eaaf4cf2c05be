"""The KV cache store (--enable_kvcache_store) over a real Mooncake master on loopback
(scripts/mooncake.sh): a second instance finds the first one's blocks with the same greedy tokens;
puts wait for the step that computes a block and skip a block renamed since; a fetch that fails is
a miss; the launch checks fail fast naming the flag."""
from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from heterollm.config import ConfigError, load_config
from heterollm.kv_cache import KVCacheManager
from heterollm.kv_cache.store_tier import StoreTier, block_key, probe_store, store_problems

from helpers import build_tiny_model

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


class FakeStore:
    """A dict with Mooncake's get_batch contract (b"" for a missing key)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def get_batch(self, keys):
        return [self.data.get(k, b"") for k in keys]


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


def test_a_master_that_is_down_fails_at_once():
    started = time.monotonic()
    with pytest.raises(ConfigError, match="--store_master_server_address=127.0.0.1:.*does not answer"):
        probe_store(cfg("--store_master_server_address", f"127.0.0.1:{free_port()}", "--store_metadata_server",
                        "P2PHANDSHAKE"))
    assert time.monotonic() - started < 5


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


def test_a_second_instance_hits_the_first_ones_blocks(mooncake, tmp_path):
    from heterollm import LLM, SamplingParams

    master, metadata = mooncake
    folder = build_tiny_model(tmp_path / "m", "llama")
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 20000) for _ in range(45)] for _ in range(4)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = LLM(str(folder), dtype="float32", block_size=8, num_gpu_blocks_override=24, max_model_len=128,
                enable_kvcache_store=True, store_master_server_address=master, store_metadata_server=metadata)
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
