"""Graph ops for checking a graph runner's bookkeeping on a machine without the device: a
"capture" keeps the function and a replay re-runs it into the captured output tensor, so it reads
exactly what the static buffers hold at replay time, as a device graph would."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from heterollm.model_executor.graph_capture import GraphOps


class RerunGraphOps(GraphOps):
    def __init__(self) -> None:
        self.captures = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        self.captures += 1
        out = fn().clone()
        return (fn, out), out

    def replay(self, graph: Any) -> None:
        fn, out = graph
        out.copy_(fn())
