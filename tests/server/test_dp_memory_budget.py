"""--dp_size replicas share one host budget (issue 29): equal shares that sum to at most
max_memory_utilization x total, shown in the start-up lines and in /metrics
(heterollm_kv_cache_reserved_bytes / heterollm_kv_cache_committed_bytes per dp_rank); a load
that overfills a small cache completes (requests wait or are preempted) with committed bytes
within the reservation."""
from __future__ import annotations

import logging
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import MODEL, serving
from heterollm.config import load_config
from heterollm.engine.llm_engine import LLMEngine

MiB = 2**20
TOTAL = 1024 * MiB
SMALL = dict(dtype="float32", block_size=16, max_model_len=128, max_tokens_per_batch=256, max_seqs_per_batch=4)


@pytest.fixture
def host_of_1gib(monkeypatch, tmp_path):
    """The CPU platform reports a 1 GiB host, so the budget does not depend on this machine, and the
    host registry is a fresh one, so what this process's earlier engines hold does not count."""
    from heterollm.engine import reservations
    from heterollm_cpu.platform import CpuPlatform
    monkeypatch.setattr(CpuPlatform, "memory_info", lambda self, device=None: (TOTAL, TOTAL))
    monkeypatch.setattr(reservations, "registry_path", lambda: tmp_path / "host.json")


def replicas(folder, **flags):
    """Both replicas in this process (`heterollm serve` runs each in its own engine-core process; the
    host registry's arithmetic is the same, keyed by process)."""
    cfg = load_config([], overrides={"model": str(folder), **SMALL, "dp_size": 2, **flags}).config
    engines = []
    try:
        for rank in range(2):
            engines.append(LLMEngine(cfg, dp_rank=rank))
    except BaseException:
        for e in engines:
            e.shutdown()
        raise
    return engines


def metric(text: str, name: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(rf'^{name}{{dp_rank="(\d)",model_name="[^"]*"}} (\S+)$', text, re.M)}


def test_two_replicas_get_equal_shares_within_the_budget(tiny_llama, host_of_1gib, caplog):
    caplog.set_level(logging.INFO, logger="heterollm.engine")
    engines = replicas(tiny_llama, max_memory_utilization=0.2)
    try:
        budget = int(0.2 * TOTAL)
        plans = [e.kv_plan for e in engines]
        assert abs(plans[0].num_blocks - plans[1].num_blocks) <= 1
        assert sum(p.reserved()[p.memories[0].device] for p in plans) <= budget
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
        assert len(lines) == 2
        held = [float(re.search(r"this process ([\d.]+) MiB", line)[1]) for line in lines]
        mine = [float(re.search(r"([\d.]+) MiB with weights", line)[1]) for line in lines]
        assert held == [mine[0], round(mine[0] + mine[1], 1)] and held[1] <= round(budget / MiB, 1)
        assert all(f"of the budget {budget / MiB:.1f} MiB" in line for line in lines)
        with serving(engines) as srv:
            text = httpx.get(srv.url + "/metrics").text
        reserved = metric(text, "heterollm_kv_cache_reserved_bytes")
        assert reserved == {"0": plans[0].kv_bytes, "1": plans[1].kv_bytes}
        assert sum(reserved.values()) <= budget
        assert metric(text, "heterollm_kv_cache_committed_bytes") == {"0": 0, "1": 0}  # reserved, nothing touched yet
    finally:
        for e in engines:
            e.shutdown()


def test_a_load_that_fills_a_small_cache_completes_within_the_budget(tiny_llama, host_of_1gib):
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # layers x K,V x slots x KV heads x head_dim x fp32
    engines = replicas(tiny_llama, max_memory_utilization=0.5, max_cache_size=2 * 12 * per_block)
    try:
        assert [e.num_blocks for e in engines] == [12, 12]  # 192 tokens each; a request takes up to 7 blocks

        def one(i):
            body = {"model": MODEL, "prompt": list(range(5 + i, 45 + i)), "max_tokens": 60, "temperature": 0,
                    "ignore_eos": True}
            return httpx.post(srv.url + "/v1/completions", json=body, timeout=300).json()

        with serving(engines) as srv:
            with ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(one, range(8)))
            text = httpx.get(srv.url + "/metrics").text
        assert all(a["choices"][0]["finish_reason"] == "length" and a["usage"]["completion_tokens"] == 60
                   for a in answers)
        assert all(r.dead is None for r in srv.server.replicas)
        assert sum(float(m) for m in re.findall(r'^heterollm_num_preemptions_total{[^}]*} (\S+)$', text, re.M)) > 0
        reserved = metric(text, "heterollm_kv_cache_reserved_bytes")
        committed = metric(text, "heterollm_kv_cache_committed_bytes")
        assert reserved == {"0": 12 * per_block, "1": 12 * per_block}
        assert all(0 < committed[r] <= reserved[r] for r in "01")
        assert sum(e.kv_plan.reserved()[e.kv_plan.memories[0].device] for e in engines) <= TOTAL // 2
    finally:
        for e in engines:
            e.shutdown()
