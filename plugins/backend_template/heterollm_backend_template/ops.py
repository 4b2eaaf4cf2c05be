"""The template's kernels, put into heterollm's op registry under the family "template" once per
launch (`Backend.register_ops`). A real backend registers its fused kernels the same way: models
call `ops.get(name)`, and the runner picks the selected family's implementation."""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F

from heterollm.model_executor import ops

calls: Counter[str] = Counter()
"""How often each template kernel ran in this process (what the template's tests read)."""


def fused_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate) * up) in one call. x: (tokens, hidden); gate_up: (2 * inter, hidden), gate rows
    first; down: (hidden, inter). A real backend calls its fused MLP kernel here."""
    calls["template.fused_mlp"] += 1
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def unfused_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The same math through the core's `silu_and_mul` op (what runs without --template_fast_path)."""
    calls["template.unfused_mlp"] += 1
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(ops.get("silu_and_mul")(gate, up), down)


def register_ops(config: Any) -> None:
    """Called once per launch with the effective config: the template's own flag picks the kernel."""
    fast = config.template.template_fast_path
    ops.register("template.mlp", family="template")(fused_mlp if fast else unfused_mlp)
