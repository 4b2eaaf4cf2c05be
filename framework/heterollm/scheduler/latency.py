"""A step-time model for latency-aware admission (`--enable_latency_aware_schedule`).

A step's executor time is modelled as linear in its shape:

    t = c0 + c1 * tokens + c2 * seqs + c3 * attention_pairs / 1000 + c4 * has_prefill

where `attention_pairs` sums, over the step's requests, query tokens x the keys each attends to
(a decode at context L: L; a prefill chunk of q tokens after p cached ones: q * (p + (q + 1) / 2)),
and `has_prefill` is 1 for a step with any prefill chunk (backends often run decode-only steps on
a faster path, e.g. the CPU attention's or a captured graph).
It is fitted by least squares on the last `window` measured steps (a start-up profile seeds it),
with coefficients kept non-negative so a prediction never falls as a step grows.

The scheduler asks it how many prefill tokens fit into a step without the step breaking the TPOT
target of the decodes in it (`--max_global_tpot_ms`); a waiting request whose TTFT target
(`--max_global_ttft_ms`, or its own `ttft_slo_ms`) would break first is admitted anyway.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import torch

NAMES = ("1", "tokens", "seqs", "kpairs", "prefill")
MIN_STEPS = 8
"""Measured steps (of at least two shapes) before the model predicts anything."""


def step_features(shape: Iterable[tuple[int, int]]) -> list[float]:
    """(query tokens, cached context) per request -> the model's feature vector."""
    tokens = seqs = pairs = prefill = 0.0
    for q, ctx in shape:
        tokens += q
        seqs += 1
        pairs += q * (ctx + (q + 1) / 2)
        prefill = max(prefill, float(q > 1))
    return [1.0, tokens, seqs, pairs / 1000, prefill]


class StepTimeModel:
    def __init__(self, window: int = 256, refit_every: int = 8) -> None:
        self.samples: deque[tuple[list[float], float]] = deque(maxlen=window)
        self.coef: list[float] | None = None
        self.refit_every = refit_every
        self._since_fit = 0
        self.abs_errors: deque[float] = deque(maxlen=window)
        """Relative error of each prediction made for a step that then ran (for the profile log)."""

    # -- learning --------------------------------------------------------------------------
    def observe(self, shape: Iterable[tuple[int, int]], seconds: float) -> None:
        x = step_features(shape)
        guess = self.predict_features(x)
        if guess is not None and seconds > 0:
            self.abs_errors.append(abs(guess - seconds) / seconds)
        self.samples.append((x, seconds))
        self._since_fit += 1
        if self._since_fit >= self.refit_every or self.coef is None:
            self.fit()

    def fit(self) -> None:
        self._since_fit = 0
        if len(self.samples) < MIN_STEPS or len({tuple(x) for x, _ in self.samples}) < 2:
            return
        x = torch.tensor([s[0] for s in self.samples], dtype=torch.float64)
        y = torch.tensor([s[1] for s in self.samples], dtype=torch.float64)
        active = list(range(x.shape[1]))
        while active:  # least squares, dropping features that come out negative (a tiny active-set NNLS)
            sol = torch.linalg.lstsq(x[:, active], y.unsqueeze(1), driver="gelsd").solution.squeeze(1)
            if (sol >= 0).all():
                break
            active.pop(int(sol.argmin()))
        coef = [0.0] * x.shape[1]
        for i, c in zip(active, sol.tolist() if active else []):
            coef[i] = c
        self.coef = coef

    # -- asking ----------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.coef is not None

    def predict_features(self, x: list[float]) -> float | None:
        if self.coef is None:
            return None
        return sum(c * v for c, v in zip(self.coef, x))

    def predict(self, shape: Iterable[tuple[int, int]]) -> float | None:
        """Predicted seconds of a step with these (query tokens, cached context) pairs."""
        return self.predict_features(step_features(shape))

    def max_chunk(self, shape: list[tuple[int, int]], ctx: int, limit: int, budget_s: float) -> int:
        """The most prefill tokens (<= limit) a request with `ctx` cached tokens can add to `shape`
        and keep the step within `budget_s` (0 when not even one fits)."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.predict([*shape, (mid, ctx)]) <= budget_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def describe(self) -> str:
        if self.coef is None:
            return f"step-time model: not fitted yet ({len(self.samples)} steps)"
        terms = " + ".join(f"{1000 * c:.3g}*{n}" if n != "1" else f"{1000 * c:.3g}" for c, n in zip(self.coef, NAMES))
        err = (f", mean |error| {100 * sum(self.abs_errors) / len(self.abs_errors):.0f}% over "
               f"{len(self.abs_errors)} steps" if self.abs_errors else "")
        return f"step-time model: t_ms = {terms} (fitted on {len(self.samples)} steps{err})"


class LatencyTargets:
    """--enable_latency_aware_schedule: the model and the targets the scheduler keeps to."""

    MIN_CHUNK = 16
    """A prefill chunk smaller than this is not worth a step: the request waits instead."""

    def __init__(self, model: StepTimeModel, tpot_ms: int | None, ttft_ms: int | None) -> None:
        self.model = model
        self.tpot_s = None if tpot_ms is None else tpot_ms / 1000
        self.ttft_s = None if ttft_ms is None else ttft_ms / 1000
        self.num_held = 0
        """Prefill chunks held back or shortened to keep the TPOT target."""
        self.h2d_control = False
        """--enable_control_h2d_block_num: cap a step's host-tier copies back (`copy_budget`)."""
        self.copy_s_per_block: float | None = None
        """Seconds one block's copy back from the host tier takes (a moving average of measured steps)."""

    def observe_copy(self, blocks: int, seconds: float) -> None:
        if blocks > 0 and seconds > 0:
            per = seconds / blocks
            self.copy_s_per_block = per if self.copy_s_per_block is None else 0.8 * self.copy_s_per_block + 0.2 * per

    def copy_budget(self) -> int | None:
        """--enable_control_h2d_block_num: the host-tier blocks a step may copy back, so the copy takes
        no longer than the TPOT target the step keeps (xLLM's latency budget), and one at least: the
        blocks past it are recomputed instead, in the step's prefill. None: no cap (off, no target, or
        nothing measured yet)."""
        if not self.h2d_control or self.copy_s_per_block is None or self.tpot_s is None:
            return None
        return max(1, int(self.tpot_s / self.copy_s_per_block))  # one at least: the speed is measured again

    def ttft_at_risk(self, waited_s: float, remaining: int, ctx: int, own_ttft_ms: int | None) -> bool:
        target = own_ttft_ms / 1000 if own_ttft_ms is not None else self.ttft_s
        if target is None:
            return False
        return waited_s + (self.model.predict([(remaining, ctx)]) or 0.0) >= target

    def cap(self, shape: list[tuple[int, int]], num_new: int, ctx: int, chunked: bool) -> int:
        """How many of `num_new` prefill tokens the step can take within the TPOT target."""
        if self.tpot_s is None or not self.model.ready:
            return num_new
        n = self.model.max_chunk(shape, ctx, num_new, self.tpot_s)
        if n < num_new:
            self.num_held += 1
            if not chunked or n < min(num_new, self.MIN_CHUNK):
                return 0
        return n
