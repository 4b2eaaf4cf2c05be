"""GraphRunner: captured decode graphs (entry-point group `heterollm.graph_runners`)."""
from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from heterollm.interfaces.component import Component


class GraphRunner(Component):
    """Runs the model's forward, replaying a captured graph for decode batches that fit.

    CUDA graph on CUDA, ACL graph on Ascend, MLU graph on Cambricon; eager on CPU.
    """

    @abstractmethod
    def capture(self, forward: Callable[..., Any], batch_sizes: Sequence[int]) -> None:
        """Capture `forward` for each decode batch size (no-op for an eager runner)."""

    @abstractmethod
    def can_replay(self, num_tokens: int, is_decode_only: bool) -> bool:
        """Whether a batch of `num_tokens` would replay a captured graph rather than run eagerly."""

    @abstractmethod
    def run(self, forward: Callable[..., Any], **inputs: Any) -> Any:
        """Run one step: replay a captured graph when `can_replay`, else call `forward(**inputs)`."""
