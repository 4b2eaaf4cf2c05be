"""Scheduler policy without a model: budgets, decode-first, chunking, mixing, admission."""
from __future__ import annotations

import pytest

from heterollm.config import load_config
from heterollm.scheduler.request import Request, RequestRejected
from heterollm.interfaces import RunnerOutput
from heterollm.kv_cache import KVCacheManager
from heterollm.sampling import SamplingParams
from heterollm.scheduler import Scheduler


def make(num_blocks=64, block_size=4, max_model_len=256, **flags):
    cfg = load_config([], overrides=flags).config
    return Scheduler(cfg.scheduler, KVCacheManager(num_blocks, block_size), max_model_len)


def req(rid, n):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=100))


def run_step(s):
    so = s.schedule()
    ids = [r.request_id for r in so.requests]
    out = RunnerOutput(ids, [[5] if r.sample else [] for r in so.requests], [None] * len(ids), [None] * len(ids))
    s.update(so, out)
    return {r.request_id: len(r.new_token_ids) for r in so.requests}


def test_token_budget_and_chunking():
    s = make(max_tokens_per_batch=10)
    s.add(req("a", 25))
    assert run_step(s) == {"a": 10}
    assert run_step(s) == {"a": 10}
    assert run_step(s) == {"a": 5}
    assert run_step(s) == {"a": 1}  # decode


def test_decode_first_then_prefill_mixed():
    s = make(max_tokens_per_batch=8)
    s.add(req("a", 3))
    run_step(s)
    s.add(req("b", 20))
    assert run_step(s) == {"a": 1, "b": 7}


def test_no_mix_batch_separates_prefill_and_decode():
    s = make(max_tokens_per_batch=8, enable_mix_batch=False)
    s.add(req("a", 3))
    run_step(s)
    s.add(req("b", 20))
    assert run_step(s) == {"b": 8}  # waiting prefill first, alone
    kinds = [step_kinds(s) for _ in range(4)]
    # b's started prefill goes on before a's decodes (else it waits for all 100 of a's tokens), alone
    assert kinds == [{"b": "prefill"}, {"b": "prefill"}] + [{"a": "decode", "b": "decode"}] * 2


def step_kinds(s) -> dict[str, str]:
    """Run one step; what each of its requests was doing, read off the batch as it was scheduled (a
    request decodes when its input starts past its prompt)."""
    so = s.schedule()
    kinds = {r.request_id: "decode" if r.num_computed_tokens >= len(r.prompt_token_ids) else "prefill"
             for r in so.requests}
    s.update(so, RunnerOutput([r.request_id for r in so.requests], [[5] if r.sample else [] for r in so.requests],
                              [None] * len(so.requests), [None] * len(so.requests)))
    return kinds


def test_chunk_size_flag():
    s = make(max_tokens_per_batch=100, max_tokens_per_chunk_for_prefill=6)
    s.add(req("a", 14))
    assert run_step(s) == {"a": 6}


def test_max_seqs_per_batch():
    s = make(max_seqs_per_batch=2)
    for i in range(3):
        s.add(req(f"r{i}", 4))
    assert len(run_step(s)) == 2


def test_prompt_longer_than_max_model_len_rejected():
    s = make(max_model_len=16)
    with pytest.raises(RequestRejected, match="max_model_len"):
        s.add(req("a", 16))
    s.add(req("b", 15))


def test_no_chunked_prefill_rejects_prompt_over_budget():
    s = make(max_tokens_per_batch=8, enable_chunked_prefill=False)
    with pytest.raises(RequestRejected, match="max_tokens_per_batch"):
        s.add(req("a", 9))


def test_request_queue_full():
    s = make(request_queue_size=2)
    s.add(req("a", 3))
    s.add(req("b", 3))
    with pytest.raises(RequestRejected, match="request_queue_size=2") as info:
        s.add(req("c", 3))
    assert info.value.status == 429


def test_preemption_frees_and_recomputes():
    s = make(num_blocks=4, block_size=4, max_tokens_per_batch=64)
    s.add(req("a", 7))
    s.add(req("b", 7))
    run_step(s)  # both prefilled: 2 blocks each, cache full
    run_step(s)  # decode position 7 still fits in 2 blocks
    step = run_step(s)  # position 8 needs a 3rd block for both: one is preempted
    assert s.num_preemptions == 1 and len(step) == 1
    victim = next(r for r in s.requests.values() if r.num_preemptions)
    assert victim.num_computed_tokens == 0 and victim.output_token_ids == [5, 5]  # kept; KV recomputed


def test_block_pool_reuses_recently_freed_blocks():
    """A stream of requests keeps landing on the same few blocks (the committed pages), instead
    of walking the whole reserved cache."""
    from heterollm.kv_cache import KVCacheManager

    kv = KVCacheManager(num_blocks=1000, block_size=16)
    used: set[int] = set()
    for i in range(200):
        rid = f"r{i}"
        used.update(kv.allocate(rid, 40 + i % 7))
        if i % 2:
            kv.free(f"r{i - 1}")
            kv.free(rid)
    assert kv.num_free_blocks == 1000
    assert len(used) <= 8
    assert sorted(kv.allocate("x", 16 * 5)) == [0, 1, 2, 3, 4]


def test_fcfs_preempts_the_most_recently_admitted():
    # 6 blocks of 4: a (8 tokens) fills 2, b and c (5 tokens each) 2 each. a's first decode needs a
    # third block with none free; b and c are both unscheduled: the newest, c, yields (README:
    # "the most recently admitted running request is preempted"), b keeps running.
    s = make(num_blocks=6, block_size=4, max_tokens_per_batch=64)
    for rid, n in (("a", 8), ("b", 5), ("c", 5)):
        s.add(req(rid, n))
    assert run_step(s) == {"a": 8, "b": 5, "c": 5}
    a, b, c = (s.requests[r] for r in "abc")
    assert run_step(s) == {"a": 1, "b": 1}
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions) == (0, 0, 1)
    assert list(s.waiting) == [c] and c.num_computed_tokens == 0
