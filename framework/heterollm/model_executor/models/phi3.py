"""Phi-3 / Phi-4 (Phi3ForCausalLM): the Llama decoder with q/k/v and gate/up fused in the checkpoint
(split here into the parts the merged layers shard), a partial rotary factor (Phi-4-mini) and an
optional sliding window (Phi-3-mini), both handled by the shared decoder."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from heterollm.model_executor.models.llama import LlamaForCausalLM
from heterollm.model_executor.parallel import ParallelContext


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, hf_config: Any, pctx: ParallelContext, max_positions: int) -> None:
        rope_type = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type == "longrope":  # transformers switches factors with the running length
            raise ValueError("rope type 'longrope' (Phi-3 128k, Phi-4-mini) depends on the running sequence "
                             "length; not supported yet")
        super().__init__(hf_config, pctx, max_positions)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(unfuse(self, weights))


def unfuse(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """qkv_proj -> q_proj, k_proj, v_proj; gate_up_proj -> gate_proj, up_proj (rows, in that order)."""
    attn = model.model.layers[0].self_attn
    q_rows, kv_rows = attn.total_heads * attn.head_dim, attn.total_kv_heads * attn.head_dim
    for name, tensor in weights:
        prefix, _, kind = name.rpartition(".")
        module, _, proj = prefix.rpartition(".")
        if proj == "qkv_proj":
            parts = zip(("q_proj", "k_proj", "v_proj"), tensor.split([q_rows, kv_rows, kv_rows]))
        elif proj == "gate_up_proj":
            parts = zip(("gate_proj", "up_proj"), tensor.chunk(2))
        else:
            yield name, tensor
            continue
        for part, rows in parts:
            yield f"{module}.{part}.{kind}", rows
