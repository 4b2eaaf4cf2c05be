"""DeepSeek-V2 and DeepSeek-V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM: DeepSeek-V2 / V2-Lite /
V2.5, DeepSeek-V3 / R1, Kimi-K2): multi-head latent attention (MLA) and a mixture of experts with
shared experts, after `first_k_dense_replace` dense layers.

MLA caches one latent per token: the RMS-normalized compressed KV (`kv_lora_rank` values) and the
rotated key part every head shares (`qk_rope_head_dim`). It runs in the absorbed form, through the
attention backend's `forward_mla`: each head's non-rotary query goes through that head's slice of
`kv_b_proj` (its key up-projection, W_UK) into the latent space, so heads attend to the latents
themselves; the attention-weighted latent then goes through the head's value up-projection (W_UV)
before `o_proj`. That equals transformers' expand-then-attend form, which caches the same latents.
The scale is 1/sqrt(qk_nope + qk_rope) times YaRN's mscale^2 (`mscale_all_dim`), as transformers folds it.
DeepSeek lays the rotary features out in interleaved pairs (V2 always; V3 with `rope_interleave`):
they are regrouped evens-then-odds and turned as rotate-half pairs, as transformers' V3 does; query
and key get the same layout, so scores are unchanged.

Routing: V2 takes a softmax over the routed experts and the top k ("greedy") or the top k within the
`topk_group` groups whose best expert scores highest ("group_limited_greedy"), times
`routed_scaling_factor`. V3 takes a sigmoid, adds the per-expert `e_score_correction_bias` for the
choice only, keeps the `topk_group` groups whose best two experts sum highest, weights the chosen
experts by their uncorrected scores (renormalized when `norm_topk_prob`) times `routed_scaling_factor`.
The router runs in fp32 (its weight is kept in fp32, as transformers keeps it). The shared experts
(`n_shared_experts` x `moe_intermediate_size`) are one dense MLP every token goes through.

Tensor parallelism shards the heads (q_b_proj / q_proj, kv_b_proj by rows, o_proj by columns) and the
experts' intermediate dimension; the latent down-projections and the latent cache are replicated.
`kv_b_proj` stays in the model dtype under `--quantization` (the absorbed form multiplies by its
per-head slices)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from heterollm.model_executor.layers import (ColumnParallelLinear, ForwardContext, MlaAttention, ReplicatedLinear,
                                             RMSNorm, RotaryEmbedding, RowParallelLinear, _copy, _shard_loader)
from heterollm.model_executor.models.llama import MLP, DecoderLayer, LlamaForCausalLM
from heterollm.model_executor.moe import (FusedMoE, MoeWeightsMixin, SharedExpert, group_limited_topk,
                                          routed_top_k)
from heterollm.model_executor.parallel import ParallelContext

LATENT_NORM_EPS = 1e-6
"""transformers builds q_a_layernorm and kv_a_layernorm with the RMSNorm default, not rms_norm_eps."""


def mla_scale(cfg: Any) -> float:
    """1/sqrt(qk_nope_head_dim + qk_rope_head_dim), times mscale^2 under YaRN with `mscale_all_dim`."""
    from transformers.modeling_rope_utils import yarn_apply_mscale

    params = getattr(cfg, "rope_parameters", None) or {}
    return float(yarn_apply_mscale(params, (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5))


class MlaUpProjection(nn.Module):
    """kv_b_proj, (heads * (qk_nope + v), kv_lora_rank), this rank's heads: per head its key (W_UK)
    then its value (W_UV) up-projection. Kept as a plain weight (no linear method): the absorbed form
    multiplies by its per-head slices."""

    def __init__(self, num_heads: int, nope: int, value: int, latent: int, pctx: ParallelContext) -> None:
        super().__init__()
        self.num_heads, self.nope, self.value = num_heads, nope, value
        self.weight = nn.Parameter(torch.empty(num_heads * (nope + value), latent), requires_grad=False)
        self.weight.weight_loader = _shard_loader(0, pctx)

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """(tokens, heads, nope) -> (heads, tokens, latent): q_nope . W_UK per head."""
        w = self.weight.view(self.num_heads, self.nope + self.value, -1)
        return torch.bmm(q_nope.transpose(0, 1), w[:, :self.nope])

    def expand_value(self, attended: torch.Tensor) -> torch.Tensor:
        """(tokens, heads, latent) -> (tokens, heads * value): each head's latent through its W_UV."""
        w = self.weight.view(self.num_heads, self.nope + self.value, -1)
        out = torch.bmm(attended.transpose(0, 1), w[:, self.nope:].transpose(1, 2))  # (heads, tokens, value)
        return out.transpose(0, 1).reshape(attended.shape[0], self.num_heads * self.value)


class MlaDecoderAttention(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, pctx: ParallelContext, rotary: RotaryEmbedding,
                 interleaved: bool) -> None:
        super().__init__()
        hidden, total = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = pctx.shard(total, "num_attention_heads")
        self.nope, self.rope, self.value = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora = cfg.kv_lora_rank
        self.q_lora = getattr(cfg, "q_lora_rank", None)
        bias = bool(getattr(cfg, "attention_bias", False))
        qk_head = self.nope + self.rope
        if self.q_lora:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora, bias)
            self.q_a_layernorm = RMSNorm(self.q_lora, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora, total * qk_head, False, pctx)
        else:
            self.q_proj = ColumnParallelLinear(hidden, total * qk_head, False, pctx)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora + self.rope, bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, LATENT_NORM_EPS)
        self.kv_b_proj = MlaUpProjection(self.num_heads, self.nope, self.value, self.kv_lora, pctx)
        self.o_proj = RowParallelLinear(total * self.value, hidden, bias, pctx)
        self.rotary = rotary
        # interleaved pairs (x0, x1), (x2, x3)... regrouped as rotate-half halves: evens, then odds
        order = torch.cat([torch.arange(0, self.rope, 2), torch.arange(1, self.rope, 2)])
        self.register_buffer("pair_order", order if interleaved else None, persistent=False)
        self.attn = MlaAttention(layer_idx, self.num_heads, self.kv_lora, mla_scale(cfg))

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.output(self.attend(*self.project(rope, x), ctx))

    # the three parts llama's DecoderAttention has (DecoderLayer compiles the outer two as regions)
    def project(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(each head's query in the latent space with its rotated part, the token's latent)."""
        n, h = x.shape[0], self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_pe = q.view(n, h, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        compressed, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope], dim=-1)
        # the shared key part is one more head beside the queries' rotary parts: turned in one call
        pe = torch.cat([q_pe, k_pe.unsqueeze(1)], dim=1)
        if self.pair_order is not None:
            pe = pe.index_select(-1, self.pair_order)
        pe = self.rotary.apply(rope, pe.contiguous())
        query = torch.cat([self.kv_b_proj.absorb_query(q_nope).transpose(0, 1), pe[:, :h]], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(compressed.contiguous()), pe[:, h]], dim=-1)
        return query, latent

    def attend(self, query: torch.Tensor, latent: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.attn(query, latent, ctx)  # (n, h, kv_lora)

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.kv_b_proj.expand_value(attended))


class DeepseekRouter(nn.Module):
    """The fp32 router: its (experts, hidden) weight and, for V3, `e_score_correction_bias`."""

    def __init__(self, hidden: int, num_experts: int, corrected: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32), requires_grad=False)
        self.weight.weight_loader = _copy
        self.e_score_correction_bias = None
        if corrected:
            self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32),
                                                        requires_grad=False)
            self.e_score_correction_bias.weight_loader = _copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x.float(), self.weight)


class DeepseekV2Moe(nn.Module):
    """Routed experts (FusedMoE) plus the shared experts, reduced once across ranks."""

    corrected = False
    """V3: sigmoid scores with `e_score_correction_bias` for the choice; V2: softmax scores."""

    def __init__(self, cfg: Any, pctx: ParallelContext) -> None:
        super().__init__()
        self.pctx = pctx
        self.num_experts = int(cfg.n_routed_experts)
        self.top_k = routed_top_k(cfg, self.num_experts)
        self.scaling = float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0)
        self.n_group = getattr(cfg, "n_group", None)
        self.topk_group = getattr(cfg, "topk_group", None)
        self.method = self.routing_method(cfg)
        if self.method != "greedy" and not (self.n_group and self.topk_group):
            raise ValueError(f"{self.method} routing needs n_group and topk_group")
        if self.method != "greedy" and not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"topk_group={self.topk_group} must be between 1 and n_group={self.n_group}")
        if self.method != "greedy" and self.num_experts % self.n_group:
            raise ValueError(f"n_group={self.n_group} does not divide the {self.num_experts} routed experts")
        self.norm_topk_prob = bool(getattr(cfg, "norm_topk_prob", False))
        self.gate = DeepseekRouter(cfg.hidden_size, self.num_experts, self.corrected)
        self.experts = FusedMoE(self.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, pctx)
        shared = int(getattr(cfg, "n_shared_experts", 0) or 0)
        self.shared_experts = SharedExpert(cfg.hidden_size, cfg.moe_intermediate_size * shared, pctx) if shared else None

    @staticmethod
    def routing_method(cfg: Any) -> str:
        method = getattr(cfg, "topk_method", None) or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method {method!r} is not supported by DeepseekV2ForCausalLM (greedy, "
                             f"group_limited_greedy; transformers runs no other)")
        return method

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights fp32, expert ids), each (tokens, top_k)."""
        scores = self.gate(x).softmax(dim=-1)
        if self.method == "greedy":
            weights, ids = scores.topk(self.top_k, dim=-1, sorted=False)
        else:
            ids = group_limited_topk(scores, self.top_k, self.n_group, self.topk_group, "max", 0.0)
            weights = scores.gather(1, ids)
        return weights * self.scaling, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        return self.experts.finish(out, None if self.shared_experts is None else self.shared_experts(x))


class DeepseekV3Moe(DeepseekV2Moe):
    corrected = True

    @staticmethod
    def routing_method(cfg: Any) -> str:
        return "noaux_tc"  # what transformers' DeepseekV3TopkRouter always runs, whatever topk_method says

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.gate(x).sigmoid()
        ids = group_limited_topk(scores + self.gate.e_score_correction_bias, self.top_k, self.n_group,
                                 self.topk_group, "top2", float("-inf"))
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class DeepseekDecoderLayer(DecoderLayer):
    """MLA, then the sparse block from layer `first_k_dense_replace` on (a dense MLP before it)."""

    def __init__(self, cfg: Any, idx: int, pctx: ParallelContext, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 rotary: RotaryEmbedding, mlp_class: type = MLP) -> None:
        nn.Module.__init__(self)
        interleaved = bool(getattr(cfg, "rope_interleave", True))
        self.self_attn = MlaDecoderAttention(cfg, idx, pctx, rotary, interleaved)
        dense = idx < int(getattr(cfg, "first_k_dense_replace", 0) or 0)
        self.mlp = MLP(cfg, pctx) if dense else mlp_class(cfg, pctx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV2ForCausalLM(MoeWeightsMixin, LlamaForCausalLM):
    mlp_class = DeepseekV2Moe
    layer_class = DeepseekDecoderLayer
    stacked = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    """Only the MLPs merge projections; MLA's q_proj / q_a_proj / kv_a_proj_with_mqa load as they are."""
    block_aliases = {"shared_expert": "shared_experts"}  # llama.cpp's *_shexp tensors (the loader names them singular)
    gguf_experts = True  # `deepseek2` files: gguf_cache.deepseek2_config reads their metadata

    def __init__(self, hf_config: Any, pctx: ParallelContext, max_positions: int) -> None:
        freq = int(getattr(hf_config, "moe_layer_freq", 1) or 1)
        if freq != 1:  # transformers makes every layer past first_k_dense_replace sparse
            raise ValueError(f"moe_layer_freq={freq} is not supported (1 only, as transformers runs it)")
        super().__init__(hf_config, pctx, max_positions)
        self.kv_latent_dim = int(hf_config.kv_lora_rank + hf_config.qk_rope_head_dim)
        """Cached values per token and layer: the compressed KV and the shared rotary key (MLA)."""

    def biases(self, hf_config: Any) -> tuple[bool, bool]:
        return False, False  # MLA builds its own projections

    @property
    def kv_geometry(self) -> tuple[int, int, int]:
        """(layers, 1 shared latent, its size)."""
        return len(self.model.layers), 1, self.kv_latent_dim


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    mlp_class = DeepseekV3Moe
