"""The step-time model and the latency targets (scheduler/latency.py) on hand-made numbers: features
of a few shapes, the fit's cadence and its non-negative least squares, the largest chunk within a
budget at its exact boundary, the log line, and the TTFT / TPOT decisions. Every expected value is
worked out by hand in the comments (written against the survivors of the scheduler/ mutation run,
tests/MUTATION.md)."""
from __future__ import annotations

import pytest

from heterollm.scheduler.latency import MIN_STEPS, LatencyTargets, StepTimeModel, step_features


def model_with(coef: list[float]) -> StepTimeModel:
    """A model whose coefficients are set by hand: [1, tokens, seqs, kpairs, prefill], in seconds."""
    model = StepTimeModel()
    model.coef = list(coef)
    return model


def test_step_features_of_a_mixed_step_a_decode_step_and_an_empty_one():
    # a 4-token chunk after 2 cached: 4 * (2 + 5/2) = 18 pairs; a decode at context 10: 1 * (10 + 1) = 11
    assert step_features([(4, 2), (1, 10)]) == pytest.approx([1.0, 5, 2, 0.029, 1.0], rel=1e-12)
    # the prefill flag is kept by a later decode in the same step
    assert step_features([(4, 2), (1, 10)])[4] == 1.0
    # decodes only: 11 + (0 + 1) pairs, no prefill (a 1-token query is a decode)
    assert step_features([(1, 10), (1, 0)]) == pytest.approx([1.0, 2, 2, 0.012, 0.0], rel=1e-12)
    assert step_features([]) == [1.0, 0.0, 0.0, 0.0, 0.0]
    # a 2-token chunk is a prefill: 2 * (0 + 3/2) = 3 pairs
    assert step_features([(2, 0)]) == pytest.approx([1.0, 2, 1, 0.003, 1.0], rel=1e-12)


def test_observe_keeps_the_sample_and_the_relative_error_of_its_prediction():
    blank = StepTimeModel()
    blank.observe([(1, 0)], 0.004)
    assert list(blank.abs_errors) == [] and list(blank.samples) == [(step_features([(1, 0)]), 0.004)]
    model = model_with([0.002, 0.0, 0.0, 0.0, 0.0])  # predicts 2 ms for any step
    model.observe([(1, 0)], 0.004)  # |2 - 4| / 4
    model.observe([(3, 0)], 0.0)  # a zero time has no relative error (and no division by zero)
    model.observe([(1, 0)], 0.001)  # |2 - 1| / 1
    assert list(model.abs_errors) == [0.5, 1.0]
    assert [s for _, s in model.samples] == [0.004, 0.0, 0.001]


def test_the_model_keeps_only_the_last_window_steps():
    small = StepTimeModel(window=3)
    for i in range(1, 6):
        small.observe([(i, 0)], 0.001 * i)
    assert [s[1] for s in small.samples] == [0.003, 0.004, 0.005]
    fitted = StepTimeModel(window=2, refit_every=100)
    fitted.coef = [0.001, 0.0, 0.0, 0.0, 0.0]
    for seconds in (0.001, 0.002, 0.004):  # errors 0, 1/2, 3/4: the first one falls out
        fitted.observe([(1, 0)], seconds)
    assert list(fitted.abs_errors) == pytest.approx([0.5, 0.75], rel=1e-12)


def test_by_default_the_model_keeps_the_last_256_steps():
    """README: "fitted by least squares over the last 256 steps"."""
    model = StepTimeModel()
    for i in range(300):
        model.observe([(1 + i % 3, 0)], 0.001 * (1 + i % 3))
    assert len(model.samples) == 256 and model.samples[0][1] == 0.001 * (1 + 44 % 3)


def test_it_refits_on_every_step_until_ready_then_every_refit_every_steps():
    model = StepTimeModel(refit_every=3)
    fits = []
    real_fit = model.fit

    def counting_fit():
        fits.append(len(model.samples))
        real_fit()

    model.fit = counting_fit
    for n in range(2, 16):  # distinct single prefills
        model.observe([(n, 0)], 0.001 * n)
    # not ready while fewer than MIN_STEPS (8) samples: a fit after each; ready at 8, then every 3rd step
    assert MIN_STEPS == 8
    assert fits == [1, 2, 3, 4, 5, 6, 7, 8, 11, 14]


def test_it_needs_min_steps_samples_of_at_least_two_shapes():
    model = StepTimeModel()
    for i in range(7):
        model.observe([(1 + i % 2, 0)], 0.001)
    assert not model.ready and model.predict([(1, 0)]) is None
    model.observe([(1, 0)], 0.001)
    assert model.ready  # 8 samples, 2 shapes
    same = StepTimeModel()
    for _ in range(12):
        same.observe([(5, 0)], 0.001)
    same.fit()
    assert not same.ready and "not fitted yet (12 steps)" in same.describe()


def samples(rows: list[tuple[list[float], float]]) -> StepTimeModel:
    model = StepTimeModel()
    model.samples.extend(rows)
    return model


def test_fit_drops_the_feature_that_comes_out_negative_and_refits_the_rest():
    # features [1, u, v, 0, 0] over the four (u, v) corners, twice each; time = 2 - u + 3v.
    # Least squares fits it exactly with u's coefficient -1; dropping u and refitting on [1, v]
    # (u is balanced, so it averages out): 1 -> 2 - 1/2 = 1.5, v -> 3. The absent columns stay 0.
    rows = [([1.0, u, v, 0.0, 0.0], 2 - u + 3 * v) for u in (0.0, 1.0) for v in (0.0, 1.0)] * 2
    model = samples(rows)
    model.fit()
    assert model.coef == pytest.approx([1.5, 0.0, 3.0, 0.0, 0.0], rel=1e-12, abs=1e-12)
    # a positive solution is kept as least squares gives it (u now helps: time = 2 + u + 3v)
    positive = samples([([1.0, u, v, 0.0, 0.0], 2 + u + 3 * v) for u in (0.0, 1.0) for v in (0.0, 1.0)] * 2)
    positive.fit()
    assert positive.coef == pytest.approx([2.0, 1.0, 3.0, 0.0, 0.0], rel=1e-12, abs=1e-12)


def test_fit_of_times_no_non_negative_model_reaches_is_all_zeros():
    model = samples([([1.0, float(n), 0.0, 0.0, 0.0], -1.0) for n in range(8)])
    model.fit()
    assert model.coef == pytest.approx([0.0] * 5, abs=1e-12)


def test_max_chunk_is_the_largest_within_the_budget_at_its_exact_boundary():
    per_token = model_with([0.0, 1.0, 0.0, 0.0, 0.0])  # one second a token
    decode = [(1, 0)]
    assert per_token.max_chunk(decode, 0, 10, 5.0) == 4  # 1 + 4 = 5 <= 5; 1 + 5 > 5
    assert type(per_token.max_chunk(decode, 0, 10, 5.0)) is int
    assert per_token.max_chunk(decode, 0, 3, 5.0) == 3  # the limit
    assert per_token.max_chunk(decode, 0, 10, 1.0) == 0  # the decode alone fills the budget
    assert per_token.max_chunk(decode, 0, 10, 0.5) == 0
    assert per_token.max_chunk(decode, 0, 0, 5.0) == 0
    assert per_token.max_chunk([], 0, 100, 37.0) == 37
    per_pair = model_with([0.0, 0.0, 0.0, 1000.0, 0.0])  # one second per attention pair
    # n tokens after 2 cached: n * (2 + (n + 1) / 2) pairs: 2 -> 7, 3 -> 12
    assert per_pair.max_chunk([], 2, 10, 10.0) == 2


def test_describe_the_model_before_and_after_fitting():
    model = StepTimeModel()
    assert model.describe() == "step-time model: not fitted yet (0 steps)"
    model.observe([(1, 0)], 0.001)
    model.observe([(2, 0)], 0.001)
    assert model.describe() == "step-time model: not fitted yet (2 steps)"
    terms = model_with([0.002, 0.00005, 0.0, 0.00001, 0.001])
    assert terms.describe() == ("step-time model: t_ms = 2 + 0.05*tokens + 0*seqs + 0.01*kpairs + 1*prefill "
                                "(fitted on 0 steps)")
    assert model_with([0.0999, 0.0, 0.0, 0.0, 0.0]).describe().startswith("step-time model: t_ms = 99.9 + 0*tokens")
    flat = model_with([0.002, 0.0, 0.0, 0.0, 0.0])
    flat.observe([(1, 0)], 0.004)  # error 50%
    flat.observe([(1, 0)], 0.001)  # error 100%
    assert flat.describe() == ("step-time model: t_ms = 2 + 0*tokens + 0*seqs + 0*kpairs + 0*prefill "
                               "(fitted on 2 steps, mean |error| 75% over 2 steps)")


def test_targets_are_kept_in_seconds():
    targets = LatencyTargets(StepTimeModel(), 20, 300)
    assert (targets.tpot_s, targets.ttft_s, targets.num_held) == (0.02, 0.3, 0)
    untargeted = LatencyTargets(StepTimeModel(), None, None)
    assert (untargeted.tpot_s, untargeted.ttft_s) == (None, None)


def test_ttft_at_risk_when_waited_plus_predicted_reaches_the_target():
    quarter = model_with([0.25, 0.0, 0.0, 0.0, 0.0])  # every step 0.25 s
    own = LatencyTargets(quarter, 20, None)
    assert own.ttft_at_risk(0.25, 10, 0, 500)  # 0.25 + 0.25 >= 0.5, exactly
    assert not own.ttft_at_risk(0.125, 10, 0, 500)
    assert not own.ttft_at_risk(1e9, 10, 0, None)  # no target at all
    glob = LatencyTargets(quarter, 20, 500)
    assert glob.ttft_at_risk(0.25, 10, 0, None) and not glob.ttft_at_risk(0.125, 10, 0, None)
    assert LatencyTargets(quarter, 20, 100_000).ttft_at_risk(0.25, 10, 0, 500)  # its own target first
    assert not LatencyTargets(quarter, 20, 1).ttft_at_risk(0.125, 10, 0, 500)
    blank = LatencyTargets(StepTimeModel(), 20, 500)  # nothing predicted yet: the time waited alone
    assert blank.ttft_at_risk(0.5, 10, 0, None) and not blank.ttft_at_risk(0.375, 10, 0, None)
    per_token = LatencyTargets(model_with([0.0, 0.001, 0.0, 0.0, 0.0]), 20, None)
    assert not per_token.ttft_at_risk(0.125, 300, 0, 500) and per_token.ttft_at_risk(0.125, 400, 0, 500)
    per_pair = LatencyTargets(model_with([0.0, 0.0, 0.0, 1.0, 0.0]), 20, None)
    # one token after 399 cached: 400 pairs, 0.4 s
    assert per_pair.ttft_at_risk(0.125, 1, 399, 500) and not per_pair.ttft_at_risk(0.125, 1, 0, 500)


def test_cap_shortens_holds_or_passes_a_prefill():
    decodes = [(1, 0)] * 4
    # -0.5 ms + 1 ms a token against 20 ms: 4 decodes + n tokens fit while n <= 16.5
    model = model_with([-0.0005, 0.001, 0.0, 0.0, 0.0])
    targets = LatencyTargets(model, 20, None)
    assert targets.cap(decodes, 10, 0, True) == 10 and targets.num_held == 0  # fits whole
    assert targets.cap(decodes, 16, 0, True) == 16 and targets.num_held == 0
    assert targets.cap(decodes, 100, 0, True) == 16 and targets.num_held == 1  # shortened to MIN_CHUNK
    assert targets.cap(decodes, 100, 0, False) == 0 and targets.num_held == 2  # unchunked: all or nothing
    tighter = LatencyTargets(model_with([-0.0005, 0.001, 0.0, 0.0, 0.0]), 19, None)  # n <= 15.5
    assert tighter.cap(decodes, 100, 0, True) == 0 and tighter.num_held == 1  # under MIN_CHUNK: held
    assert LatencyTargets(model, None, None).cap(decodes, 100, 0, True) == 100  # no TPOT target
    unready = LatencyTargets(StepTimeModel(), 1, None)
    assert unready.cap(decodes, 100, 0, False) == 100 and unready.num_held == 0
