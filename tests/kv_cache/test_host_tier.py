"""The host KV tier (--host_blocks_factor, --swap_space): evicted prefix-cache blocks spill to host
slots and come back on a hit; the moves each step carries; the "host" KV connector's copies; the
engine end to end (same greedy tokens, more hits, no leaked blocks, preemption resumed from the
host); the launch checks; a vendor's own "host" connector chosen as models are."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from heterollm.config import load_config
from heterollm.interfaces.kv_connector import KVTransfers
from heterollm.kv_cache import KVCacheManager
from heterollm.kv_cache.host_tier import HostMemoryConnector, HostTier, host_slots_for
from heterollm.plugins import LaunchError, Registry, resolve

from helpers import ADMIT_ALL, build_tiny_model

BS = 4


def kv(num_blocks: int = 4, host: int = 8, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_prefix_cache=True, host_slots=host, **kw)


def run(m: KVCacheManager, rid: str, tokens: list[int]) -> int:
    """Admit `rid` as the scheduler does (match, allocate), mark it computed, finish it."""
    cached = m.match_prefix(rid, tokens)
    assert m.allocate(rid, len(tokens)) is not None
    m.commit(rid, tokens, len(tokens))
    m.free(rid)
    return cached


def moves(m: KVCacheManager) -> KVTransfers | None:
    """The host connector's moves for the next step."""
    t = m.take_transfers()
    assert t is None or set(t) == {"host"}
    return t["host"] if t else None


def prompt(start: int, blocks: int = 2) -> list[int]:
    return list(range(start, start + blocks * BS)) + [9999]  # full blocks and one more token


def test_evicted_blocks_spill_to_the_host_and_come_back_on_a_hit():
    m = kv(num_blocks=3)
    a, b = prompt(100), prompt(200)
    run(m, "a", a)  # a's 2 full blocks + 1 partial: the 3 device blocks
    assert moves(m) is None
    run(m, "b", b)  # needs 3: evicts a's cached blocks (its partial block went back plain)
    first = moves(m)
    assert first is not None and first.load == []
    assert len(first.save) == 2 and m.host.saved == 2 and m.host.num_used == 2
    assert moves(m) is None, "moves are handed out once"

    assert m.match_prefix("a2", a) == 2 * BS, "a's prefix is found in the host tier"
    table = m.allocate("a2", len(a))
    t = moves(m)
    assert [blk for _, blk in t.load] == table[:2], "the slots are copied into the request's first two blocks"
    assert sorted(slot for slot, _ in t.load) == sorted(slot for _, slot in first.save)
    assert m.host.loaded == 2 and m.host_hits == 2 * BS and m.hits == 2 * BS
    # the loaded blocks are cached on the device again: a third request shares them
    m.commit("a2", a, len(a))
    assert m.match_prefix("a3", a) == 2 * BS and moves(m) is None


def test_saves_come_before_loads_and_a_slot_being_loaded_is_not_reused():
    m = kv(num_blocks=2, host=1)
    a, b = prompt(100, 1), prompt(200, 1)
    run(m, "a", a)  # a: one full block (cached) and a partial one: the whole pool
    run(m, "b", b)  # evicts a's full block into the one slot
    ta = moves(m)
    assert len(ta.save) == 1 and ta.load == []
    # a comes back while the pool must evict b's block to make room: the one slot is what this
    # step reads, so b's block is dropped rather than saved over it
    assert m.match_prefix("a2", a) == BS
    assert m.allocate("a2", len(a)) is not None
    t = moves(m)
    assert t.load == [(ta.save[0][1], m.tables["a2"][0])] and t.save == []
    assert m.host.dropped == 1
    # once handed out, the slot is evictable again
    m.free("a2")
    run(m, "c", prompt(300, 1))  # evicts a's block again: the slot still holds it, no copy
    assert moves(m) is None
    run(m, "d", prompt(400, 1))  # evicts c's block: into the slot, a's copy goes
    assert len(moves(m).save) == 1 and m.host.saved == 2
    assert m.match_prefix("a3", a) == 0


def test_host_slots_are_evicted_least_recently_used_and_a_full_tier_drops():
    tier = HostTier(2)
    tier.spill(0, 11)
    tier.spill(1, 22)
    tier.spill(2, 11)  # already held: recent again, no copy
    assert tier.saved == 2
    tier.spill(3, 33)  # evicts 22, the least recently used
    assert tier.lookup(22) is None and tier.lookup(11) is not None and tier.lookup(33) is not None
    tier.take_transfers()
    tier.pin([11, 33])
    tier.spill(4, 44)  # every slot is about to be read: nothing to give
    assert tier.dropped == 1 and tier.lookup(44) is None


def test_reset_prefix_cache_forgets_the_host_tier_and_frees_slots_after_pending_loads():
    m = kv(num_blocks=3, host=2)
    a, b = prompt(100), prompt(200)
    run(m, "a", a)
    run(m, "b", b)
    moves(m)
    m.match_prefix("a2", a)
    m.allocate("a2", len(a))  # loads pending from both slots
    m.reset_prefix_cache()
    assert m.host.num_used == 0 and m.match_prefix("x", a) == 0
    t = moves(m)
    assert len(t.load) == 2, "loads already promised still run"
    assert sorted(m.host._free) == [0, 1], "their slots are free again once handed out"


def test_no_block_leaks_through_spills_and_loads():
    m = kv(num_blocks=6, host=5)
    rng = random.Random(0)
    starts = [100 * i for i in range(1, 6)]
    for _ in range(40):
        run(m, f"r{rng.random()}", prompt(rng.choice(starts), rng.randrange(1, 3)))
        moves(m)
    assert m.num_free_blocks == 6 and not m.tables
    assert m.host.num_used <= 5 and m.host.loaded > 0


def test_host_slots_for_the_flags():
    def cfg(*argv):
        return load_config(["--model", "m", *argv]).config
    assert host_slots_for(cfg(), 100, 1 << 20) == 0
    assert host_slots_for(cfg("--host_blocks_factor", "2.5"), 100, 1 << 20) == 250
    assert host_slots_for(cfg("--swap_space", "0.5"), 100, 1 << 20) == 512  # GiB / bytes per block
    assert host_slots_for(cfg("--swap_space", "0.5", "--host_blocks_factor", "8"), 100, 1 << 20) == 800


def test_connector_copies_blocks_along_the_backends_block_dimension():
    caches = [torch.randn(2, 3, 5, BS, 8) for _ in range(2)]  # (K/V, heads, blocks, slots, dim)
    original = [c.clone() for c in caches]
    conn = HostMemoryConnector(None, caches, 2, 4)
    assert conn.nbytes == 2 * 2 * 3 * 4 * BS * 8 * 4
    conn.apply(KVTransfers(save=[(1, 3), (4, 0)]))
    for c in caches:
        c[:, :, 1].zero_()
    conn.apply(KVTransfers(load=[(3, 2), (0, 1)]))
    for c, o in zip(caches, original):
        assert torch.equal(c[:, :, 2], o[:, :, 1]) and torch.equal(c[:, :, 1], o[:, :, 4])
        assert torch.equal(c[:, :, 0], o[:, :, 0]) and torch.equal(c[:, :, 3], o[:, :, 3])
    # one step saves block 3 into slot 3 and loads slot 3 into block 4: the save runs first
    conn.apply(KVTransfers(save=[(3, 3)], load=[(3, 4)]))
    for c, o in zip(caches, original):
        assert torch.equal(c[:, :, 4], o[:, :, 3])


# -- the engine, end to end ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("host_tier") / "m", "llama")


def _rounds(folder: Path, **flags):
    from heterollm import LLM, SamplingParams

    rng = random.Random(1)
    systems = [[rng.randrange(100, 20000) for _ in range(40)] for _ in range(6)]
    prompts = [s + [rng.randrange(100, 20000) for _ in range(5)] for s in systems]
    llm = LLM(str(folder), dtype="float32", block_size=8, num_gpu_blocks_override=24, max_model_len=128, **flags)
    try:
        free0 = llm.engine.kv.num_free_blocks
        outs = []
        for _ in range(2):  # the second round finds the first's prompts only where the tier kept them
            for p in prompts:
                outs += [o.outputs[0].token_ids for o in
                         llm.generate([p], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))]
        return outs, llm.engine.stats(), llm.engine.kv.num_free_blocks == free0
    finally:
        llm.shutdown()


def test_a_working_set_larger_than_the_pool_hits_the_host_tier_with_the_same_tokens(tiny):
    base, base_stats, base_free = _rounds(tiny)
    tier, stats, free = _rounds(tiny, host_blocks_factor=4.0)
    assert tier == base, "the blocks copied back hold the K/V the prompt would compute"
    assert base_stats["prefix_hits"] == 0 and base_free and free
    assert stats["host_tier_blocks"] == 96 and stats["host_tier_saved"] > 0
    assert stats["prefix_host_hits"] == stats["prefix_hits"] == 6 * 40, "each second-round prompt: 5 full blocks"
    assert stats["host_tier_loaded"] == 6 * 5


def test_preemption_resumes_from_the_host_tier(tiny):
    """A pool too small for the batch preempts; the preempted requests' blocks spill to the host and
    come back when they resume (FastDeploy's --swap_space)."""
    from heterollm import LLM, SamplingParams

    rng = random.Random(3)
    prompts = [[rng.randrange(100, 20000) for _ in range(33)] for _ in range(4)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    results = {}
    for name, flags in {"recompute": {}, "swap": {"swap_space": 0.01}}.items():
        llm = LLM(str(tiny), dtype="float32", block_size=8, num_gpu_blocks_override=20, max_model_len=128,
                  **ADMIT_ALL, **flags)
        try:
            outs = llm.generate(prompts, params)
            results[name] = ([o.outputs[0].token_ids for o in outs], llm.engine.stats(),
                             llm.engine.kv.num_free_blocks, llm.engine.scheduler.num_preemptions)
        finally:
            llm.shutdown()
    (ref, ref_stats, _, ref_pre), (got, stats, free, pre) = results["recompute"], results["swap"]
    assert ref_pre > 0 and pre > 0, "the pool is small enough to preempt"
    assert got == ref
    assert stats["prefix_host_hits"] > ref_stats["prefix_host_hits"] == 0
    assert free == 20


def test_launch_checks():
    def reasons(*argv):
        with pytest.raises(LaunchError) as info:
            resolve(load_config(["--model", "m", *argv]).config, Registry.discover(), ["LlamaForCausalLM"])
        return str(info.value)

    assert "needs --enable_prefix_cache" in reasons("--host_blocks_factor", "2", "--enable_prefix_cache", "false")
    assert "--swap_space" in reasons("--swap_space", "1", "--enable_prefix_cache", "false")
    assert "--draft_model" in reasons("--host_blocks_factor", "2", "--speculative_algorithm", "draft_model",
                                      "--draft_model", "d", "--num_speculative_tokens", "2")
    sel = resolve(load_config(["--model", "m", "--host_blocks_factor", "2"]).config, Registry.discover(),
                  ["LlamaForCausalLM"])
    assert sel.components["kv_connectors.host"].obj is HostMemoryConnector


def test_a_vendor_family_ships_its_own_host_connector(fake_dists):
    fake_dists("fakeplug-tier", "1.0", {"heterollm.backends": {"pinned": "fakeplug_tier:BACKEND"}}, {
        "fakeplug_tier/__init__.py": "from heterollm.interfaces.backend import Backend\n"
        "BACKEND = Backend(name='pinned', api_version='>=2.0,<3', platforms=('cpu',), "
        "kv_connectors={'host': 'fakeplug_tier.c:Pinned'})\n",
        "fakeplug_tier/c.py": "from heterollm.kv_cache.host_tier import HostMemoryConnector\n"
                              "class Pinned(HostMemoryConnector):\n    pass\n"})
    reg = Registry.discover()
    cfg = ["--model", "m", "--host_blocks_factor", "2"]
    sel = resolve(load_config([*cfg, "--extension_impl", "pinned"]).config, reg, ["LlamaForCausalLM"])
    assert sel.components["kv_connectors.host"].family == "pinned" and "pinned" in sel.backends
    assert sel.components["attention"].name == "cpu"
    sel = resolve(load_config(cfg).config, reg, ["LlamaForCausalLM"])
    assert sel.components["kv_connectors.host"].family == "core"


@pytest.mark.slow
def test_tensor_parallel_ranks_each_move_their_shard(tiny):
    """Under --tp_size 2 every rank holds its heads' share of each block and runs the same moves."""
    base, _, _ = _rounds(tiny, tp_size=2)
    tier, stats, free = _rounds(tiny, tp_size=2, host_blocks_factor=4.0)
    assert tier == base and free and stats["prefix_host_hits"] == 6 * 40


def test_a_tier_larger_than_the_hosts_memory_is_refused_naming_the_flag(tiny):
    from heterollm import LLM
    from heterollm.config import ConfigError

    with pytest.raises(ConfigError, match=r"--swap_space: the host KV tier needs .* of host memory"):
        LLM(str(tiny), dtype="float32", block_size=8, num_gpu_blocks_override=24, max_model_len=128,
            swap_space=1 << 20)
