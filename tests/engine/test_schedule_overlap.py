"""--enable_schedule_overlap: step N+1 is scheduled while step N runs, and N's tokens are turned into
outputs while N+1 runs. The tokens must be exactly those of the run without overlap."""
from __future__ import annotations

import random
import threading

import pytest

from helpers import ADMIT_ALL, build_tiny_model
from heterollm import LLM, SamplingParams

FLAGS = dict(dtype="float32", block_size=4, max_model_len=96, max_tokens_per_batch=48,
             max_tokens_per_chunk_for_prefill=16)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def workload(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(7)
    prompts, params = [], []
    shared = [rng.randrange(3, vocab) for _ in range(20)]
    for i in range(14):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 40))]
        kind = i % 7
        if kind == 0:
            p = SamplingParams(max_tokens=rng.randrange(1, 30), temperature=0, ignore_eos=True)
        elif kind == 1:
            p = SamplingParams(max_tokens=25, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True)
        elif kind == 2:  # penalties read the history, including the token sampled the step before
            p = SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.6, frequency_penalty=0.5,
                               ignore_eos=True)
        elif kind == 3:  # stops early on a token the model emits
            p = SamplingParams(max_tokens=30, temperature=0, stop_token_ids=list(range(3, vocab, 9)))
        elif kind == 4:
            p = SamplingParams(max_tokens=12, temperature=0.7, seed=i, n=2, ignore_eos=True, logprobs=2)
        elif kind == 5:
            p = SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=1, ignore_eos=True)
        else:
            p = SamplingParams(max_tokens=18, temperature=0, min_tokens=4, ignore_eos=False)
        prompts.append(prompt)
        params.append(p)
    return prompts, params


def summary(outs):
    """Tokens, text and stops (exact); logprobs apart (batches differ, so float sums may too)."""
    exact = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, [lp.token_id for lp in c.logprobs or []])
              for c in o.outputs] for o in outs]
    lps = [lp.logprob for o in outs for c in o.outputs for lp in c.logprobs or []]
    lps += [lp.logprob for o in outs for lp in o.prompt_logprobs or [] if lp is not None]
    return exact, lps


@pytest.mark.parametrize("extra", [
    {"num_gpu_blocks_override": 400},
    {"num_gpu_blocks_override": 40, **ADMIT_ALL},  # small cache: requests are preempted while their step is in flight
    {"num_gpu_blocks_override": 400, "enable_in_batch_prefix_cache": True, "max_seqs_per_batch": 5},
], ids=["roomy", "preempting", "in-batch-prefix"])
def test_overlap_gives_the_same_tokens(tiny, extra):
    runs = {}
    for overlap in (False, True):
        llm = LLM(str(tiny), **FLAGS, **extra, enable_schedule_overlap=overlap)
        prompts, params = workload(llm.engine.vocab_size)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        runs[overlap] = summary(outs)
        assert not llm.engine.scheduler.requests, "every request finished and was forgotten"
        if extra["num_gpu_blocks_override"] == 40:  # the preemptions happened, and each request reports its own
            assert sum(o.metrics.num_preemptions for o in outs) == llm.engine.scheduler.num_preemptions > 0
        assert not llm.engine.has_unfinished() and llm.engine.kv.num_free_blocks == llm.engine.num_blocks
        llm.shutdown()
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] == pytest.approx(runs[False][1], abs=1e-3)


def test_abort_while_a_step_is_in_flight(tiny):
    llm = LLM(str(tiny), **FLAGS, num_gpu_blocks_override=200, enable_schedule_overlap=True)
    engine = llm.engine
    keep = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    gone = engine.add_request([9, 10, 11], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine._in_flight is not None
    engine.abort(gone)
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    assert gone not in outs and len(outs[keep].outputs[0].token_ids) == 10
    assert engine.kv.num_free_blocks == engine.num_blocks
    llm.shutdown()


def test_overlap_really_overlaps(tiny):
    """Each step waits, inside the executor, until the engine thread has scheduled the step after it:
    that only ends without a timeout when the next step is scheduled before this one has finished."""
    llm = LLM(str(tiny), **FLAGS, num_gpu_blocks_override=200, enable_schedule_overlap=True)
    engine = llm.engine
    cond = threading.Condition()
    calls, overlapped = [0], []
    execute, schedule = engine.executor.execute, engine.scheduler.schedule

    def watched_schedule():
        so = schedule()
        with cond:
            calls[0] += 1
            so.index = calls[0]
            cond.notify_all()
        return so

    def blocking_execute(so):
        with cond:
            overlapped.append(cond.wait_for(lambda: calls[0] > so.index, timeout=10))
        return execute(so)

    engine.executor.execute, engine.scheduler.schedule = blocking_execute, watched_schedule
    [out] = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 8
    assert len(overlapped) >= 8 and all(overlapped)
    llm.shutdown()


def test_a_failed_step_raises_the_executors_error(tiny):
    """The step that fails surfaces when the next one is scheduled (its result is read then); the
    engine unwinds the step scheduled behind it (Scheduler.unstarted: no KV moves here) and raises
    the executor's own error, which the server reports."""
    llm = LLM(str(tiny), **FLAGS, num_gpu_blocks_override=200, enable_schedule_overlap=True)
    engine = llm.engine
    execute, calls = engine._execute, []

    def fails_third(so):
        calls.append(so)
        if len(calls) == 3:
            raise RuntimeError("worker died")
        return execute(so)
    engine._execute = fails_third
    try:
        engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
        with pytest.raises(RuntimeError, match="^worker died$"):
            for _ in range(10):
                engine.step()
        assert len(calls) == 3, "the step scheduled behind the failed one never runs"
    finally:
        engine._execute = execute
        llm.shutdown()


def test_shutdown_with_a_step_in_flight_lets_it_end_first(tiny):
    """Under --enable_schedule_overlap a step may still run on the worker thread when the engine shuts
    down: it ends before the executor goes, and a second shutdown is harmless."""
    import time

    llm = LLM(str(tiny), **FLAGS, num_gpu_blocks_override=200, enable_schedule_overlap=True)
    engine = llm.engine
    execute, ended = engine._execute, []

    def slow(so):
        time.sleep(0.3)
        out = execute(so)
        ended.append(so)
        return out

    engine._execute = slow
    engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    engine.step()
    assert engine._in_flight is not None and not ended
    llm.shutdown()
    assert len(ended) == 1 and engine._in_flight is None
    llm.shutdown()
