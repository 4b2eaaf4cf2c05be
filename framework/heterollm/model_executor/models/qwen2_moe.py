"""Qwen2-MoE (Qwen2MoeForCausalLM: Qwen1.5-MoE, Qwen2-57B-A14B): the Qwen2 decoder (q/k/v bias from
`qkv_bias`, none on o_proj) whose MLP is a sparse block: softmax router over `num_experts`, the top
`num_experts_per_tok` experts (their weights renormalized when `norm_topk_prob`), plus a shared
expert every token goes through, scaled by sigmoid(shared_expert_gate(x)). Layers listed in
`mlp_only_layers`, or off the `decoder_sparse_step` stride, keep a dense MLP of `intermediate_size`."""
from __future__ import annotations

from typing import Any

from heterollm.model_executor.models.llama import MLP, DecoderLayer, LlamaForCausalLM
from heterollm.model_executor.moe import MoeWeightsMixin, SparseMoeBlock, is_sparse_layer
from heterollm.model_executor.parallel import ParallelContext


class MoeDecoderLayer(DecoderLayer):
    """The shared decoder layer with the model's sparse block where the config makes the layer sparse,
    the dense MLP elsewhere."""

    def __init__(self, cfg: Any, idx: int, pctx: ParallelContext, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 rotary: Any, mlp_class: type = MLP) -> None:
        super().__init__(cfg, idx, pctx, qkv_bias, o_bias, qk_norm, rotary,
                         mlp_class if is_sparse_layer(cfg, idx) else MLP)


class Qwen2MoeForCausalLM(MoeWeightsMixin, LlamaForCausalLM):
    mlp_class = SparseMoeBlock
    layer_class = MoeDecoderLayer
    gguf_experts = True

    def biases(self, hf_config: Any) -> tuple[bool, bool]:
        return bool(getattr(hf_config, "qkv_bias", True)), False
