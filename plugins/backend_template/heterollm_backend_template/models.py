"""A model override: the core's Llama with each MLP routed through the template's own op
(`template.mlp`). Registered under the family "template" for `LlamaForCausalLM` only; every other
architecture falls back to the core's implementation."""
from __future__ import annotations

import torch

from heterollm.model_executor import ops
from heterollm.model_executor.models.llama import MLP, LlamaForCausalLM


class TemplateMLP(MLP):
    """The same parameters as the core's MLP (checkpoints load unchanged), one op call. The op reads
    the plain weight tensors, so the layers keep torch's layout (no backend linear method)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.get("template.mlp")(x, self.gate_up_proj.weight, self.down_proj.weight)


class TemplateLlamaForCausalLM(LlamaForCausalLM):
    mlp_class = TemplateMLP

    def __init__(self, hf_config, pctx, max_positions: int) -> None:
        if pctx.tp_size > 1:
            raise ValueError("the template's fused MLP runs unsharded (tensor parallelism is not supported)")
        super().__init__(hf_config, pctx, max_positions)
