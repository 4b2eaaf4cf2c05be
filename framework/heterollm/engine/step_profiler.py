"""--enable_profile_step_time: where each engine step's time goes.

Every step is split into schedule (the scheduler's decision), prepare (model inputs and attention
metadata), forward (the model), sample (logits, sampler, prompt logprobs) and output (scheduler
update, detokenization, stop checks). Each step is logged at DEBUG; every `window` steps an INFO
line gives the mean milliseconds of each phase, and of decode-only and prefill-carrying steps
apart, with the mean batch size."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("heterollm.profile")

PHASES = ("schedule", "prepare", "forward", "sample", "output")


@dataclass
class StepRecord:
    num_seqs: int
    num_tokens: int
    seconds: dict[str, float]

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == self.num_seqs

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


@dataclass
class StepProfiler:
    window: int = 50
    records: list[StepRecord] = field(default_factory=list)
    """The current window's steps."""
    num_steps: int = 0
    model: Any = None
    """The latency-aware scheduler's step-time model, described in each summary when there is one."""

    def record(self, num_seqs: int, num_tokens: int, schedule: float, runner: dict[str, float], output: float) -> None:
        seconds = {"schedule": schedule, **{k: runner.get(k, 0.0) for k in ("prepare", "forward", "sample")},
                   "output": output}
        rec = StepRecord(num_seqs, num_tokens, seconds)
        self.records.append(rec)
        self.num_steps += 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("step %d: %d seqs, %d tokens, %s", self.num_steps, num_seqs, num_tokens, _fmt(seconds))
        if len(self.records) >= self.window:
            self.flush()

    def flush(self) -> None:
        """Log the summary of the steps since the last one."""
        if not self.records:
            return
        decode = [r for r in self.records if r.is_decode]
        prefill = [r for r in self.records if not r.is_decode]
        parts = [f"{len(self.records)} steps to #{self.num_steps}"]
        for label, recs in (("decode", decode), ("prefill/mixed", prefill)):
            if recs:
                mean = {p: sum(r.seconds[p] for r in recs) / len(recs) for p in PHASES}
                seqs = sum(r.num_seqs for r in recs) / len(recs)
                tokens = sum(r.num_tokens for r in recs) / len(recs)
                parts.append(f"{label} x{len(recs)} ({seqs:.1f} seqs, {tokens:.0f} tokens): "
                             f"{1000 * sum(mean.values()):.1f} ms = {_fmt(mean)}")
        if self.model is not None:
            parts.append(self.model.describe())
        logger.info("step time: %s", "; ".join(parts))
        self.records.clear()


def _fmt(seconds: dict[str, float]) -> str:
    return " ".join(f"{p} {1000 * seconds[p]:.2f}" for p in PHASES)
