"""The host KV tier (--host_blocks_factor, --swap_space): evicted prefix-cache blocks spill to host
slots and come back on a hit; the moves each step carries; the "host" KV connector's copies; the
engine end to end (same greedy tokens, more hits, no leaked blocks, preemption resumed from the
host); the launch checks; a vendor's own "host" connector chosen as models are."""
from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch

from heterollm.config import load_config
from heterollm.config.checks import check_flag_combinations
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


def test_a_host_tier_needs_a_slot_and_starts_empty():
    with pytest.raises(ValueError, match=r"^the host tier needs at least one slot, got 0$"):
        HostTier(0)
    with pytest.raises(ValueError, match=r"got -1$"):
        HostTier(-1)
    tier = HostTier(1)
    assert (tier.num_slots, tier.num_used, tier.saved, tier.loaded, tier.dropped) == (1, 0, 0, 0, 0)
    assert tier.take_transfers() is None


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
    tier.spill(5, 55)
    assert tier.dropped == 2 and tier.saved == 3


def test_a_reset_frees_every_slot_and_the_ones_being_read_once_their_loads_are_handed_out():
    tier = HostTier(3)
    for block, h in enumerate((11, 22, 33)):
        tier.spill(block, h)
    tier.take_transfers()
    read = tier.lookup(11)
    tier.load(11, 5)  # this slot is being read by the next step
    tier.clear()
    assert tier.num_used == 0 and tier.lookup(11) is None and tier.lookup(22) is None
    tier.spill(8, 44)
    tier.spill(9, 55)  # the two slots not being read: neither evicts the other
    assert tier.num_used == 2 and tier.dropped == 0
    assert {tier.lookup(44), tier.lookup(55)} == {0, 1, 2} - {read}
    t = tier.take_transfers()
    assert t.load == [(read, 5)]
    tier.spill(10, 66)  # the read slot is free again: nothing evicted
    assert tier.lookup(66) == read and tier.num_used == 3 and tier.dropped == 0


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


def a_spilled() -> tuple[KVCacheManager, list[int]]:
    """A 3-block pool whose prompt `a` ran, then another prompt evicted a's 2 full blocks to the host."""
    m = kv(num_blocks=3)
    a = prompt(100)
    run(m, "a", a)
    run(m, "b", prompt(200))
    moves(m)
    return m, a


def test_a_later_match_forgets_host_hits_an_earlier_one_found():
    """A waiting request found its prefix in the host tier; before its admission another request
    loaded those blocks back onto the device. Its next match finds them on the device, and its
    admission shares them and loads nothing."""
    m, a = a_spilled()
    assert m.match_prefix("r", a) == 2 * BS  # from the host; r waits
    assert m.match_prefix("s", a) == 2 * BS
    s_table = list(m.allocate("s", len(a)))
    m.commit("s", a, len(a))
    assert len(moves(m).load) == 2
    m.free("s")
    assert m.match_prefix("r", a) == 2 * BS  # on the device now
    table = m.allocate("r", len(a))
    assert table[:2] == s_table[:2]
    assert moves(m) is None, "nothing to load for r"
    assert m.host.loaded == 2


def test_a_refused_allocation_drops_the_host_matches():
    """allocate returns None with the matched blocks dropped: a later allocate without a new match
    loads nothing from the host tier."""
    m, a = a_spilled()
    assert m.match_prefix("r", a) == 2 * BS
    assert m.allocate("o", 3 * BS) is not None  # the whole pool
    assert m.allocate("r", len(a)) is None
    m.free("o")
    moves(m)
    assert len(m.allocate("r", len(a))) == 3
    assert moves(m) is None and m.host.loaded == 0 and m.host_hits == 0


def test_hit_counters_add_up_over_requests():
    m = kv(num_blocks=3)
    a, b = prompt(100), prompt(200)
    run(m, "a", a)
    run(m, "b", b)  # a's 2 full blocks go to the host
    assert run(m, "a2", a) == 2 * BS  # from the host; loading them evicts b's 2 to the host
    assert run(m, "b2", b) == 2 * BS  # from the host
    assert m.host.loaded == 4
    assert (m.queries, m.hits, m.host_hits) == (4 * len(a), 4 * BS, 4 * BS)


def test_host_blocks_must_continue_a_fully_committed_table():
    """r holds one block it has not committed; a match from block 1 finds a's block 1 in the host:
    loading it after an uncommitted block is refused."""
    m = kv(num_blocks=3)
    a, b = prompt(100), prompt(200)
    run(m, "a", a)
    run(m, "b", b)  # a's 2 full blocks go to the host
    m.allocate("r", BS)  # block 0 of r: written, not committed
    assert m.match_prefix("r", a, start_block=1) == BS
    with pytest.raises(RuntimeError, match="^r: host-tier blocks must continue a fully committed table$"):
        m.allocate("r", len(a))


def test_the_tier_needs_the_prefix_cache_and_drop_forgets_host_matches():
    with pytest.raises(ValueError, match=r"^the host tier keeps prefix-cache blocks: it needs the prefix cache$"):
        KVCacheManager(4, BS, host_slots=2)
    m, a = a_spilled()
    assert m.match_prefix("r", a) == 2 * BS
    m.drop("r")  # e.g. aborted while waiting
    assert len(m.allocate("r", len(a))) == 3  # fresh blocks: evicts b's 2 cached ones to the host
    t = moves(m)
    assert t.load == [] and len(t.save) == 2 and m.host.loaded == 0


def test_host_slots_for_the_flags():
    def cfg(*argv):
        return load_config(["--model", "m", *argv]).config
    assert host_slots_for(cfg(), 100, 1 << 20) == 0
    assert host_slots_for(cfg("--host_blocks_factor", "2.5"), 100, 1 << 20) == 250
    assert host_slots_for(cfg("--swap_space", "0.5"), 100, 1 << 20) == 512  # GiB / bytes per block
    assert host_slots_for(cfg("--swap_space", "0.5", "--host_blocks_factor", "8"), 100, 1 << 20) == 800
    # a block of no bytes (nothing to size by): --swap_space gives no slots, the factor still does
    assert host_slots_for(cfg("--swap_space", "0.5"), 100, 0) == 0
    assert host_slots_for(cfg("--swap_space", "0.5", "--host_blocks_factor", "2"), 100, 0) == 200
    assert host_slots_for(cfg("--swap_space", "0.5"), 100, 1) == 2**29  # one byte a block


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


def test_connector_slots_keep_the_caches_dtype():
    caches = [torch.randn(2, 3, 5, BS, 8).to(torch.float16)]
    original = caches[0].clone()
    conn = HostMemoryConnector(None, caches, 2, 4)
    assert conn.slots[0].dtype == torch.float16 and conn.slots[0].device.type == "cpu"
    assert conn.nbytes == 2 * 3 * 4 * BS * 8 * 2  # 4 slots of the cache's shape, 2 bytes an element
    conn.apply(KVTransfers(save=[(4, 1)]))
    caches[0][:, :, 4].zero_()
    conn.apply(KVTransfers(load=[(1, 4)]))
    assert torch.equal(caches[0], original)
    conn.close()  # lets go of the slots and the caches
    assert conn.nbytes == 0 and conn.slots == [] and conn.caches == []


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


def test_preemption_resumes_from_the_host_tier(tiny, caplog):
    """A pool too small for the batch preempts; the preempted requests' blocks spill to the host and
    come back when they resume (FastDeploy's --swap_space)."""
    from heterollm import LLM, SamplingParams

    caplog.set_level(logging.INFO, logger="heterollm.engine")

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
    # --swap_space 0.01 GiB in blocks of 2 layers x (K, V) x 2 KV heads x 16 x 8 slots x 4 bytes = 4,096
    # bytes: 0.01 x 2**30 // 4,096 = 2,621 slots, 10.2 MiB; the launch says so once (the swap run)
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("host KV tier")] == [
        "host KV tier: 2621 blocks (10 MiB over all ranks) behind the 20-block pool"]


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


def test_launch_checks_say_the_whole_problem_naming_the_flag_that_sized_the_tier():
    from heterollm.kv_cache.host_tier import host_tier_problems

    def problems(*argv):
        return host_tier_problems(load_config(["--model", "m", *argv]).config)

    assert problems() == [] and problems("--enable_prefix_cache", "false") == [], "no tier: nothing to check"
    assert problems("--host_blocks_factor", "0.5") == []
    needs = "the host tier keeps prefix-cache blocks (by hash): it needs --enable_prefix_cache"
    assert problems("--host_blocks_factor", "0.5", "--enable_prefix_cache", "false") == [f"--host_blocks_factor: {needs}"]
    assert problems("--swap_space", "1", "--enable_prefix_cache", "false") == [f"--swap_space: {needs}"]
    assert problems("--host_blocks_factor", "2", "--dp_size", "2", "--ep_size", "2") == [
        "--host_blocks_factor: the host tier is not built for attention data parallelism (--dp_size with "
        "--enable_attention_dp / MoE): each DP rank keeps its own pool"]
    assert problems("--swap_space", "1", "--draft_model", "d") == [
        "--swap_space: a draft model keeps its own KV cache, which the host tier does not move: not served with "
        "--draft_model"]


def test_host_available_bytes_reads_memavailable_else_the_free_pages(monkeypatch):
    import io

    from heterollm.kv_cache import host_tier

    def meminfo(text):
        def fake_open(path, *args, **kwargs):
            assert path == "/proc/meminfo"
            return io.StringIO(text)
        return fake_open

    pages = {"SC_AVPHYS_PAGES": 7, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(host_tier.os, "sysconf", lambda name: pages[name])
    monkeypatch.setattr(host_tier, "open", meminfo("MemTotal:  16000 kB\nMemFree:  1000 kB\nMemAvailable:  4200 kB\n"),
                        raising=False)
    assert host_tier.host_available_bytes() == 4200 * 1024
    monkeypatch.setattr(host_tier, "open", meminfo("MemTotal:  16000 kB\nMemFree:  1000 kB\n"), raising=False)
    assert host_tier.host_available_bytes() == 7 * 4096, "an old kernel: no MemAvailable line"

    def unreadable(path, *args, **kwargs):
        raise PermissionError(path)
    monkeypatch.setattr(host_tier, "open", unreadable, raising=False)
    assert host_tier.host_available_bytes() == 7 * 4096


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


# -- --layers_wise_copy_batchs ---------------------------------------------------------------------
def test_layer_groups_split_consecutive_layers():
    from heterollm.model_executor.layerwise import layer_groups

    assert layer_groups(30, 4) == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert layer_groups(2, 4) == [range(0, 1), range(1, 2)] and layer_groups(5, 1) == [range(0, 5)]
    assert layer_groups(3, 0) == [range(0, 3)]


def test_the_forward_waits_for_each_layers_group_of_a_slow_copy(tiny, monkeypatch):
    """The groups after the first are copied by a thread that is made slow here: each layer's
    attention must wait for its own group, or it reads a block the copy has not filled yet (the tokens
    would differ). A group copied while the forward runs is counted, so the test knows it overlapped."""
    import threading
    import time as _time

    from heterollm.model_executor import layerwise

    base, _, _ = _rounds(tiny, host_blocks_factor=4.0, layers_wise_copy_batchs=1)
    late = []
    original = HostMemoryConnector.load_layers

    def slow(self, pairs, layers):
        if threading.current_thread() is not threading.main_thread():
            _time.sleep(0.05)
            late.append(layers)
        original(self, pairs, layers)

    monkeypatch.setattr(HostMemoryConnector, "load_layers", slow)
    waits = []
    monkeypatch.setattr(layerwise.LayerwiseLoad, "wait", lambda self, layer, w=layerwise.LayerwiseLoad.wait:
                        (waits.append(layer), w(self, layer))[1])
    got, stats, free = _rounds(tiny, host_blocks_factor=4.0, layers_wise_copy_batchs=2)
    assert got == base and free and stats["host_tier_loaded"] == 6 * 5
    assert late and all(g == range(1, 2) for g in late), "the tiny model's 2 layers: group 1 by the thread"
    assert set(waits) == {0, 1}


def test_layers_wise_copy_batchs_needs_a_host_tier():
    problems = check_flag_combinations(load_config(["--model", "m", "--layers_wise_copy_batchs", "2"]).config)
    assert problems == ["--layers_wise_copy_batchs=2: paces the host KV tier's copies back; there is no host tier "
                        "without --host_blocks_factor or --swap_space"]
    assert check_flag_combinations(load_config(["--model", "m", "--layers_wise_copy_batchs", "2",
                                                "--swap_space", "1"]).config) == []


# -- --enable_control_h2d_block_num ----------------------------------------------------------------
def test_copy_budget_hides_the_copy_under_the_steps_compute():
    from heterollm.scheduler.latency import LatencyTargets, StepTimeModel

    targets = LatencyTargets(StepTimeModel(), tpot_ms=50, ttft_ms=None)
    targets.observe_copy(10, 0.1)
    assert targets.copy_budget() is None, "off without --enable_control_h2d_block_num"
    targets.h2d_control = True
    fresh = LatencyTargets(StepTimeModel(), tpot_ms=50, ttft_ms=None)
    fresh.h2d_control = True
    assert fresh.copy_budget() is None, "nothing measured yet: no cap"
    assert targets.copy_s_per_block == pytest.approx(0.01) and targets.copy_budget() == 5  # 50 ms / 10 ms
    targets.observe_copy(1, 0.06)  # a moving average: 0.8 * 10 ms + 0.2 * 60 ms
    assert targets.copy_s_per_block == pytest.approx(0.02) and targets.copy_budget() == 2
    targets.observe_copy(0, 1.0)
    assert targets.copy_s_per_block == pytest.approx(0.02)
    slow = LatencyTargets(StepTimeModel(), tpot_ms=50, ttft_ms=None)
    slow.h2d_control = True
    slow.observe_copy(1, 0.2)
    assert slow.copy_budget() == 1, "one block at least: the copy speed keeps being measured"
    untargeted = LatencyTargets(StepTimeModel(), tpot_ms=None, ttft_ms=None)
    untargeted.h2d_control = True
    untargeted.observe_copy(1, 0.001)
    assert untargeted.copy_budget() is None, "no TPOT target: no cap"


def test_a_capped_copy_loads_fewer_host_blocks_and_recomputes_the_rest(tiny, monkeypatch):
    from heterollm.scheduler.latency import LatencyTargets

    base, _, _ = _rounds(tiny, host_blocks_factor=4.0)
    monkeypatch.setattr(LatencyTargets, "observe_copy", lambda self, blocks, seconds: setattr(
        self, "copy_s_per_block", self.tpot_s / 2.5))  # whatever was measured: 2 blocks per step
    flags = dict(host_blocks_factor=4.0, enable_latency_aware_schedule=True, max_global_tpot_ms=200,
                 enable_control_h2d_block_num=True)
    got, stats, free = _rounds(tiny, **flags)
    assert got == base and free
    # the first second-round prompt loads its 5 blocks (nothing measured before it), the other five 2 each
    assert stats["host_tier_loaded"] == 5 + 5 * 2
    assert stats["prefix_host_hits"] == 8 * (5 + 5 * 2)


def test_control_h2d_block_num_needs_a_host_tier_and_the_latency_model():
    def problems(*argv):
        return check_flag_combinations(load_config(["--model", "m", "--enable_control_h2d_block_num", *argv]).config)

    assert problems() == [
        "--enable_control_h2d_block_num=true: caps the host KV tier's copies back per step; there is no host tier "
        "without --host_blocks_factor or --swap_space",
        "--enable_control_h2d_block_num=true: the cap comes from the step-time model of "
        "--enable_latency_aware_schedule (as in xLLM): turn it on too"]
    assert problems("--swap_space", "1", "--enable_latency_aware_schedule", "--max_global_tpot_ms", "100") == []


def test_the_copy_budget_is_per_step_over_the_requests_it_admits(tiny, monkeypatch):
    """Requests admitted in one step share its budget of 2 host-tier blocks: no step copies more."""
    from heterollm import LLM, SamplingParams
    from heterollm.scheduler.latency import LatencyTargets

    copied = []

    def observe(self, blocks, seconds):
        copied.append(blocks)
        self.copy_s_per_block = self.tpot_s / 2.5

    monkeypatch.setattr(LatencyTargets, "observe_copy", observe)
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 20000) for _ in range(45)] for _ in range(6)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = {}
    for name, flags in {"plain": {}, "capped": dict(enable_latency_aware_schedule=True, max_global_tpot_ms=200,
                                                      enable_control_h2d_block_num=True)}.items():
        llm = LLM(str(tiny), dtype="float32", block_size=8, num_gpu_blocks_override=24, max_model_len=128,
                  host_blocks_factor=4.0, **ADMIT_ALL, **flags)
        try:
            for p in prompts:  # each spills the one before it to the host tier
                llm.generate([p], params)
            first = llm.generate([prompts[0]], params)  # measures the copy (not capped yet)
            rest = llm.generate(prompts[1:], params)  # steps of three requests
            outs[name] = [o.outputs[0].token_ids for o in first + rest]
        finally:
            llm.shutdown()
    assert outs["capped"] == outs["plain"]
    assert copied[0] > 2 and copied[1:] and max(copied[1:]) == 2, copied  # the first step: not capped yet
