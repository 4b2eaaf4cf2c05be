"""Gemma 2 and Gemma 3 text (Gemma2ForCausalLM; Gemma3ForCausalLM: gemma-3-1b and the text
checkpoints): the Llama layer API with Gemma's differences: RMSNorm scaled by (1 + weight) in fp32,
embeddings times sqrt(hidden), a norm before and after both attention and MLP, GeLU-tanh gating,
the score scale query_pre_attn_scalar^-0.5, final logit soft-capping, and alternating sliding-window
layers. Gemma 2 caps attention scores (attn_logit_softcapping, through the attention backend);
Gemma 3 adds per-head q/k norms and turns its sliding layers' rotary embedding at a local base
while the full-attention layers use the global one (with its scaling)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from heterollm.model_executor.layers import (ForwardContext, MergedColumnParallelLinear, RotaryEmbedding,
                                             RowParallelLinear, VocabParallelEmbedding, _copy)
from heterollm.model_executor.models.llama import DecoderAttention, DecoderLayer, LlamaForCausalLM
from heterollm.model_executor.parallel import ParallelContext


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), computed in fp32 and cast back, as transformers' Gemma3RMSNorm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.weight.weight_loader = _copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(nn.Module):
    def __init__(self, cfg: Any, pctx: ParallelContext) -> None:
        super().__init__()
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh only)")
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, False, pctx)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, pctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, idx: int, pctx: ParallelContext, rotary: RotaryEmbedding, rope_key: str,
                 qk_norm: bool) -> None:
        super().__init__()
        self.rope_key = rope_key
        """Which of the model's rotary tables this layer uses."""
        self.self_attn = DecoderAttention(cfg, idx, pctx, False, False, qk_norm, rotary)
        head_dim = self.self_attn.head_dim
        if qk_norm:
            self.self_attn.q_norm = GemmaRMSNorm(head_dim, cfg.rms_norm_eps)
            self.self_attn.k_norm = GemmaRMSNorm(head_dim, cfg.rms_norm_eps)
        self.self_attn.attn.scale = cfg.query_pre_attn_scalar ** -0.5
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            self.self_attn.attn.options["logit_softcap"] = float(cfg.attn_logit_softcapping)
        self.mlp = GemmaMLP(cfg, pctx)
        norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm")
        for name in norms:
            setattr(self, name, GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    # DecoderLayer's step and its first compile region; the second has Gemma's four norms
    forward, begin = DecoderLayer.forward, DecoderLayer.begin

    @torch.compiler.nested_compile_region
    def finish(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn.output(attn_out))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, cfg: Any, pctx: ParallelContext, max_positions: int, qk_norm: bool) -> None:
        super().__init__()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        params = getattr(cfg, "rope_parameters", None) or {}
        types = sorted(set(cfg.layer_types))
        if all(isinstance(params.get(t), dict) for t in types):  # Gemma 3: a table per layer type
            self.rotary = nn.ModuleDict({t: RotaryEmbedding(cfg, head_dim, max_positions, t) for t in types})
            keys = list(cfg.layer_types)
        else:
            self.rotary = nn.ModuleDict({"all": RotaryEmbedding(cfg, head_dim, max_positions)})
            keys = ["all"] * cfg.num_hidden_layers
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, pctx)
        self.embed_scale = cfg.hidden_size ** 0.5
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i, pctx, self.rotary[keys[i]], keys[i], qk_norm)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # rounded to the dtype, as transformers does
        ropes = {t: rotary.lookup(positions) for t, rotary in self.rotary.items()}
        for layer in self.layers:
            x = layer(ropes[layer.rope_key], x, ctx)
        return self.norm(x)


class Gemma3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

    def __init__(self, hf_config: Any, pctx: ParallelContext, max_positions: int) -> None:
        nn.Module.__init__(self)
        self.config = hf_config
        self.model = GemmaModel(hf_config, pctx, max_positions, self.qk_norm)
        self.softcap = getattr(hf_config, "final_logit_softcapping", None)
        self.build_head(hf_config, pctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    qk_norm = False
