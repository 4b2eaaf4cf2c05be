"""The graph runner: a real backend captures decode steps as device graphs (CUDA graph, ACL graph,
MLU graph) for batch-size buckets at start-up and replays them (subclass the core's
`DeviceGraphRunner` and supply its `GraphOps`); the template runs every step eagerly."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from heterollm.interfaces import DecodeInputs, GraphRunner, StepForward, StepInputs


class TemplateGraphRunner(GraphRunner):
    """Eager: captures nothing, replays nothing (the conformance kit reports its graph check as skipped)."""

    @classmethod
    def validate(cls, config) -> list[str]:
        return []

    def capture(self, forward: StepForward, batch_sizes: Sequence[int], make_inputs: DecodeInputs) -> None:
        """Nothing to capture."""

    def can_replay(self, num_tokens: int, is_decode_only: bool) -> bool:
        return False

    def run(self, forward: StepForward, inputs: StepInputs) -> torch.Tensor:
        return forward(inputs)
