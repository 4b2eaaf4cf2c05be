"""--enable_latency_aware_schedule: the step-time model, and prefills held back or shortened so
running decodes keep --max_global_tpot_ms, unless a TTFT target is at risk."""
from __future__ import annotations

import logging

import pytest

from helpers import build_tiny_model
from heterollm import LLM, SamplingParams
from heterollm.config import load_config
from heterollm.config.checks import check_flag_combinations
from heterollm.scheduler.request import Request
from heterollm.interfaces import RunnerOutput
from heterollm.kv_cache import KVCacheManager
from heterollm.scheduler import Scheduler
from heterollm.scheduler.latency import LatencyTargets, StepTimeModel, step_features


def true_time(shape):
    """A made-up executor: 2 ms a step, 0.05 ms a token, 0.3 ms a sequence, 0.01 ms per 1000 pairs,
    1 ms more when it has a prefill chunk."""
    x = step_features(shape)
    return (2 * x[0] + 0.05 * x[1] + 0.3 * x[2] + 0.01 * x[3] + 1.0 * x[4]) / 1000


SHAPES = [[(n, 0)] for n in (8, 64, 256, 1024)] + [[(1, c)] * b for b in (1, 4, 16) for c in (16, 200)] + \
         [[(1, 100)] * 4 + [(128, 0)]]


def fitted() -> StepTimeModel:
    model = StepTimeModel()
    for shape in SHAPES:
        model.observe(shape, true_time(shape))
    model.fit()
    return model


def test_model_recovers_a_linear_step_time():
    model = fitted()
    assert model.coef == pytest.approx([0.002, 0.00005, 0.0003, 0.00001, 0.001], rel=1e-6, abs=1e-9)
    assert model.predict([(1, 50)] * 8 + [(300, 20)]) == pytest.approx(true_time([(1, 50)] * 8 + [(300, 20)]))
    assert "t_ms = 2 + 0.05*tokens + 0.3*seqs + 0.01*kpairs + 1*prefill" in model.describe()


def test_model_keeps_coefficients_non_negative_and_waits_for_data():
    model = StepTimeModel()
    model.observe([(1, 0)], 0.01)
    assert not model.ready and model.predict([(1, 0)]) is None
    for n in range(1, 12):  # noisy data where plain least squares gives a negative slope
        model.observe([(n, 0)], 0.01 - 0.0001 * (n % 2))
    model.fit()
    assert model.ready and min(model.coef) >= 0


def test_max_chunk_is_the_largest_that_fits():
    model = fitted()
    decodes = [(1, 100)] * 4
    n = model.max_chunk(decodes, 0, 4096, 0.020)
    assert true_time([*decodes, (n, 0)]) <= 0.020 < true_time([*decodes, (n + 1, 0)])
    assert model.max_chunk(decodes, 0, 4096, 0.001) == 0


def make(tpot_ms, ttft_ms=None, **flags):
    cfg = load_config([], overrides={"max_tokens_per_batch": 4096, "max_tokens_per_chunk_for_prefill": 4096,
                                     **flags}).config
    targets = LatencyTargets(fitted(), tpot_ms, ttft_ms)
    return Scheduler(cfg.scheduler, KVCacheManager(2048, 4), 4096, latency=targets)


def req(rid, n, **kw):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=50, ignore_eos=True), **kw)


def step(s):
    so = s.schedule()
    ids = [r.request_id for r in so.requests]
    s.update(so, RunnerOutput(ids, [[7] if r.sample else [] for r in so.requests], [None] * len(ids),
                              [None] * len(ids)))
    return {r.request_id: len(r.new_token_ids) for r in so.requests}


def running_decodes(s, k=4):
    for i in range(k):
        s.add(req(f"d{i}", 20))
    step(s)  # their prefill: nothing to protect yet
    assert step(s) == {f"d{i}": 1 for i in range(k)}


def test_prefill_is_shortened_to_keep_the_tpot_target():
    s = make(tpot_ms=20)
    running_decodes(s)
    s.add(req("long", 2000))
    got = step(s)
    n = got["long"]
    assert 16 <= n < 2000 and true_time([(1, 21)] * 4 + [(n, 0)]) <= 0.020
    assert s.latency.num_held >= 1


def test_decodes_with_drafts_count_their_rows_and_context_in_the_step_time():
    """A decode verifying drafts is a step row of 1 + drafts query tokens at its context: the prefill
    chunk admitted beside four of them is the largest the model predicts within the target (their
    context long enough that leaving it out would admit more)."""
    s = make(tpot_ms=20)
    for i in range(4):
        s.add(req(f"d{i}", 1000))
    step(s)
    assert step(s) == {f"d{i}": 1 for i in range(4)}
    for r in s.running:
        r.spec_token_ids = [5, 6]
    s.add(req("long", 2000))
    so = s.schedule()
    got = {r.request_id: (len(r.new_token_ids), r.num_computed_tokens) for r in so.requests}
    assert {rid: got[rid] for rid in got if rid != "long"} == {f"d{i}": (3, 1001) for i in range(4)}
    n = got["long"][0]
    assert true_time([(3, 1001)] * 4 + [(n, 0)]) <= 0.020 < true_time([(3, 1001)] * 4 + [(n + 1, 0)])


def test_prefill_is_held_back_when_even_a_small_chunk_breaks_the_target():
    s = make(tpot_ms=5)  # decodes alone take ~3.2 ms, 4.2 with a prefill: a 16-token chunk would break 5 ms
    running_decodes(s)
    s.add(req("long", 2000))
    assert "long" not in step(s)
    assert s.waiting[0].request_id == "long"


def test_ttft_at_risk_admits_the_prefill_whole():
    s = make(tpot_ms=5, ttft_ms=10)  # a 2000-token prefill alone is predicted at > 10 ms
    running_decodes(s)
    s.add(req("long", 2000))
    assert step(s)["long"] == 2000


def test_without_decodes_nothing_is_held():
    s = make(tpot_ms=1)
    s.add(req("long", 2000))
    assert step(s) == {"long": 2000}


def test_flags_need_each_other():
    def problems(**flags):
        return check_flag_combinations(load_config([], overrides={"model": "x", **flags}).config)
    assert any("--max_global_tpot_ms=50" in p for p in problems(max_global_tpot_ms=50))
    assert any("needs --max_global_tpot_ms" in p for p in problems(enable_latency_aware_schedule=True))
    assert problems(enable_latency_aware_schedule=True, max_global_tpot_ms=50) == []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def test_engine_profiles_at_start_and_keeps_answers(tiny, caplog):
    flags = dict(dtype="float32", block_size=8, num_gpu_blocks_override=400, max_model_len=512,
                 max_tokens_per_batch=512, enable_profile_step_time=True)
    prompts = [list(range(3, 300))] + [list(range(5, 5 + 10 + i)) for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain = LLM(str(tiny), **flags)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts[1:], params)]
    plain.shutdown()
    with caplog.at_level(logging.INFO, logger="heterollm"):
        llm = LLM(str(tiny), **flags, enable_latency_aware_schedule=True, max_global_tpot_ms=1)
    model = llm.engine.scheduler.latency.model
    assert model.ready and any("latency-aware scheduling: profiled" in r.message for r in caplog.records)
    assert llm.engine.kv.queries == 0 and not llm.engine.has_unfinished()
    engine = llm.engine
    for i, p in enumerate(prompts[1:]):
        engine.add_request(p, params, request_id=f"r{i}")
    for _ in range(3):
        engine.step()  # short prompts are in and decoding
    engine.add_request(prompts[0], params, request_id="long")
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert [outs[f"r{i}"].outputs[0].token_ids for i in range(6)] == want
    assert engine.scheduler.latency.num_held > 0  # a 1 ms TPOT target: the long prefill waited for the decodes
    llm.engine.profiler.flush()
    llm.shutdown()
