"""The scheduler's steps one function at a time, with fake runner outputs: the batch `_build` hands
the executor, `update` and `resolve` (overlap), prompt logprobs across a preemption, preemption
inside a step, prefix-cache adoption during a chunked prefill (`_rematch`), in-batch commits,
priority preemption of running requests for the waiting head, and latency-aware holding. Every
expected batch is worked out by hand in the comments (block size 4; a fresh block pool hands out
blocks 0, 1, 2, ... in order, and a freed block is reused first). Written against the survivors of
the scheduler/ mutation run (tests/MUTATION.md)."""
from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest

from heterollm.config import load_config
from heterollm.interfaces import RunnerOutput, SchedulerOutput
from heterollm.kv_cache import KVCacheManager
from heterollm.sampling import SamplingParams
from heterollm.scheduler import Scheduler
from heterollm.scheduler.latency import LatencyTargets, StepTimeModel
from heterollm.scheduler.policy import SchedulingPolicy
from heterollm.scheduler.request import Request, RequestRejected, RequestStatus


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make(num_blocks: int = 64, prefix: bool = False, in_batch: bool = False, max_model_len: int = 256,
         latency: LatencyTargets | None = None, clock: Clock | None = None, **flags) -> Scheduler:
    cfg = load_config([], overrides=flags).config
    return Scheduler(cfg.scheduler, KVCacheManager(num_blocks, 4, enable_prefix_cache=prefix), max_model_len,
                     in_batch_prefix_cache=in_batch, policy=SchedulingPolicy(cfg.scheduler), clock=clock or Clock(),
                     latency=latency)


def req(rid: str, n: int, max_tokens: int | None = 100, prompt_logprobs: int | None = None,
        arrival_time: float = 0.0, **kw) -> Request:
    """A request of prompt 1..n arriving at 0 (the fake clock's start)."""
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs),
                   arrival_time=arrival_time, **kw)


def put_running(s: Scheduler, r: Request, computed: int, output: tuple[int, ...] = ()) -> Request:
    """A request already running, `computed` tokens in the cache (its blocks allocated now)."""
    r.output_token_ids = list(output)
    r.num_computed_tokens = computed
    r.num_cached_tokens = 0
    r.status = RequestStatus.RUNNING
    assert s.kv.allocate(r.request_id, computed) is not None
    s.requests[r.request_id] = r
    s.running.append(r)
    return r


def outputs(so: SchedulerOutput, token: int, tag: str = "") -> RunnerOutput:
    """What a runner returns: `token` for each sampled request, and for a request that wants prompt
    logprobs a marker per prompt position start+1 .. min(end, prompt length - 1) (runner.py)."""
    plps = []
    for it in so.requests:
        last = min(it.num_computed_tokens + len(it.new_token_ids), len(it.prompt_token_ids) - 1)
        plps.append([f"{tag}p{j}" for j in range(it.num_computed_tokens + 1, last + 1)]
                    if it.want_prompt_logprobs else None)
    return RunnerOutput([it.request_id for it in so.requests], [[token] if it.sample else [] for it in so.requests],
                        [None] * len(so.requests), plps)


def shape(so: SchedulerOutput) -> dict[str, tuple[int, int]]:
    """request id -> (first position computed, tokens computed) of one step."""
    return {it.request_id: (it.num_computed_tokens, len(it.new_token_ids)) for it in so.requests}


def starts(so: SchedulerOutput) -> dict[str, int]:
    """request id -> first position computed (for steps whose input tokens are still pending)."""
    return {it.request_id: it.num_computed_tokens for it in so.requests}


def step(s: Scheduler, token: int = 7, tag: str = "") -> dict[str, tuple[int, int]]:
    so = s.schedule()
    s.update(so, outputs(so, token, tag))
    return shape(so)


# -- the batch ---------------------------------------------------------------------------------------
def test_the_batch_carries_each_requests_tokens_blocks_and_whether_it_samples():
    s = make(max_tokens_per_batch=12, max_tokens_per_chunk_for_prefill=8)
    a, b = req("a", 10), req("b", 6)
    s.add(a), s.add(b)
    so = s.schedule()  # a: a chunk of 8 (2 blocks); b: the 4 tokens left of the budget (1 block)
    ia, ib = so.requests
    assert (ia.request_id, ia.new_token_ids, ia.num_computed_tokens, ia.block_ids, ia.sample) == \
        ("a", [1, 2, 3, 4, 5, 6, 7, 8], 0, [0, 1], False)
    assert (ib.request_id, ib.new_token_ids, ib.num_computed_tokens, ib.block_ids, ib.sample) == \
        ("b", [1, 2, 3, 4], 0, [2], False)
    assert ia.sampling is a.sampling_info and ia.prompt_token_ids is a.prompt_token_ids
    assert ia.output_token_ids is a.output_token_ids and ia.pooling is None and not ia.want_prompt_logprobs
    assert (a.num_computed_tokens, b.num_computed_tokens, a.num_pending, b.num_pending) == (8, 4, 0, 0)
    assert so.finished_request_ids == [] and so.num_tokens == 12
    s.update(so, outputs(so, 7))
    s.add(req("c", 3))
    s.finish("c", "abort")
    so = s.schedule()  # both finish their prompts and sample: a needs a 3rd block, b a 2nd
    ia, ib = so.requests
    assert (ia.new_token_ids, ia.num_computed_tokens, ia.block_ids, ia.sample) == ([9, 10], 8, [0, 1, 3], True)
    assert (ib.new_token_ids, ib.num_computed_tokens, ib.block_ids, ib.sample) == ([5, 6], 4, [2, 4], True)
    assert (a.num_pending, b.num_pending) == (1, 1)
    assert so.finished_request_ids == ["c"]
    assert s.update(so, outputs(so, 9)) == [(a, [9]), (b, [9])]
    assert (a.num_pending, a.output_token_ids) == (0, [9])
    so = s.schedule()
    assert so.finished_request_ids == [] and shape(so) == {"a": (10, 1), "b": (6, 1)}


def test_overlap_schedules_on_a_pending_token_and_resolve_fills_it_in():
    s = make()
    a = req("a", 3, max_tokens=5)
    s.add(a)
    first = s.schedule()  # the prompt; its token is pending
    assert (a.num_computed_tokens, a.num_pending) == (3, 1)
    second = s.schedule()  # scheduled before the first ran: its input is that pending token
    (item,) = second.requests
    assert (item.num_computed_tokens, item.new_token_ids, item.sample) == (3, [], True)
    assert (a.num_computed_tokens, a.num_pending) == (4, 2)
    assert s.update(first, RunnerOutput(["a"], [[11]], [None], [None])) == [(a, [11])]
    assert a.num_pending == 1
    s.resolve()
    assert item.new_token_ids == [11]
    s.resolve()  # nothing left to fill in
    assert item.new_token_ids == [11]
    s.update(second, RunnerOutput(["a"], [[12]], [None], [None]))
    assert (a.output_token_ids, a.num_pending) == ([11, 12], 0)
    assert shape(s.schedule()) == {"a": (4, 1)}


def test_a_request_whose_last_token_is_in_flight_is_not_scheduled_again():
    s = make()
    short, long = req("short", 3, max_tokens=2), req("long", 3, max_tokens=5)
    s.add(short), s.add(long)
    s.schedule(), s.schedule()  # prompts, then one decode each: two tokens pending each
    # short's 2 pending tokens are all it may have; long goes on (the one behind it), on its pending
    # 2nd token (position 4), not yet known
    assert starts(s.schedule()) == {"long": 4}


def test_a_request_at_the_context_length_with_its_last_token_in_flight_waits():
    s = make(max_model_len=6)
    a = req("a", 4, max_tokens=None)
    s.add(a)
    s.schedule()  # 4 + 1 pending
    assert starts(s.schedule()) == {"a": 4}  # 4 + 2 pending = 6 = max_model_len
    assert starts(s.schedule()) == {}


def test_update_skips_a_request_finished_while_its_step_ran():
    s = make()
    a, b = req("a", 3), req("b", 3)
    s.add(a), s.add(b)
    so = s.schedule()
    s.finish("a", "abort")
    assert s.update(so, outputs(so, 5)) == [(b, [5])]
    assert (a.output_token_ids, b.output_token_ids, b.num_pending) == ([], [5], 0)


def test_update_keeps_logprobs_and_pooled_outputs_in_batch_order():
    s = make()
    gen = req("gen", 3)
    pool = req("pool", 4, pooling=SimpleNamespace(needs_every_position=False))
    s.add(gen), s.add(pool)
    so = s.schedule()
    assert so.requests[1].pooling is pool.pooling
    result = RunnerOutput(["gen", "pool"], [[5], []], [["lp5"], None], [None, None], pooled=[None, "vector"])
    assert s.update(so, result) == [(gen, [5]), (pool, [])]
    assert gen.logprobs == ["lp5"] and gen.pooled is None and pool.pooled == "vector"
    assert pool.output_token_ids == [] and pool.num_pending == 0
    so = s.schedule()
    assert s.update(so, RunnerOutput(["gen"], [[6]], [None], [None])) == [(gen, [6])]  # no logprobs asked
    assert gen.logprobs == ["lp5"] and gen.output_token_ids == [5, 6]


def test_a_pooling_prompt_may_fill_the_context_a_generation_prompt_may_not():
    s = make(max_model_len=8)
    s.add(req("pool", 8, pooling=SimpleNamespace(needs_every_position=False)))  # samples no token after it
    with pytest.raises(RequestRejected, match="has 9 tokens"):
        s.add(req("pool9", 9, pooling=SimpleNamespace(needs_every_position=False)))
    with pytest.raises(RequestRejected, match="has 8 tokens"):
        s.add(req("gen", 8))


# -- prompt logprobs ---------------------------------------------------------------------------------
def test_prompt_logprobs_are_asked_for_once_per_position_across_a_preemption():
    # 3 blocks; budget 5, chunks of 4. x (4 tokens) and b (10 tokens, prompt logprobs).
    s = make(num_blocks=3, max_tokens_per_batch=5, max_tokens_per_chunk_for_prefill=4)
    x, b = req("x", 4), req("b", 10, prompt_logprobs=0)
    s.add(x), s.add(b)
    so = s.schedule()  # x: 4 tokens (block 0); b: the 1 token left (block 1), which yields position 1
    assert shape(so) == {"x": (0, 4), "b": (0, 1)} and so.requests[1].want_prompt_logprobs
    s.update(so, outputs(so, 7, "s1"))
    assert b.prompt_logprobs == [None, "s1p1"]
    # x decodes into block 2, the last; b's next chunk needs a second block: no one to take it from,
    # so b yields itself and is admitted again from 0: positions 1-4 computed, 2-4 new
    so = s.schedule()
    assert shape(so) == {"x": (4, 1), "b": (0, 4)} and so.requests[1].want_prompt_logprobs
    assert b.num_preemptions == 1 and so.requests[0].block_ids == [0, 2] and so.requests[1].block_ids == [1]
    s.update(so, outputs(so, 7, "s2"))
    assert b.prompt_logprobs == [None, "s1p1", "s2p2", "s2p3", "s2p4"]
    # again: b's chunk 4-8 needs a 2nd block, x holds the other two: b yields and recomputes 0-4,
    # whose positions it has: no prompt logprobs asked for
    so = s.schedule()
    assert shape(so) == {"x": (5, 1), "b": (0, 4)} and not so.requests[1].want_prompt_logprobs
    assert (b.num_preemptions, s.num_preemptions) == (2, 2)
    s.update(so, outputs(so, 7, "s2b"))
    assert b.prompt_logprobs == [None, "s1p1", "s2p2", "s2p3", "s2p4"]
    s.finish("x", "stop")
    assert step(s, tag="s3") == {"b": (4, 4)}
    assert step(s, tag="s4") == {"b": (8, 2)}  # position 9 is the prompt's last
    assert b.prompt_logprobs == [None, "s1p1", "s2p2", "s2p3", "s2p4", "s3p5", "s3p6", "s3p7", "s3p8", "s4p9"]
    so = s.schedule()
    assert shape(so) == {"b": (10, 1)} and not so.requests[0].want_prompt_logprobs  # a decode


def test_a_recomputed_chunk_whose_positions_are_all_known_asks_for_none():
    # b (10 tokens, prompt logprobs) gets two chunks of 4, then is preempted (white-box): recomputing
    # positions 1-4 adds nothing; the chunk 4-8 ends exactly where the known ones end (8): nothing new
    s = make(max_tokens_per_chunk_for_prefill=4)
    b = req("b", 10, prompt_logprobs=0)
    s.add(b)
    step(s, tag="a"), step(s, tag="b")
    assert b.prompt_logprobs == [None, "ap1", "ap2", "ap3", "ap4", "bp5", "bp6", "bp7", "bp8"]
    s._preempt(b)
    so = s.schedule()
    assert shape(so) == {"b": (0, 4)} and not so.requests[0].want_prompt_logprobs
    s.update(so, outputs(so, 7))
    so = s.schedule()
    assert shape(so) == {"b": (4, 4)} and not so.requests[0].want_prompt_logprobs
    s.update(so, outputs(so, 7))
    so = s.schedule()
    assert shape(so) == {"b": (8, 2)} and so.requests[0].want_prompt_logprobs
    s.update(so, outputs(so, 7, "c"))
    assert b.prompt_logprobs[-2:] == ["bp8", "cp9"] and len(b.prompt_logprobs) == 10


# -- running requests --------------------------------------------------------------------------------
def test_decodes_go_before_a_running_prefill_and_the_budget_ends_the_step():
    s = make(max_tokens_per_batch=3)
    p = put_running(s, req("p", 20), 4)  # prefilling, admitted first
    d = put_running(s, req("d", 3), 3, (7,))  # decoding
    assert shape(s.schedule()) == {"d": (3, 1), "p": (4, 2)}
    assert (p.num_computed_tokens, d.num_computed_tokens) == (6, 4)


def test_without_mixed_batches_a_running_prefill_goes_alone_before_decodes():
    s = make(max_tokens_per_batch=3, enable_mix_batch=False)
    put_running(s, req("d", 3), 3, (7,))
    put_running(s, req("p", 20), 4)
    assert shape(s.schedule()) == {"p": (4, 3)}


def test_the_step_ends_when_budget_or_sequence_slots_run_out():
    s = make(max_tokens_per_batch=2)
    for rid in "abc":
        put_running(s, req(rid, 3), 3, (7,))
    assert shape(s.schedule()) == {"a": (3, 1), "b": (3, 1)}
    s = make(max_seqs_per_batch=2)
    for rid in "abc":
        put_running(s, req(rid, 3), 3, (7,))
    assert shape(s.schedule()) == {"a": (3, 1), "b": (3, 1)}


def test_without_chunked_prefill_decodes_still_run():
    s = make(enable_chunked_prefill=False, max_tokens_per_batch=8)
    s.add(req("a", 8))
    assert step(s) == {"a": (0, 8)}
    assert step(s) == {"a": (8, 1)}


def test_a_decode_that_needs_a_block_preempts_the_newest_and_the_rest_of_the_step_goes_on(caplog):
    # 4 blocks, all held: a (decoding at position 4: needs a 2nd block) [0], p (prefilling) [1],
    # v (decoding, admitted last) [2, 3]. Decodes first: a preempts v (the newest not yet scheduled)
    # and takes block 2; v is skipped; p's chunk of 2 fits its block; v, back in the queue, is
    # admitted again with a first chunk of 2 in block 3.
    s = make(num_blocks=4, max_tokens_per_chunk_for_prefill=2)
    a = put_running(s, req("a", 4), 4, (7,))
    p = put_running(s, req("p", 40), 2)
    v = put_running(s, req("v", 8), 8, (7,))
    with caplog.at_level(logging.DEBUG, logger="heterollm.scheduler"):
        so = s.schedule()
    assert [r.getMessage() for r in caplog.records] == ["preempted v (recompute)"]
    assert shape(so) == {"a": (4, 1), "p": (2, 2), "v": (0, 2)}
    assert [it.block_ids for it in so.requests] == [[0, 2], [1], [3]]
    assert (a.num_preemptions, p.num_preemptions, v.num_preemptions, s.num_preemptions) == (0, 0, 1, 1)
    assert so.requests[0].new_token_ids == [7] and so.requests[2].new_token_ids == [1, 2]


def test_a_request_with_no_one_to_take_blocks_from_yields_itself():
    s = make(num_blocks=1)
    a = put_running(s, req("a", 4), 4, (7,))  # its decode needs a 2nd block; there is none
    assert shape(s.schedule()) == {}
    assert list(s.waiting) == [a] and s.running == [] and a.status is RequestStatus.PREEMPTED
    assert (a.num_preemptions, a.num_computed_tokens, s.kv.num_free_blocks) == (1, 0, 1)


# -- prefix cache ------------------------------------------------------------------------------------
def test_blocks_a_step_computed_are_found_by_a_later_request():
    s = make(prefix=True)
    s.add(req("a", 9))
    assert step(s) == {"a": (0, 9)}  # blocks of tokens 1-4 and 5-8 are now cached
    b = req("b", 9)
    s.add(b)
    assert step(s) == {"a": (9, 1), "b": (8, 1)}
    assert (b.num_cached_tokens, s.kv.hits, s.kv.queries) == (8, 8, 18)


def test_in_batch_prefix_cache_shares_blocks_within_the_step():
    for in_batch, b_start in ((True, 8), (False, 0)):
        s = make(prefix=True, in_batch=in_batch)
        s.add(req("a", 9)), s.add(req("b", 9))
        so = s.schedule()
        assert shape(so) == {"a": (0, 9), "b": (b_start, 9 - b_start)}
        assert so.requests[1].block_ids == ([0, 1, 3] if in_batch else [3, 4, 5])


def test_in_batch_commits_wait_for_a_pending_token():
    # overlap: a's decode is scheduled before its first token is known; its block 3 (positions 8-11,
    # the last one the pending token) is cached only once the token is in
    s = make(prefix=True, in_batch=True)
    s.add(req("a", 11))
    first = s.schedule()
    second = s.schedule()
    s.update(first, RunnerOutput(["a"], [[50]], [None], [None]))
    s.resolve()
    s.update(second, RunnerOutput(["a"], [[51]], [None], [None]))
    c = Request("c", list(range(1, 12)) + [50, 60, 61], SamplingParams(max_tokens=5))
    s.add(c)
    assert shape(s.schedule()) == {"a": (12, 1), "c": (12, 2)}


def test_a_chunked_prefill_adopts_blocks_cached_since_its_admission():
    # A and B share a 40-token prompt; budget 12, chunks of 8: A takes 8 a step, B the 4 left.
    # --chunked_match_frequency 2: B looks again before its 2nd, 4th ... further chunk, and each time
    # finds the 2 blocks A computed in the step before (A's blocks are cached when its step is done).
    s = make(prefix=True, max_tokens_per_batch=12, max_tokens_per_chunk_for_prefill=8)
    a, b = req("A", 40), req("B", 40)
    s.add(a), s.add(b)
    assert step(s) == {"A": (0, 8), "B": (0, 4)}
    assert step(s) == {"A": (8, 8), "B": (4, 4)}
    so = s.schedule()  # B adopts positions 8-15 (A's blocks 3 and 4)
    assert shape(so) == {"A": (16, 8), "B": (16, 4)} and so.requests[1].block_ids == [2, 5, 3, 4, 8]
    s.update(so, outputs(so, 7))
    assert (b.num_cached_tokens, s.kv.hits) == (8, 8)
    assert step(s) == {"A": (24, 8), "B": (20, 4)}
    assert step(s) == {"A": (32, 8), "B": (32, 4)}  # positions 24-31 adopted
    assert (b.num_cached_tokens, s.kv.hits, a.num_cached_tokens) == (16, 16, 0)


def test_adoption_waits_for_a_block_boundary():
    # B's chunks are 3 tokens: at its 2nd further chunk it is at 6, inside a block: nothing adopted
    s = make(prefix=True, max_tokens_per_batch=11, max_tokens_per_chunk_for_prefill=8)
    b = req("B", 40)
    s.add(req("A", 40)), s.add(b)
    # at its 4th further chunk, at 12 (a block boundary), it adopts A's blocks 3-7 (positions 12-31)
    assert [step(s)["B"] for _ in range(5)] == [(0, 3), (3, 3), (6, 3), (9, 3), (32, 3)]
    assert b.num_cached_tokens == 20


def test_every_further_chunk_looks_with_frequency_one():
    # B looks before each further chunk: at 4 it finds A's block 1 (positions 4-7), cached a step ago
    s = make(prefix=True, max_tokens_per_batch=12, max_tokens_per_chunk_for_prefill=8, chunked_match_frequency=1)
    b = req("B", 40)
    s.add(req("A", 40)), s.add(b)
    assert [step(s)["B"] for _ in range(3)] == [(0, 4), (8, 4), (16, 4)]
    assert b.num_cached_tokens == 8


def test_a_request_that_needs_every_position_adopts_nothing():
    s = make(prefix=True, max_tokens_per_batch=12, max_tokens_per_chunk_for_prefill=8)
    b = req("B", 40, prompt_logprobs=0)
    s.add(req("A", 40)), s.add(b)
    assert [step(s)["B"] for _ in range(5)] == [(0, 4), (4, 4), (8, 4), (12, 4), (16, 4)]
    assert b.num_cached_tokens == 0


# -- priority ----------------------------------------------------------------------------------------
def test_the_priority_head_preempts_the_worst_running_request_for_a_slot():
    s = make(priority_strategy="priority", max_seqs_per_batch=2)
    x = put_running(s, req("x", 3, priority=5), 3, (7,))
    y = put_running(s, req("y", 3, priority=3), 3, (7,))
    s.add(req("head", 4, priority=0))
    # both slots taken: x (the worst) yields one; the head, sorted back in front of x, is admitted
    assert shape(s.schedule()) == {"y": (3, 1), "head": (0, 4)}
    assert (x.num_preemptions, y.num_preemptions) == (1, 0) and list(s.waiting) == [x]


def test_the_priority_head_preempts_only_as_many_as_its_blocks_need(caplog):
    s = make(num_blocks=4, priority_strategy="priority")
    x = put_running(s, req("x", 8, priority=5), 8, (7,))  # 2 blocks each, none free
    y = put_running(s, req("y", 7, priority=3), 7, (7,))
    s.add(req("head", 4, priority=0))  # 1 block: x's 2 are enough (x itself needs 3 to come back)
    with caplog.at_level(logging.DEBUG, logger="heterollm.scheduler"):
        assert shape(s.schedule()) == {"y": (7, 1), "head": (0, 4)}
    assert (x.num_preemptions, y.num_preemptions) == (1, 0) and list(s.waiting) == [x]
    assert [r.getMessage() for r in caplog.records] == ["preempting x (priority 5) for head (priority 0)",
                                                        "preempted x (recompute)"]


def test_the_priority_head_stays_in_front_when_no_worse_request_is_left():
    # 3 blocks: z (priority 0) and x (priority 5) hold one each, both slots of 2 taken. head (priority
    # 1, 12 tokens: 3 blocks) preempts x for the slot; still short of blocks and z is better: it stops,
    # and stays ahead of x in the queue (x would fit, head does not: neither is admitted)
    s = make(num_blocks=3, priority_strategy="priority", max_seqs_per_batch=2)
    put_running(s, req("z", 3, priority=0), 3, (7,))
    x = put_running(s, req("x", 3, priority=5), 3, (7,))
    head = req("head", 12, priority=1)
    s.add(head)
    assert shape(s.schedule()) == {"z": (3, 1)}
    assert list(s.waiting) == [head, x] and x.num_preemptions == 1


def test_the_priority_head_does_not_preempt_better_or_equal_requests():
    s = make(priority_strategy="priority", max_seqs_per_batch=1)
    put_running(s, req("x", 3, priority=0), 3, (7,))
    s.add(req("head", 4, priority=0))
    assert shape(s.schedule()) == {"x": (3, 1)} and s.num_preemptions == 0


# -- latency-aware -----------------------------------------------------------------------------------
def latency(coef: list[float], tpot_ms: int) -> LatencyTargets:
    model = StepTimeModel()
    model.coef = coef
    return LatencyTargets(model, tpot_ms, None)


def test_a_held_prefill_does_not_stop_one_whose_ttft_is_at_risk():
    # -0.5 ms + 1 ms a token, TPOT 3 ms: beside a decode, a prefill may add 2 tokens, under the 16 of
    # MIN_CHUNK: held. Now 10 s; p2 arrived at 0 with a 1 ms target (at risk): its whole chunk. p3
    # arrived at 5 s with a 5.040 s target: 5 s waited + its 38 remaining tokens (37.5 ms) = 5.0375 s:
    # not at risk, held.
    clock = Clock(10.0)
    s = make(latency=latency([-0.0005, 0.001, 0.0, 0.0, 0.0], 3), clock=clock, max_tokens_per_chunk_for_prefill=8)
    put_running(s, req("d", 3), 3, (7,))
    put_running(s, req("p1", 40, arrival_time=0.0), 2)
    put_running(s, req("p3", 40, arrival_time=5.0, ttft_slo_ms=5040), 2)
    put_running(s, req("p2", 40, arrival_time=0.0, ttft_slo_ms=1), 2)
    assert shape(s.schedule()) == {"d": (3, 1), "p2": (2, 8)}
    assert s.latency.num_held == 2


def test_nothing_is_held_without_a_running_decode():
    s = make(latency=latency([0.0, 0.001, 0.0, 0.0, 0.0], 3), max_tokens_per_chunk_for_prefill=8)
    put_running(s, req("p1", 40), 2)
    s.add(req("w", 10))
    assert shape(s.schedule()) == {"p1": (2, 8), "w": (0, 8)}
    assert s.latency.num_held == 0


def test_a_prefill_only_step_when_the_heads_first_chunk_fits():
    # without mixed batches the waiting head goes alone when its first chunk (not its whole prompt)
    # gets blocks: 3 blocks, d holds 1; w's first chunk of 8 needs 2 (its 20 tokens would need 5)
    s = make(num_blocks=3, enable_mix_batch=False, max_tokens_per_chunk_for_prefill=8)
    put_running(s, req("d", 3), 3, (7,))
    s.add(req("w", 20))
    assert shape(s.schedule()) == {"w": (0, 8)}
    # a 4-token prompt needs 1 block (not a chunk's 2): it goes alone too
    s = make(num_blocks=2, enable_mix_batch=False, max_tokens_per_chunk_for_prefill=8)
    put_running(s, req("d", 3), 3, (7,))
    s.add(req("w", 4))
    assert shape(s.schedule()) == {"w": (0, 4)}
    # one that does not get blocks leaves the step to the decodes
    s = make(num_blocks=2, enable_mix_batch=False, max_tokens_per_chunk_for_prefill=8)
    put_running(s, req("d", 3), 3, (7,))
    s.add(req("w", 8))
    assert shape(s.schedule()) == {"d": (3, 1)}


def test_each_missed_ttft_deadline_is_counted_and_logged_once(caplog):
    clock = Clock(2.0)
    s = make(clock=clock, max_seqs_per_batch=1)
    put_running(s, req("busy", 3), 3, (7,))
    s.add(req("a", 3, ttft_slo_ms=1500))  # due at 1.5 s
    s.add(req("b", 3, arrival_time=0.5, ttft_slo_ms=1000))  # due at 1.5 s
    s.add(req("c", 3, ttft_slo_ms=5000))  # due at 5 s
    with caplog.at_level(logging.WARNING, logger="heterollm.scheduler"):
        s.schedule()
        s.schedule()
    assert s.num_deadline_missed == 2 and [r.getMessage() for r in caplog.records] == [
        "request a misses its TTFT target of 1500 ms (still waiting after 2000 ms)",
        "request b misses its TTFT target of 1000 ms (still waiting after 1500 ms)"]


# -- the policy's own answers ----------------------------------------------------------------------------
def policy(strategy: str, max_global_ttft_ms: int = 2**31 - 1) -> SchedulingPolicy:
    cfg = load_config([], overrides={"priority_strategy": strategy}).config
    return SchedulingPolicy(cfg.scheduler, max_global_ttft_ms)


def test_reference_time_and_deadline():
    p, with_global = policy("deadline"), policy("deadline", 3000)
    assert p.reference_s(req("own", 1, ttft_slo_ms=2500)) == 2.5
    assert (p.reference_s(req("none", 1)), with_global.reference_s(req("none", 1))) == (10.0, 3.0)
    assert p.deadline(req("own", 1, arrival_time=4.0, ttft_slo_ms=2500)) == 6.5
    assert with_global.deadline(req("own", 1, arrival_time=4.0, ttft_slo_ms=2500)) == 6.5
    assert with_global.deadline(req("none", 1, arrival_time=4.0)) == 7.0
    assert p.deadline(req("none", 1, arrival_time=4.0)) == math.inf


def test_the_victim_is_the_worst_ranked_sparing_starved_ones():
    p = policy("priority")
    a, b, c = (req(rid, 1, priority=prio) for rid, prio in (("a", 1), ("b", 7), ("c", 4)))
    assert p.victim([]) is None
    assert p.victim([a, b, c]) is b and p.victim([a, b, c], worse_than=c) is b
    assert p.victim([a, c], worse_than=c) is None  # equal is not worse
    b.starved = True
    assert p.victim([a, b, c]) is c  # a starved request is spared while others remain
    a.starved = c.starved = True
    assert p.victim([a, b, c]) is b  # all starved: the worst of them for blocks
    assert p.victim([a, b, c], worse_than=req("top", 1, priority=0)) is None  # but never for priority
    fcfs = policy("fcfs")
    assert fcfs.victim([a, b, c]) is c  # the newest, starved or not
    assert fcfs.victim([a, b, c], worse_than=req("top", 1, priority=0)) is None  # fcfs ranks no one worse


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    # budget 8: d's decode takes 1, w's 8-token prompt does not fit the 7 left: it waits, whole
    s = make(enable_chunked_prefill=False, max_tokens_per_batch=8)
    put_running(s, req("d", 3), 3, (7,))
    s.add(req("w", 8))
    assert step(s) == {"d": (3, 1)}
    s.finish("d", "stop")
    assert step(s) == {"w": (0, 8)}


def test_without_mixed_batches_a_waiting_request_never_joins_a_decode_step():
    # 4 blocks; d's 8-token prompt is cached in its 2 blocks. w (the same 8 tokens + 1) would need 3
    # blocks, 2 are free: no prefill-only step. d decodes (taking a 3rd block); w, which could share
    # d's 2 blocks and take the last one, still does not join a decode step
    s = make(num_blocks=4, prefix=True, enable_mix_batch=False)
    s.add(req("d", 8))
    assert step(s) == {"d": (0, 8)}
    s.add(Request("w", list(range(1, 10)), SamplingParams(max_tokens=5), arrival_time=0.0))
    assert step(s) == {"d": (8, 1)}


def test_a_request_waits_until_its_grammar_has_compiled_then_queues_in_arrival_order():
    s = make(max_seqs_per_batch=1)
    slow, fast = SimpleNamespace(ready=False), SimpleNamespace(ready=False)
    s.add(req("slow", 3, grammar=slow)), s.add(req("fast", 3, grammar=fast)), s.add(req("plain", 3))
    assert list(s.waiting) == [s.requests["plain"]] and s.has_unfinished()
    fast.ready = True
    assert step(s) == {"plain": (0, 3)}  # first in the queue; fast joins behind it
    assert [r.request_id for r in s.waiting] == ["fast"] and [r.request_id for r in s.deferred] == ["slow"]
    s.finish("plain", "stop")
    slow.ready = True
    assert step(s) == {"fast": (0, 3)}
    assert [r.request_id for r in s.waiting] == ["slow"] and s.deferred == []


def test_unfinished_is_any_request_waiting_running_or_deferred_and_finish_finds_each():
    s = make()
    assert not s.has_unfinished()
    put_running(s, req("run", 3), 3, (7,))
    assert s.has_unfinished()  # running only
    s.finish("run", "stop")
    s.add(req("compiling", 3, grammar=SimpleNamespace(ready=False)))
    assert s.has_unfinished() and list(s.waiting) == []  # deferred only
    s.finish("compiling", "abort")
    assert s.deferred == [] and not s.has_unfinished()


def test_blocks_adopted_before_a_held_chunk_are_in_the_table():
    # B (40 tokens) has computed 8, its 2 blocks committed; another request holds the first 4 blocks of
    # the same prompt in the cache. Before its 2nd further chunk B adopts blocks 2-3 (positions 8-15);
    # then latency-aware admission holds the chunk (beside d's decode only 2 tokens fit the 3 ms
    # TPOT). B's table must still cover the 16 tokens it now counts as computed.
    s = make(prefix=True, latency=latency([-0.0005, 0.001, 0.0, 0.0, 0.0], 3), max_tokens_per_chunk_for_prefill=8)
    tokens = list(range(1, 41))
    s.kv.allocate("donor", 16)
    s.kv.commit("donor", tokens, 16)
    put_running(s, req("d", 3), 3, (7,))
    b = put_running(s, req("B", 40), 8)
    s.kv.commit("B", tokens, 8)
    b.num_prefill_chunks = 1
    assert shape(s.schedule()) == {"d": (3, 1)}
    assert (b.num_computed_tokens, b.num_cached_tokens, s.kv.hits) == (16, 8, 8)
    assert len(s.kv.tables["B"]) == 4 and s.kv.tables["B"][2:] == s.kv.tables["donor"][2:]


def test_a_request_that_needs_every_position_matches_no_cached_prefix():
    # a's 9 tokens leave blocks 1-4 and 5-8 in the cache; the same prompt asking for prompt logprobs,
    # or pooled over every position (MEAN), computes all 9; a LAST-pooled one finds 8
    s = make(prefix=True)
    s.add(req("a", 9))
    step(s)
    s.add(req("plp", 9, prompt_logprobs=0))
    s.add(req("mean", 9, pooling=SimpleNamespace(needs_every_position=True)))
    s.add(req("last", 9, pooling=SimpleNamespace(needs_every_position=False)))
    assert step(s) == {"a": (9, 1), "plp": (0, 9), "mean": (0, 9), "last": (8, 1)}


def test_a_ttft_deadline_is_missed_only_once_past_it():
    clock = Clock(1.5)
    s = make(clock=clock, max_seqs_per_batch=1)
    put_running(s, req("busy", 3), 3, (7,))
    s.add(req("a", 3, ttft_slo_ms=1500))  # due at exactly 1.5 s
    s.schedule()
    assert s.num_deadline_missed == 0 and not s.requests["a"].ttft_slo_missed
    clock.now = 1.625
    s.schedule()
    assert s.num_deadline_missed == 1 and s.requests["a"].ttft_slo_missed


def test_under_priority_a_request_short_of_blocks_takes_none_from_an_equal_one():
    # 2 blocks, both held. w and x: priority 3, same arrival (equal rank). w's decode needs a 2nd
    # block; x is not strictly worse, so w yields itself, and x (after it in the order) still runs
    s = make(num_blocks=2, priority_strategy="priority")
    w = put_running(s, req("w", 4, priority=3), 4, (7,))
    x = put_running(s, req("x", 3, priority=3), 3, (7,))
    assert shape(s.schedule()) == {"x": (3, 1)}
    assert (w.num_preemptions, x.num_preemptions) == (1, 0) and list(s.waiting) == [w]


def test_by_default_blocks_are_shared_only_once_a_step_is_done():
    cfg = load_config([], overrides={}).config
    s = Scheduler(cfg.scheduler, KVCacheManager(64, 4, enable_prefix_cache=True), 256)
    s.add(req("a", 9)), s.add(req("b", 9))
    assert shape(s.schedule()) == {"a": (0, 9), "b": (0, 9)}  # not in-batch: b finds nothing yet


def test_a_chunk_size_of_one():
    s = make(max_tokens_per_chunk_for_prefill=1)
    s.add(req("a", 3))
    assert [step(s) for _ in range(4)] == [{"a": (0, 1)}, {"a": (1, 1)}, {"a": (2, 1)}, {"a": (3, 1)}]


def test_deferred_requests_count_toward_the_queue_size():
    s = make(request_queue_size=2)
    s.add(req("waits", 3))
    s.add(req("compiles", 3, grammar=SimpleNamespace(ready=False)))
    with pytest.raises(RequestRejected, match="request queue is full") as info:
        s.add(req("third", 3))
    assert info.value.status == 429


def test_in_batch_commits_hash_blocks_the_prefix_match_did_not():
    # 8-token prompts: the admission's match hashes only block 0 (the last token is always computed),
    # so a's in-batch commit of positions 0-7 hashes block 1 from a's tokens; b shares block 0 only
    s = make(prefix=True, in_batch=True)
    s.add(req("a", 8)), s.add(req("b", 8))
    assert shape(s.schedule()) == {"a": (0, 8), "b": (4, 4)}


def test_a_request_admitted_while_starving_is_not_preempted_for_priority():
    # priority 9 against the 10 s reference time: starving past 10 s (threshold 1); admitted at 11 s
    # as starved, it keeps its only slot when a priority-0 request arrives
    clock = Clock()
    s = make(clock=clock, priority_strategy="priority", max_seqs_per_batch=1)
    low = req("low", 3, priority=9)
    s.add(low)
    put_running(s, req("busy", 3), 3, (7,))
    s.schedule()  # busy keeps the slot
    s.finish("busy", "stop")
    clock.now = 11.0
    assert shape(s.schedule()) == {"low": (0, 3)} and low.starved
    s.add(req("high", 3, priority=0, arrival_time=11.0))
    assert starts(s.schedule()) == {"low": 3} and low.num_preemptions == 0


def test_a_prefill_admitted_at_ttft_risk_counts_against_the_next_ones_budget():
    # -0.5 ms + 1 ms a token, TPOT 3 ms. d decodes (1 token); w1 (1 ms target, waited 10 s) is at
    # risk: its whole chunk of 8 goes in; w2 (no target) would add to 9 tokens already past the
    # budget: held, and the queue stops there
    s = make(latency=latency([-0.0005, 0.001, 0.0, 0.0, 0.0], 3), clock=Clock(10.0),
             max_tokens_per_chunk_for_prefill=8)
    put_running(s, req("d", 3), 3, (7,))
    s.add(req("w1", 20, ttft_slo_ms=1)), s.add(req("w2", 20))
    assert shape(s.schedule()) == {"d": (3, 1), "w1": (0, 8)}
    assert s.latency.num_held == 1 and [r.request_id for r in s.waiting] == ["w2"]


# -- attention data parallelism: victims on the short rank only -----------------------------------------
def test_a_decode_short_of_blocks_preempts_only_requests_of_its_own_rank():
    # 2 ranks of 4 blocks (DataParallelKVCacheManager: a new request joins the rank holding fewest
    # requests, then the one with more free blocks, then the lower rank). a (5 tokens, 4 computed:
    # 1 block) -> rank 0; b (5 tokens, 4 computed) -> rank 1; c (13 tokens, 12 computed: 3 blocks) ->
    # one request on each rank, 3 free blocks on each: rank 0, which is then full. Running in the
    # order a, c, b, all decoding. a's decode needs a 2nd block on rank 0: under fcfs the victim is
    # the newest admitted request of a's rank, c; b (newer, but on rank 1) would free nothing a can use
    from heterollm.kv_cache import DataParallelKVCacheManager

    s = Scheduler(load_config([], overrides={}).config.scheduler, DataParallelKVCacheManager(2, 8, 4), 256)
    a, b, c = req("a", 4), req("b", 4), req("c", 12)
    for r, computed in ((a, 4), (b, 4), (c, 12)):
        r.output_token_ids, r.num_computed_tokens, r.status = [9], computed, RequestStatus.RUNNING
        assert s.kv.allocate(r.request_id, computed) is not None
        s.requests[r.request_id] = r
    assert (s.kv.rank_of["a"], s.kv.rank_of["b"], s.kv.rank_of["c"]) == (0, 1, 0)
    s.running = [a, c, b]
    so = s.schedule()
    assert shape(so) == {"a": (4, 1), "b": (4, 1)}  # c freed 3 blocks: back on rank 0 it would need 4
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions, s.num_preemptions) == (0, 0, 1, 1)
    assert list(s.waiting) == [c] and s.running == [a, b] and c.status is RequestStatus.PREEMPTED
    assert so.requests[0].block_ids == [0, 1] and so.requests[1].block_ids == [4, 5]


# -- multimodal requests ------------------------------------------------------------------------------
def image(offset: int, length: int, key: int):
    """An image item whose placeholders the prefix cache names `-1 - key` (its hash's first 15 hex
    digits read as a number: heterollm.multimodal.cache_token_ids)."""
    import torch

    from heterollm.multimodal import MultiModalItem

    return MultiModalItem("image", f"{key:015x}" + "f" * 17, offset, length, (1, 1, length), torch.zeros(length, 1))


def test_cache_token_ids_name_an_images_placeholders_by_the_image():
    r = req("r", 6)  # prompt 1..6; the image's 3 placeholders are positions 1-3
    assert r.cache_token_ids == [1, 2, 3, 4, 5, 6]  # text only: the tokens themselves
    r.mm_items = [image(1, 3, 5)]
    r.output_token_ids = [9]
    assert r.cache_token_ids == [1, -6, -6, -6, 5, 6, 9]
    r.output_token_ids.append(8)  # output tokens follow as they come
    assert r.cache_token_ids == [1, -6, -6, -6, 5, 6, 9, 8]
    assert r.all_token_ids == [1, 2, 3, 4, 5, 6, 9, 8]


def test_images_go_with_every_step_that_computes_prompt_tokens_and_no_other():
    # chunks of 4: the 6-token prompt with an image at positions 1-3 takes two steps (0-3, 4-5), both
    # carrying the image (the runner encodes it when its placeholders are computed); its decodes and
    # a text-only request's steps carry none
    s = make(max_tokens_per_chunk_for_prefill=4)
    items = [image(1, 3, 5)]
    m, t = req("m", 6, mm_items=items), req("t", 3)
    s.add(m), s.add(t)
    so = s.schedule()
    assert shape(so) == {"m": (0, 4), "t": (0, 3)}
    assert so.requests[0].mm_items is items and so.requests[1].mm_items is None
    s.update(so, outputs(so, 7))
    so = s.schedule()
    assert shape(so) == {"t": (3, 1), "m": (4, 2)}  # decodes first
    assert so.requests[1].mm_items is items and so.requests[0].mm_items is None
    s.update(so, outputs(so, 7))
    so = s.schedule()
    assert shape(so) == {"t": (4, 1), "m": (6, 1)}  # m's first decode starts at its prompt's length
    assert [it.mm_items for it in so.requests] == [None, None]


@pytest.mark.parametrize("in_batch", [False, True])
def test_the_prefix_cache_tells_images_apart_behind_equal_placeholder_tokens(in_batch):
    # prompts 1..8 (p) and 1..9 (q, r) whose positions 4-7 (block 1) are an image's placeholders.
    # p's admission hashes only its block 0 (its last token is always computed), so its block 1 is
    # hashed when it is committed: after p's step, or at once in-batch. q (p's image) then finds
    # both blocks: 8 tokens; r (another image behind the same placeholder ids) only block 0: 4 tokens
    s = make(prefix=True, in_batch=in_batch)
    p = req("p", 8, mm_items=[image(4, 4, 1)])
    q, r = (req(rid, 9, mm_items=[image(4, 4, key)]) for rid, key in (("q", 1), ("r", 2)))
    s.add(p)
    if not in_batch:
        assert step(s) == {"p": (0, 8)}
    s.add(q), s.add(r)
    so = s.schedule()
    assert {k: v for k, v in shape(so).items() if k != "p"} == {"q": (8, 1), "r": (4, 5)}
    assert (q.num_cached_tokens, r.num_cached_tokens) == (8, 4)


@pytest.mark.parametrize(("b_key", "b_steps"), [(1, [(0, 4), (8, 4), (16, 4)]), (2, [(0, 4), (4, 4), (8, 4)])])
def test_a_chunked_prefill_adopts_blocks_of_its_own_image_only(b_key, b_steps):
    # test_every_further_chunk_looks_with_frequency_one with an image at positions 4-7 (block 1) of
    # both 40-token prompts: with A's image, B adopts A's block 1 at 4 and block 3 at 12 as there;
    # with another image behind the same placeholder ids, block 1 is not A's, nor (chained) any after.
    # (B's block hashes are all made at its admission, from its cache_token_ids: which tokens
    # `_rematch` passes the lookup later cannot change them.)
    s = make(prefix=True, max_tokens_per_batch=12, max_tokens_per_chunk_for_prefill=8, chunked_match_frequency=1)
    b = req("B", 40, mm_items=[image(4, 4, b_key)])
    s.add(req("A", 40, mm_items=[image(4, 4, 1)])), s.add(b)
    assert [step(s)["B"] for _ in range(3)] == b_steps
    assert b.num_cached_tokens == (8 if b_key == 1 else 0)


def test_a_decode_with_drafts_gets_the_draft_models_lookahead_slots():
    # lookahead 2 (a draft model writes 2 slots past the step's tokens while it drafts). d: prompt
    # 1..4 and output [9], 4 computed (block 0), drafts [5, 6]: the step computes positions 4-6
    # (its last token and the 2 drafts), 7 slots, plus the lookahead: 9 slots, 3 blocks
    cfg = load_config([], overrides={}).config
    s = Scheduler(cfg.scheduler, KVCacheManager(64, 4), 256, lookahead=2)
    d = put_running(s, req("d", 4), 4, (9,))
    d.spec_token_ids = [5, 6]
    so = s.schedule()
    assert shape(so) == {"d": (4, 3)} and so.requests[0].new_token_ids == [9, 5, 6]
    assert so.requests[0].block_ids == [0, 1, 2] and so.requests[0].num_spec_tokens == 2


@pytest.mark.parametrize(("tokens", "accepted"), [([5, 6, 8], 2), ([5, 7], 1), ([4], 0)])
def test_update_keeps_the_accepted_drafts_and_takes_the_rejected_ones_back(tokens, accepted):
    # d: prompt 1..4, output [9], 4 computed, drafts [5, 6]: the step computes positions 4-6 (7
    # computed as if both were accepted). The runner returns the accepted drafts and one token more:
    # [5, 6, 8] accepts both (7 computed), [5, 7] the first (6), [4] none (5). The counters add to
    # the earlier steps' (4 drafts, 3 accepted); with the prefix cache, block 0 (positions 0-3, all
    # computed however many drafts are taken back) is committed: one cached block
    cfg = load_config([], overrides={}).config
    s = Scheduler(cfg.scheduler, KVCacheManager(64, 4, enable_prefix_cache=True), 256)
    d = put_running(s, req("d", 4), 4, (9,))
    d.spec_token_ids, d.num_draft_tokens, d.num_accepted_tokens = [5, 6], 4, 3
    so = s.schedule()
    assert shape(so) == {"d": (4, 3)} and d.num_computed_tokens == 7 and s.kv.pool.num_cached == 0
    assert s.update(so, RunnerOutput(["d"], [tokens], [None], [None])) == [(d, tokens)]
    assert d.output_token_ids == [9, *tokens] and d.num_computed_tokens == 5 + accepted
    assert (d.num_draft_tokens, d.num_accepted_tokens, d.num_pending) == (6, 3 + accepted, 0)
    assert s.kv.pool.num_cached == 1


def test_a_prefill_that_samples_gets_the_lookahead_slots_past_its_cached_prefix():
    # lookahead 2. w (4 tokens) completes its prompt in its step and samples: 4 + 2 slots, 2 blocks.
    # With the prefix cache: a (1..9) caches blocks 0-1; b (1..11) finds 8 tokens and computes 3:
    # 11 + 2 slots, 4 blocks (blocks 0, 1 shared)
    cfg = load_config([], overrides={}).config
    s = Scheduler(cfg.scheduler, KVCacheManager(64, 4), 256, lookahead=2)
    s.add(req("w", 4))
    so = s.schedule()
    assert shape(so) == {"w": (0, 4)} and so.requests[0].block_ids == [0, 1]
    s = Scheduler(cfg.scheduler, KVCacheManager(64, 4, enable_prefix_cache=True), 256, lookahead=2)
    s.add(req("a", 9))
    assert step(s) == {"a": (0, 9)}  # a holds blocks 0-2
    s.add(req("b", 11))
    so = s.schedule()
    assert shape(so) == {"a": (9, 1), "b": (8, 3)} and so.requests[1].block_ids == [0, 1, 3, 4]


def test_rejected_drafts_give_back_the_blocks_they_took():
    # d: prompt 1..4, output [9], 4 computed, drafts [5, 6, 7, 8]: positions 4-8, 9 slots, blocks 0-2.
    # None accepted ([3]): 6 tokens known, 5 computed; the table keeps 2 blocks for 6 tokens
    cfg = load_config([], overrides={}).config
    s = Scheduler(cfg.scheduler, KVCacheManager(64, 4), 256)
    d = put_running(s, req("d", 4), 4, (9,))
    d.spec_token_ids = [5, 6, 7, 8]
    so = s.schedule()
    assert shape(so) == {"d": (4, 5)} and so.requests[0].block_ids == [0, 1, 2]
    s.update(so, RunnerOutput(["d"], [[3]], [None], [None]))
    assert d.num_computed_tokens == 5 and s.kv.tables["d"] == [0, 1] and s.kv.num_free_blocks == 62


def test_every_running_decode_with_drafts_is_scheduled():
    # two decodes with drafts (d1 then d2, each prompt 1..4, output [9], 4 computed): both go in,
    # each with its last token and its 2 drafts
    cfg = load_config([], overrides={}).config
    s = Scheduler(cfg.scheduler, KVCacheManager(64, 4), 256)
    for rid in ("d1", "d2"):
        put_running(s, req(rid, 4), 4, (9,)).spec_token_ids = [5, 6]
    assert shape(s.schedule()) == {"d1": (4, 3), "d2": (4, 3)}


def test_in_place_counts_the_accepted_drafts_whose_kv_sits_in_their_slots():
    """A tree's drafts are written in node order: an accepted path keeps its K/V where it sits only as
    far as node j is at depth j + 1. Tree: 10 -> 11 -> 12 along nodes 0, 1, 2, and 13 (node 3) a
    second child of 10."""
    from heterollm.scheduler.scheduler import in_place
    drafts, parents = [10, 11, 12, 13], [-1, 0, 1, 0]
    assert in_place(parents, [10, 11, 12], drafts) == 3
    assert in_place(parents, [10, 11], drafts) == 2
    assert in_place(parents, [10, 13], drafts) == 1  # 13 is node 3, not in the slot of depth 2
    assert in_place(parents, [], drafts) == 0
    assert in_place(None, [7, 8], [7, 8, 9]) == 2  # a path: every accepted draft is in place


def test_a_push_reservation_counts_only_the_device_prefix_caches_blocks():
    """PUSH, DECODE: `reserve` shares what the device prefix cache holds and counts it as cached; a block
    the KV store holds is neither counted nor loaded (the prefill instance pushes it like any other: a
    copy scheduled now could land after a cancelled reservation's blocks went to another)."""
    from heterollm.kv_cache.store_tier import StoreTier, block_key

    from helpers import FakeStore

    store = FakeStore()
    tier = StoreTier(store, "p", ranks=1, batch_size=4, timeout_ms=0)
    cfg = load_config([], overrides={}).config
    s = Scheduler(cfg.scheduler, KVCacheManager(16, 4, enable_prefix_cache=True, store=tier), 256, clock=Clock())
    tokens = list(range(100, 113))  # 3 full blocks and one more token
    first = tokens[:4] + [999]
    s.kv.match_prefix("a", first)
    s.kv.allocate("a", len(first))
    s.kv.commit("a", first, len(first))
    s.kv.free("a")  # block 0 stays in the device prefix cache
    for h in s.kv._chain("x", tokens, 3)[1:]:
        store.data[block_key("p", h, 0)] = b"kv"
    cached, table = s.reserve("res", tokens)
    assert cached == 1 and len(table) == 4, "block 0 shared; the prompt's 13 tokens and the first output token"
    assert s.reserved["res"][2] == 4 and tier.fetched == 0 and s.kv.take_transfers() is None
