"""Qwen3-MoE (Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 decoder (per-head q/k
RMSNorm, `attention_bias` on all four projections) whose MLP is a sparse block: softmax router, the
top `num_experts_per_tok` experts, their weights renormalized when `norm_topk_prob`; no shared
expert. `mlp_only_layers` and `decoder_sparse_step` leave some layers dense, as in Qwen2-MoE."""
from __future__ import annotations

from heterollm.model_executor.models.llama import LlamaForCausalLM
from heterollm.model_executor.models.qwen2_moe import MoeDecoderLayer
from heterollm.model_executor.moe import MoeWeightsMixin, SparseMoeBlock


class Qwen3MoeForCausalLM(MoeWeightsMixin, LlamaForCausalLM):
    qk_norm = True
    mlp_class = SparseMoeBlock
    layer_class = MoeDecoderLayer
    gguf_experts = True
