"""Speculative decoding's counters: how many drafts were verified and how many the target accepted,
overall and by position (the j-th draft of a step is only reached when the j - 1 before it were
accepted). Read by /metrics and --enable_profile_step_time."""
from __future__ import annotations

from dataclasses import dataclass, field

from heterollm.interfaces import RunnerOutput, SchedulerOutput


@dataclass
class SpecStats:
    num_drafts: int = 0
    """Verifications: one per sequence per step that carried drafts."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    """[j]: verifications whose draft j (0-based) was accepted."""

    def observe(self, so: SchedulerOutput, result: RunnerOutput) -> tuple[int, int, int]:
        """Count one step; returns its (verifications, drafts, accepted)."""
        sampled = dict(zip(result.request_ids, result.sampled_token_ids))
        step = [0, 0, 0]
        for item in so.requests:
            k = item.num_spec_tokens
            if not k or item.request_id not in sampled:
                continue
            accepted = max(len(sampled[item.request_id]) - 1, 0)
            step[0] += 1
            step[1] += k
            step[2] += accepted
            if len(self.accepted_per_position) < k:
                self.accepted_per_position += [0] * (k - len(self.accepted_per_position))
            for j in range(accepted):
                self.accepted_per_position[j] += 1
        self.num_drafts += step[0]
        self.num_draft_tokens += step[1]
        self.num_accepted_tokens += step[2]
        return step[0], step[1], step[2]

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verification emits on average: the accepted drafts plus the target's own."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None
