"""Llama-family decoder (Llama 2/3.x, SmolLM2, Mistral with its sliding window), with the switches
Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm) need. Written once against the layer API."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from heterollm.model_executor import ops
from heterollm.model_executor.layers import (Attention, ForwardContext, MergedColumnParallelLinear, ParallelLMHead,
                                             RMSNorm, RotaryEmbedding, RowParallelLinear, VocabParallelEmbedding,
                                             sliding_window)
from heterollm.model_executor.parallel import ParallelContext


def rotary_dim(cfg: Any, head_dim: int) -> int:
    """Features of a head that the rotary embedding turns: head_dim x partial_rotary_factor (read from
    rope_parameters, where transformers keeps it, or the config)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or 1.0)
    return int(head_dim * factor)


class DecoderAttention(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, pctx: ParallelContext, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.total_heads = cfg.num_attention_heads
        self.total_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.total_heads
        self.head_dim = getattr(cfg, "head_dim", None) or hidden // self.total_heads
        self.num_heads = pctx.shard(self.total_heads, "num_attention_heads")
        self.num_kv_heads, kv_parts = pctx.kv_heads(self.total_kv_heads)
        kv_out = self.total_kv_heads * self.head_dim
        self.qkv_proj = MergedColumnParallelLinear(hidden, [self.total_heads * self.head_dim, kv_out, kv_out],
                                                   qkv_bias, pctx, partitions=[pctx.tp_size, kv_parts, kv_parts])
        self.o_proj = RowParallelLinear(self.total_heads * self.head_dim, hidden, o_bias, pctx)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.rotary_dim = rotary_dim(cfg, self.head_dim)
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5,
                              sliding_window(cfg, layer_idx))

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.output(self.attend(*self.project(rope, x), ctx))

    # A decoder layer's attention in three parts, so that the layer can compile the two around the
    # backend call as regions (DecoderLayer.begin / finish): project, attend, output.
    def project(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q and k heads side by side, rotated: (tokens, heads + kv_heads, head_dim); v) of the normed
        hidden states x. Two tensors that share no memory: what a compile region may return."""
        n = x.shape[0]
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        # heads first, then slices: a view of a column slice would make a compiled step guard on n >= 2
        qkv = self.qkv_proj.matmul(x, self.qkv_proj.bias).view(n, h + 2 * kv, d)
        v = qkv[:, h + kv:]
        if self.q_norm is None:  # rotate all the q and k heads in one call
            return self.rotate(rope, qkv[:, :h + kv]), v
        q, k = self.q_norm(qkv[:, :h]), self.k_norm(qkv[:, h:h + kv])
        return self.rotate(rope, torch.cat([q, k], dim=1)), v

    def attend(self, qk: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The attention backend over this layer's cache: (tokens, heads * head_dim)."""
        h = self.num_heads
        return self.attn(qk[:, :h], qk[:, h:], v, ctx).reshape(qk.shape[0], h * self.head_dim)

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        return self.o_proj(attended)

    def rotate(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Rotary embedding on the first `rotary_dim` features of each head (all of them unless the
        config sets a partial_rotary_factor, as Phi-4-mini and GLM do); the rest pass through."""
        if self.rotary_dim == self.head_dim:
            return self.rotary.apply(rope, x)
        r = self.rotary_dim
        return torch.cat([self.rotary.apply(rope, x[..., :r].contiguous()), x[..., r:]], dim=-1)


class MLP(nn.Module):
    def __init__(self, cfg: Any, pctx: ParallelContext) -> None:
        super().__init__()
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (silu only)")
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias, pctx)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias, pctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.get("silu_and_mul")(*self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, idx: int, pctx: ParallelContext, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 rotary: RotaryEmbedding, mlp_class: type[MLP] = MLP) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(cfg, idx, pctx, qkv_bias, o_bias, qk_norm, rotary)
        self.mlp = mlp_class(cfg, pctx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.finish(x, self.self_attn.attend(*self.begin(rope, x), ctx))

    # The layer's two halves around its attention are compile regions: a compiling graph runner (the
    # CPU's torch.compile) traces and lowers each once and runs every layer through that one graph,
    # with the layer's own weights as inputs (a compiled start-up ~20 s shorter for SmolLM2's 30
    # layers). The attention stays outside: which cache it reads is the layer's index, a constant.
    # Eager, a region is a plain call.
    @torch.compiler.nested_compile_region
    def begin(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer up to its attention: the input norm, then `DecoderAttention.project`."""
        return self.self_attn.project(rope, self.input_layernorm(x))

    @torch.compiler.nested_compile_region
    def finish(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The layer after its attention: the output projection, the residuals and the MLP."""
        x = x + self.self_attn.output(attn_out)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: Any, pctx: ParallelContext, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 max_positions: int, mlp_class: type[MLP] = MLP,
                 layer_class: type[DecoderLayer] = DecoderLayer) -> None:
        super().__init__()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rotary = RotaryEmbedding(cfg, rotary_dim(cfg, head_dim), max_positions)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, pctx)
        self.layers = nn.ModuleList(layer_class(cfg, i, pctx, qkv_bias, o_bias, qk_norm, rotary, mlp_class)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = rotary

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions)
        for layer in self.layers:
            x = layer(rope, x, ctx)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    force_qkv_bias = False
    """Qwen2: q/k/v always carry a bias, o_proj never; elsewhere `attention_bias` covers all four."""
    qk_norm = False
    mlp_class: type[MLP] = MLP
    """The feed-forward block; a backend's model override may swap in its own (same weights)."""
    layer_class: type[DecoderLayer] = DecoderLayer

    def __init__(self, hf_config: Any, pctx: ParallelContext, max_positions: int) -> None:
        super().__init__()
        self.config = hf_config
        qkv_bias, o_bias = self.biases(hf_config)
        self.model = DecoderModel(hf_config, pctx, qkv_bias, o_bias, self.qk_norm, max_positions, self.mlp_class,
                                  self.layer_class)
        self.build_head(hf_config, pctx)

    def biases(self, hf_config: Any) -> tuple[bool, bool]:
        """(q/k/v carry a bias, o_proj carries one)."""
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return self.force_qkv_bias or attention_bias, attention_bias and not self.force_qkv_bias

    def build_head(self, hf_config: Any, pctx: ParallelContext) -> None:
        """The output projection `compute_logits` applies: the LM head (tied to the embedding when the
        config says so)."""
        self.tie = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, pctx)
        if self.tie:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def kv_geometry(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads on this rank, head_dim)."""
        attn = self.model.layers[0].self_attn
        return len(self.model.layers), attn.num_kv_heads, attn.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)

    # checkpoint projection -> (merged parameter, part)
    stacked = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load (HF name, full tensor) pairs; returns the parameter names completely filled."""
        params = dict(self.named_parameters(remove_duplicate=False))
        parts: dict[str, set[int]] = {}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.tie):
                continue
            prefix, _, kind = name.rpartition(".")
            module_path, _, proj = prefix.rpartition(".")
            if proj in self.stacked:
                merged, shard = self.stacked[proj]
                target = f"{module_path}.{merged}.{kind}"
                param = params.get(target)
                if param is None:
                    raise KeyError(name)
                param.weight_loader(param, tensor.to(param.dtype), shard)
                parts.setdefault(target, set()).add(shard)
                continue
            param = params.get(name)
            if param is None:
                raise KeyError(name)
            param.weight_loader(param, tensor.to(param.dtype))
            parts[name] = {0}
        loaded = {n for n, got in parts.items() if len(got) == getattr(params[n], "num_shards", 1)}
        if self.tie:
            loaded.add("lm_head.weight")
        return loaded


class Qwen2ForCausalLM(LlamaForCausalLM):
    force_qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class LlamaForSequenceClassification(LlamaForCausalLM):
    """A cross-encoder / reward checkpoint: the same decoder with a `score` head of one row per label
    instead of the LM head; `compute_logits` gives the label logits (the pooler reads the last
    position's)."""

    def build_head(self, hf_config: Any, pctx: ParallelContext) -> None:
        self.tie = False
        self.score = ParallelLMHead(int(getattr(hf_config, "num_labels", 1)), hf_config.hidden_size, pctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.score.logits(hidden)


class Qwen2ForSequenceClassification(LlamaForSequenceClassification):
    force_qkv_bias = True


class Qwen3ForSequenceClassification(LlamaForSequenceClassification):
    qk_norm = True
