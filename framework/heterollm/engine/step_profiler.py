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
    spec: tuple[int, int, int] | None = None
    """Speculative decoding: (verifications, drafts, accepted drafts) of the step."""

    @property
    def is_decode(self) -> bool:
        """One token per sequence (drafts to verify aside)."""
        return self.num_tokens - (self.spec[1] if self.spec else 0) == self.num_seqs

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

    def record(self, num_seqs: int, num_tokens: int, schedule: float, runner: dict[str, float], output: float,
               spec: tuple[int, int, int] | None = None) -> None:
        """`runner`'s "draft" (a draft model's proposals) counts as sampling time."""
        seconds = {"schedule": schedule, **{k: runner.get(k, 0.0) for k in ("prepare", "forward", "sample")},
                   "output": output}
        seconds["sample"] += runner.get("draft", 0.0)
        rec = StepRecord(num_seqs, num_tokens, seconds, spec)
        self.records.append(rec)
        self.num_steps += 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("step %d: %d seqs, %d tokens, %s%s", self.num_steps, num_seqs, num_tokens, _fmt(seconds),
                         f", {spec[2]}/{spec[1]} drafts accepted" if spec else "")
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
        spec = [r.spec for r in self.records if r.spec is not None]
        if spec:
            checks, drafts, accepted = (sum(s[i] for s in spec) for i in range(3))
            parts.append(f"speculative: {drafts} drafts in {checks} verifications, acceptance "
                         f"{100 * accepted / drafts if drafts else 0:.1f}%, mean accepted length "
                         f"{1 + accepted / checks if checks else 1:.2f} tokens per step")
        if self.model is not None:
            parts.append(self.model.describe())
        logger.info("step time: %s", "; ".join(parts))
        self.records.clear()


def _fmt(seconds: dict[str, float]) -> str:
    return " ".join(f"{p} {1000 * seconds[p]:.2f}" for p in PHASES)
