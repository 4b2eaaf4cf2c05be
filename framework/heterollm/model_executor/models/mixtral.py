"""Mixtral (MixtralForCausalLM: Mixtral-8x7B, 8x22B): the Mistral decoder (its `sliding_window`
honoured) with a sparse block on every layer: softmax router over `num_local_experts`, the top
`num_experts_per_tok` experts with their weights always renormalized to sum to one (equal to a
softmax over the top-k logits) and kept in fp32, as transformers keeps them. Checkpoints name the
block `block_sparse_moe` and the experts' projections w1 (gate), w3 (up), w2 (down)."""
from __future__ import annotations

from typing import Any

from heterollm.model_executor.models.llama import LlamaForCausalLM
from heterollm.model_executor.moe import MoeWeightsMixin, SparseMoeBlock


class MixtralSparseMoeBlock(SparseMoeBlock):
    renormalize_always = True
    fp32_weights = True

    @staticmethod
    def num_experts(cfg: Any) -> int:
        return int(cfg.num_local_experts)

    @staticmethod
    def expert_intermediate(cfg: Any) -> int:
        return int(cfg.intermediate_size)


class MixtralForCausalLM(MoeWeightsMixin, LlamaForCausalLM):
    mlp_class = MixtralSparseMoeBlock
    expert_projections = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", 0),
                          "gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}
    block_aliases = {"block_sparse_moe": "mlp"}
    gguf_experts = True  # llama.cpp's `llama` files with experts (gguf_cache reads them as Mixtral)
