"""The CPU runner is eager: there is no graph to capture on CPU."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from heterollm.interfaces import GraphRunner


class CpuEagerRunner(GraphRunner):
    platforms = ("cpu",)

    @classmethod
    def validate(cls, config) -> list[str]:
        return []

    def capture(self, forward: Callable[..., Any], batch_sizes: Sequence[int]) -> None:
        """Nothing to capture."""

    def can_replay(self, num_tokens: int, is_decode_only: bool) -> bool:
        return False

    def run(self, forward: Callable[..., Any], **inputs: Any) -> Any:
        return forward(**inputs)
