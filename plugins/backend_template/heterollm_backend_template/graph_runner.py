"""The graph runner: a real backend captures decode steps as device graphs (CUDA graph, ACL graph,
MLU graph) for batch-size buckets and replays them; the template runs every step eagerly."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from heterollm.interfaces import GraphRunner


class TemplateGraphRunner(GraphRunner):
    platforms = ("template",)

    @classmethod
    def validate(cls, config) -> list[str]:
        return []

    def capture(self, forward: Callable[..., Any], batch_sizes: Sequence[int]) -> None:
        """Nothing to capture."""

    def can_replay(self, num_tokens: int, is_decode_only: bool) -> bool:
        return False

    def run(self, forward: Callable[..., Any], **inputs: Any) -> Any:
        return forward(**inputs)
