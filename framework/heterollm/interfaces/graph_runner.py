"""GraphRunner: captured decode graphs (a backend's `components["graph_runners"]`)."""
from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

from heterollm.interfaces.component import Component

if TYPE_CHECKING:
    import torch

    from heterollm.interfaces.step import DecodeInputs, StepForward, StepInputs


class GraphRunner(Component):
    """Runs the model's forward, replaying a captured graph for decode-only batches that fit.

    CUDA graph on CUDA, ACL graph on Ascend, MLU graph on Cambricon; torch.compile on CPU.
    Call order: `capture` once at start-up (before any request), then `run` every step.
    """

    num_replays: int = 0
    """Steps served from a captured graph so far (the conformance kit checks it moves)."""

    @abstractmethod
    def capture(self, forward: StepForward, batch_sizes: Sequence[int], make_inputs: DecodeInputs) -> None:
        """Capture `forward` for decode-only batches of each size, largest first, graphs sharing
        one memory pool; `make_inputs(n)` gives a step of n decodes to capture from. Empty
        `batch_sizes`: no graphs, every step runs eagerly. Never captures later, in `run`.

        Raises when a capture fails, leaving the runner eager (as with no sizes); the model runner
        then logs a warning and serves eagerly."""

    @abstractmethod
    def can_replay(self, num_tokens: int, is_decode_only: bool) -> bool:
        """Whether a batch of `num_tokens` would replay a captured graph rather than run eagerly."""

    @abstractmethod
    def run(self, forward: StepForward, inputs: StepInputs) -> torch.Tensor:
        """Run one step: replay a captured graph when the step fits one, else `forward(inputs)`."""
