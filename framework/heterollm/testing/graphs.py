"""Graph ops for checking a graph runner's bookkeeping on a machine without the device: a
"capture" keeps the function and a replay re-runs it into the captured output tensor, so it reads
exactly what the static buffers hold at replay time, as a device graph would."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from heterollm.model_executor.graph_capture import GraphOps


class CaptureFailed(RuntimeError):
    """What `RerunGraphOps(fail_at=n)` raises on its n-th capture (a device out of graph memory, a
    kernel that cannot be captured)."""


class RerunGraphOps(GraphOps):
    """`captures` counts successful captures; `fail_at` (1-based) makes that capture raise."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.captures = 0
        self.fail_at = fail_at

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        if self.fail_at == self.captures + 1:
            raise CaptureFailed(f"capture {self.fail_at} failed (RerunGraphOps(fail_at={self.fail_at}))")
        self.captures += 1
        out = fn().clone()
        return (fn, out), out

    def replay(self, graph: Any) -> None:
        fn, out = graph
        out.copy_(fn())
