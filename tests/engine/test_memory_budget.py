"""One memory budget per host (issue 29): the launcher sizes every rank's KV cache from
max_memory_utilization x total, split over the ranks sharing a memory and over --dp_size replicas,
less what other heterollm processes on the host reserved (a registry under the cache dir);
--max_cache_size caps an instance; overcommit warns, no room for one sequence refuses."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from helpers import build_tiny_model
from heterollm.config import ConfigError, load_config
from heterollm.engine import reservations
from heterollm.engine.llm_engine import LLMEngine
from heterollm.engine.memory_budget import KVSizing, plan_kv_cache, plan_warnings
from heterollm.interfaces.executor import RankMemory

MiB = 2**20
HOST = "node/cpu"


def rank(device=HOST, total=1000 * MiB, weights=10 * MiB, peak=5 * MiB, per_block=MiB // 4, free=None):
    return RankMemory(device=device, total=total, free=total if free is None else free, weights=weights,
                      activation_peak=peak, kv_bytes_per_block=per_block)


def sizing(util=0.5, **kw):
    return KVSizing(util, **{"max_model_len": 256, "block_size": 16, **kw})


# -- the plan ------------------------------------------------------------------------------------

def test_ranks_on_one_host_split_it():
    plan = plan_kv_cache([rank()] * 3, sizing(), {})
    # (500 MiB budget - 3 x 15 MiB) over 3 ranks x 1/4 MiB a block
    assert plan.num_blocks == (500 * MiB - 45 * MiB) // (3 * MiB // 4)
    (host,) = plan.memories
    assert host.ranks == 3 and host.budget == 500 * MiB
    assert plan.reserved()[HOST] <= 500 * MiB < plan.reserved()[HOST] + 3 * MiB // 4  # within a block
    assert plan.kv_bytes == plan.num_blocks * 3 * MiB // 4  # each rank: the same num_blocks x 1/4 MiB


def test_a_plan_needs_a_rank_report():
    with pytest.raises(ValueError, match="^no rank reported its memory$"):
        plan_kv_cache([], sizing(), {})


def test_ranks_on_their_own_devices_each_use_their_device():
    plan = plan_kv_cache([rank("node/npu:0", total=1000 * MiB), rank("node/npu:1", total=800 * MiB)], sizing(), {})
    assert {m.device: m.budget for m in plan.memories} == {"node/npu:0": 500 * MiB, "node/npu:1": 400 * MiB}
    assert plan.num_blocks == (400 * MiB - 15 * MiB) // (MiB // 4)  # the smaller device decides
    assert all(r <= 400 * MiB for r in plan.reserved().values())


def test_replicas_and_other_processes_share_the_budget():
    plan = plan_kv_cache([rank()], sizing(dp_size=2), {HOST: 100 * MiB})
    (host,) = plan.memories
    assert host.share == 200 * MiB  # (500 - 100) / 2
    assert 2 * plan.reserved()[HOST] + 100 * MiB <= 500 * MiB
    assert plan_warnings(plan, {HOST: plan.reserved()[HOST]}) == []  # the second replica fits


def test_max_cache_size_caps_the_instance_over_replicas_and_ranks():
    plan = plan_kv_cache([rank()] * 2, sizing(dp_size=2, max_cache_size=100 * MiB), {})
    assert plan.num_blocks == 50 * MiB // (MiB // 2) and plan.kv_bytes == 50 * MiB
    assert plan.sizing.flag == "--max_cache_size"


def test_an_explicit_size_over_the_budget_warns_with_the_numbers():
    plan = plan_kv_cache([rank()], sizing(max_cache_size=400 * MiB), {HOST: 200 * MiB})
    (why,) = plan_warnings(plan, {})
    assert "615.0 MiB" in why and "others 200.0 MiB" in why and "500.0 MiB" in why and "--max_cache_size" in why


def test_no_room_for_one_sequence_is_refused_naming_flags_and_numbers():
    with pytest.raises(ConfigError) as err:  # 500 - 480 held - 15 fixed = 5 MiB < 512 tokens = 32 blocks = 8 MiB
        plan_kv_cache([rank()], sizing(max_model_len=512), {HOST: 480 * MiB})
    msg = str(err.value)
    for part in ("--max_memory_utilization=0.5", "--max_cache_size", "480.0 MiB", "5.0 MiB", "max_model_len=512",
                 "8.0 MiB"):
        assert part in msg, part
    plan_kv_cache([rank()], sizing(max_model_len=512), {HOST: 477 * MiB})  # 8 MiB left: fits exactly


def test_a_cache_larger_than_free_memory_warns():
    plan = plan_kv_cache([rank(free=100 * MiB)], sizing(), {})
    assert any("free there now" in w for w in plan_warnings(plan, {}))


# -- the host registry ---------------------------------------------------------------------------

def test_registry_counts_live_processes_only(tmp_path):
    path = tmp_path / "host.json"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = int(finished.stdout)
    started = reservations.process_started(sleeper.pid)
    try:
        path.write_text(json.dumps({
            "not-a-pid": {"started": None, "memories": {HOST: 1}},  # damaged entries are skipped, and
            "12": {"started": None, "memories": {HOST: "many"}},  # the entries after them still read
            str(sleeper.pid): {"started": started, "memories": {HOST: 100}},
            str(gone): {"started": None, "memories": {HOST: 1000}},  # exited
            str(other.pid): {"started": "0", "memories": {HOST: 10000}},  # its pid, since reused
        }))
        with reservations.host_registry(path) as view:
            assert view.others() == {HOST: 100}
            view.hold("e1", {HOST: 7})
            view.hold("e2", {HOST: 3})
        with reservations.host_registry(path) as view:
            assert view.mine() == {HOST: 10} and view.others() == {HOST: 100}
        assert set(json.loads(path.read_text())) == {str(sleeper.pid), str(os.getpid())}  # stale entries dropped
        mine = json.loads(path.read_text())[str(os.getpid())]  # what tells our pid, once reused, apart
        assert mine == {"started": reservations.process_started(os.getpid()), "memories": {HOST: 10}}
        reservations.release("e1", path)
        reservations.release("e1", path)  # twice: nothing more
        with reservations.host_registry(path) as view:
            assert view.mine() == {HOST: 3}
        reservations.release("e2", path)
        assert set(json.loads(path.read_text())) == {str(sleeper.pid)}
    finally:
        for p in (sleeper, other):
            p.kill()
            p.wait()
    with reservations.host_registry(path) as view:
        assert view.others() == {}


def test_a_process_entry_goes_when_it_exits(tmp_path):
    path = tmp_path / "host.json"
    code = f"""
        from pathlib import Path
        from heterollm.engine import reservations
        with reservations.host_registry(Path({str(path)!r})) as view:
            view.hold("e", {{"{HOST}": 5}})
        print(Path({str(path)!r}).read_text())
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=True)
    assert '"memories"' in out.stdout and HOST in out.stdout  # held while it ran
    assert json.loads(path.read_text()) == {}


def test_release_all_takes_this_process_entry_out_of_the_file(tmp_path):
    """What the exit hook does, in process: every engine's hold goes, in memory and in the file."""
    path = tmp_path / "host.json"
    with reservations.host_registry(path) as view:
        view.hold("a", {HOST: 5})
        view.hold("b", {HOST: 2})
    assert json.loads(path.read_text())[str(os.getpid())]["memories"] == {HOST: 7}
    reservations.release_all(path)
    assert json.loads(path.read_text()) == {}
    with reservations.host_registry(path) as view:
        assert view.mine() == {}


def test_an_unusable_registry_warns_once_and_plans_with_nothing_reserved(tmp_path, caplog):
    """Its folder cannot be made (a file is in the way): each use is a view of nothing that records
    nothing, and one warning names the file and what the instances lose."""
    (tmp_path / "blocker").write_text("")
    path = tmp_path / "blocker" / "host.json"
    with caplog.at_level(logging.WARNING, logger="heterollm.engine"):
        for _ in range(2):
            with reservations.host_registry(path) as view:
                assert not view.usable and view.others() == {}
                view.hold("e", {HOST: 1})
    [warning] = [r.getMessage() for r in caplog.records if "unusable" in r.getMessage()]
    assert warning.startswith(f"host memory registry {path} unusable (")
    assert warning.endswith("): instances on this host do not see each other's reservations")
    assert not path.exists()


# -- engines ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("budget"), "llama")


SMALL = dict(dtype="float32", block_size=16, max_model_len=256, max_tokens_per_batch=256, max_seqs_per_batch=4)


@pytest.mark.slow  # 3 ranks spawned (10 s); test_ranks_on_one_host_split_it checks the split in the default run
def test_tp3_ranks_split_the_host_budget(tmp_path, caplog):
    folder = build_tiny_model(tmp_path / "tp3", "llama", hidden_size=48, intermediate_size=96, num_attention_heads=3,
                              num_key_value_heads=3)
    caplog.set_level(logging.INFO, logger="heterollm.engine")
    engine = LLMEngine(load_config([], overrides={"model": str(folder), **SMALL, "tp_size": 3,
                                                  "max_memory_utilization": 0.01}).config)
    try:
        plan = engine.kv_plan
        (host,) = plan.memories
        assert host.ranks == 3 and host.budget == int(0.01 * host.total)
        profiles = engine.executor.memory_profile()
        assert len(profiles) == 3 and len({p.kv_bytes_per_block for p in profiles}) == 1  # equal shares
        held = [p.weights + p.activation_peak + plan.num_blocks * p.kv_bytes_per_block for p in profiles]
        assert sum(held) == plan.reserved()[host.device]
        assert sum(held) <= host.budget < sum(held) + sum(p.kv_bytes_per_block for p in profiles)  # within a block
        (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
        assert f"{plan.num_blocks} blocks" in line and "(3 rank(s))" in line
        assert f"{plan.kv_bytes / MiB:.1f} MiB reserved" in line and f"of the budget {host.budget / MiB:.1f} MiB" in line
    finally:
        engine.shutdown()


CHILD = """
    import sys
    from heterollm_cpu.platform import CpuPlatform
    CpuPlatform.memory_info = lambda self, device=None: ({total}, {total})
    from heterollm.config import load_config
    from heterollm.engine.llm_engine import LLMEngine
    e = LLMEngine(load_config([], overrides={flags!r}).config)
    print("READY", e.kv_plan.kv_bytes, flush=True)
    sys.stdin.read()
"""
TOTAL = 2048 * MiB


def start_instance(flags: dict) -> subprocess.Popen:
    code = textwrap.dedent(CHILD.format(total=TOTAL, flags=flags))
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_instances_with_max_cache_size_are_honoured_and_the_third_warns(tiny, caplog, monkeypatch, host_registry):
    """Two instances with --max_cache_size=400 MiB on a 1 GiB budget (0.5 x 2 GiB) fit; a third
    warns with the numbers and keeps its cap; one whose share cannot hold a sequence is refused."""
    flags = {"model": str(tiny), **SMALL, "max_memory_utilization": 0.5, "max_cache_size": 400 * MiB}
    children = [start_instance(flags) for _ in range(2)]
    try:
        for child in children:
            line = child.stdout.readline()
            assert line.split() == ["READY", str(400 * MiB)], child.stderr.read() if not line else line
            child.stderr.close()  # its log is not read further
        from heterollm_cpu.platform import CpuPlatform
        monkeypatch.setattr(CpuPlatform, "memory_info", lambda self, device=None: (TOTAL, TOTAL))
        caplog.set_level(logging.INFO, logger="heterollm.engine")
        third = LLMEngine(load_config([], overrides=flags).config)
        try:
            assert third.kv_plan.kv_bytes == 400 * MiB
            (host,) = third.kv_plan.memories
            assert 800 * MiB < host.others < 900 * MiB  # the two others: caches plus weights and activations
            (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert f"others {host.others / MiB:.1f} MiB" in warning and "1024.0 MiB" in warning
        finally:
            third.shutdown()
        with pytest.raises(ConfigError, match=r"no room for the KV cache: .*--max_memory_utilization=0\.4 x 2048\.0 MiB"):
            LLMEngine(load_config([], overrides={**flags, "max_memory_utilization": 0.4}).config)
    finally:
        for child in children:
            child.stdin.close()
            child.wait(30)


def test_an_allocation_the_os_refuses_names_the_flag_and_leaves_no_reservation(tiny):
    with reservations.host_registry() as view:
        before = view.mine()
    with pytest.raises(ConfigError, match=r"allocating the KV cache \(1000000000000 blocks, .* MiB on this rank\) "
                                          r"failed: .*lower --num_gpu_blocks_override=1000000000000"):
        LLMEngine(load_config([], overrides={"model": str(tiny), **SMALL,
                                             "num_gpu_blocks_override": 10**12}).config)
    with reservations.host_registry() as view:
        assert view.mine() == before


def test_cached_prefixes_beyond_the_working_set_are_capped_at_the_platforms_idle_budget(tiny, caplog, monkeypatch):
    """On CPU the cache's pages are committed as blocks fill, so the prefix cache keeps at most
    `Platform.idle_kv_budget_bytes` (1 GiB) of freed blocks beyond the working set (README, "KV cache
    and scheduling"): the budget in whole blocks, logged. Lowered here to 3.5 blocks of the tiny llama:
    2 layers x (K, V) x 2 KV heads x head_dim 16 x 16 slots x 4 bytes = 8,192 bytes a block."""
    from heterollm import LLM, SamplingParams
    from heterollm_cpu.platform import CpuPlatform
    assert CpuPlatform.idle_kv_budget_bytes == 1 << 30
    per_block = 2 * 2 * 2 * 16 * 16 * 4
    monkeypatch.setattr(CpuPlatform, "idle_kv_budget_bytes", 3 * per_block + per_block // 2)
    caplog.set_level(logging.INFO, logger="heterollm.engine")
    llm = LLM(str(tiny), **SMALL, enable_prefix_cache=True)
    try:
        engine = llm.engine
        assert engine.kv_plan.bytes_per_block == per_block
        assert engine.kv.pool.idle_limit == 3 and isinstance(engine.kv.pool.idle_limit, int)
        (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prefix cache:")]
        assert line == ("prefix cache: at most 3 freed blocks (0 MiB) stay cached beyond the working set; "
                        "--max_cache_size lets it use the whole cache")
        # four prompts one after another, 64 + 8 tokens each: 5 blocks of working set, and no more than
        # 3 cached ones besides it touched (over 8 without the cap: each prompt takes fresh blocks)
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        for i in range(4):
            llm.generate([{"prompt_token_ids": [100 + 64 * i + j for j in range(64)]}], params)
        assert engine.kv.pool.num_touched <= 5 + 3
    finally:
        llm.engine.shutdown()
    capped = LLM(str(tiny), **SMALL, enable_prefix_cache=True, max_cache_size=64 * per_block)
    try:
        assert capped.engine.kv.pool.idle_limit is None  # an explicit size: the whole cache
    finally:
        capped.engine.shutdown()
