"""Mixture-of-experts layers the MoE families share: the experts' weights stacked on each rank, the
router, the sparse block that replaces the dense MLP, and the checkpoint-name mapping that loads
experts through the parameters' weight loaders.

Tensor parallelism shards every expert's intermediate dimension, as the dense MLP does: gate and up
rows (column-parallel), down columns (row-parallel). The block sums its routed experts (the
`fused_moe` op, which a backend may replace) and its shared expert on each rank, then all-reduces
once. The router and the shared expert's gate are replicated. Under `--quantization` each expert's
weights go through the flag's linear method (`prepare_experts`), as every linear layer's do."""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from heterollm.model_executor import ops
from heterollm.model_executor.eplb import ExpertPlacement
from heterollm.model_executor.layers import MergedColumnParallelLinear, RowParallelLinear, _copy
from heterollm.model_executor.parallel import ParallelContext


class FusedMoE(nn.Module):
    """`num_experts` SiLU-gated experts: w13 (local experts, 2 * inter / tp, hidden), each expert's gate
    rows then its up rows; w2 (local experts, hidden, inter / tp).

    Tensor parallelism (ep_size 1): every rank holds every expert, a 1 / tp slice of each one's
    intermediate dimension, and returns a partial sum. Expert parallelism (`pctx.ep_size` = tp): rank r
    holds experts r * E / ep .. (r + 1) * E / ep - 1 whole; `forward` dispatches each token's choices to
    their experts' ranks through the Communicator's all_to_all (each rank sends the choices of its own
    1 / ep share of the step's tokens), runs the experts there, combines the weighted rows back with a
    second all_to_all, and all-gathers the shares: every rank then holds the complete routed output.
    Under attention data parallelism (`pctx.dp_size` > 1, ep = dp) each rank's tokens are its own
    requests': it dispatches all of them and keeps what comes back (no all-gather). `finish` adds the shared experts' tensor-parallel partial sum either way. With EPLB (`pctx.
    redundant_experts`) a rank has E / ep + R slots whose experts `placement` says; choices go to a
    replica of their expert, and `rebalance` re-places the experts between steps (eplb.py).

    `weight_loader(param, tensor, expert, shard)` takes one expert's checkpoint tensor (gate or up
    (inter, hidden): shard 0 / 1 of w13; down (hidden, inter): w2, shard 0), or, with expert None,
    all experts stacked along a first dimension (transformers' fused `gate_up_proj` split into its
    gate and up halves, or `down_proj`). It keeps this rank's slice (its experts, its intermediate
    rows), so a lazy checkpoint window (`--load_choices default_v1`) reads only that;
    `param.local_slots(e)` maps a checkpoint expert id to this rank's slots holding it (none: another
    rank's; with EPLB's redundant slots, possibly several).
    `param.num_shards` counts the (local expert, shard) parts a complete parameter receives."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, pctx: ParallelContext) -> None:
        super().__init__()
        self.pctx = pctx
        self.num_experts = num_experts
        self.ep = pctx.ep_size > 1
        if self.ep and num_experts % pctx.ep_size:
            raise ValueError(f"--ep_size={pctx.ep_size} does not divide the {num_experts} routed experts")
        self.placement = (ExpertPlacement(num_experts, pctx.ep_size, pctx.redundant_experts)
                          if self.ep and pctx.redundant_experts is not None else None)
        """EPLB: which logical expert each rank's slot holds, and the load counters (eplb.py)."""
        self.num_local = self.placement.slots if self.placement is not None else num_experts // pctx.ep_size
        """Expert slots on this rank."""
        self.first = pctx.ep_rank * (num_experts // pctx.ep_size)
        """Without EPLB: this rank's first expert (its experts are first .. first + num_local - 1)."""
        self.inter = intermediate if self.ep else pctx.shard(intermediate, "moe intermediate size")
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * self.inter, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local, hidden, self.inter), requires_grad=False)
        self.w13.weight_loader, self.w13.num_shards = self._load_w13, 2 * self.num_local
        self.w2.weight_loader, self.w2.num_shards = self._load_w2, self.num_local
        for param in (self.w13, self.w2):
            param.local_slots, param.num_experts = self.local_slots, num_experts

    def local_slots(self, expert: int) -> list[int]:
        """This rank's slots holding checkpoint expert `expert` (none: another rank's; several: EPLB's
        replicas)."""
        if self.placement is not None:
            return self.placement.local_slots(self.pctx.ep_rank, expert)
        local = expert - self.first
        return [local] if 0 <= local < self.num_local else []

    def _slot_experts(self) -> torch.Tensor:
        """The checkpoint expert of each of this rank's slots."""
        if self.placement is not None:
            rank = self.pctx.ep_rank
            return self.placement.phys2log[rank * self.num_local:(rank + 1) * self.num_local]
        return torch.arange(self.first, self.first + self.num_local)

    def _rank_slice(self, loaded: Any, dim: int) -> Any:
        full = self.inter * (1 if self.ep else self.pctx.tp_size)
        if loaded.shape[dim] != full:
            raise ValueError(f"shape mismatch: experts' intermediate size {full}, checkpoint {tuple(loaded.shape)}")
        return loaded if self.ep else loaded.narrow(dim, self.pctx.tp_rank * self.inter, self.inter)

    def _target(self, param: nn.Parameter, expert: int | None) -> torch.Tensor:
        return param.data if expert is None else param.data[expert]

    def _experts_of(self, loaded: Any, expert: int | None) -> Any:
        """All experts stacked (expert None): this rank's range of them."""
        if expert is not None:
            return loaded
        if loaded.shape[0] != self.num_experts:
            raise ValueError(f"shape mismatch: {self.num_experts} experts, checkpoint {tuple(loaded.shape)}")
        if self.placement is not None:
            return loaded[self._slot_experts()]
        return loaded.narrow(0, self.first, self.num_local)

    def _load_w13(self, param: nn.Parameter, loaded: Any, expert: int | None, shard: int) -> None:
        rows = self._rank_slice(self._experts_of(loaded, expert), 0 if expert is not None else 1)
        target = self._target(param, expert)
        _copy(target.narrow(-2, shard * self.inter, self.inter), rows)

    def _load_w2(self, param: nn.Parameter, loaded: Any, expert: int | None, shard: int = 0) -> None:
        _copy(self._target(param, expert), self._rank_slice(self._experts_of(loaded, expert), -1))

    prepared_experts = True
    """`model_bytes` counts `state`."""
    method: Any = None
    """The linear method `--quantization` selected, once `prepare` moved the experts onto it."""

    def prepare(self, method: Any) -> None:
        """Each expert's gate/up and down weights through `method.prepare` (int8 / int4 codes and scales
        for wint8 / wint4), as `prepare_linears` does for a linear layer; the float copies are released."""
        self.states13 = [method.prepare(w.contiguous()) for w in self.w13.data]
        self.states2 = [method.prepare(w.contiguous()) for w in self.w2.data]
        self.method = method
        for param in (self.w13, self.w2):
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    @property
    def state(self) -> list[Any]:
        """The prepared states (what `model_bytes` counts); empty while the experts are float."""
        return self.states13 + self.states2 if self.method is not None else []

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' output: this rank's partial sum under tensor parallelism (`finish` reduces
        it), the complete sum under expert parallelism."""
        if self.ep:
            return self._dispatch_combine(x, topk_weights, topk_ids)
        return self._local(x, topk_weights, topk_ids)

    def _local(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.method is not None:
            return ops.get("fused_moe")(x, self.states13, self.states2, topk_weights, topk_ids, self.method)
        return ops.get("fused_moe")(x, self.w13, self.w2, topk_weights, topk_ids)

    def _dispatch_combine(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        ep, rank = self.pctx.ep_size, self.pctx.ep_rank
        if self.placement is not None:  # logical experts -> the physical slots serving them (counted)
            topk_ids = self.placement.to_physical(topk_ids)
        tokens = x.shape[0]
        if self.pctx.dp_size > 1:  # attention DP: the tokens are this rank's own; it dispatches them all
            share, lo, hi = tokens, 0, tokens
        else:  # every rank holds the step's tokens; this one dispatches tokens lo..hi of them
            share = -(-tokens // ep)
            lo, hi = min(rank * share, tokens), min((rank + 1) * share, tokens)
        ids = topk_ids[lo:hi].reshape(-1)
        owner = torch.div(ids, self.num_local, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)
        token = torch.div(order, topk_ids.shape[1], rounding_mode="floor")  # the share's token of each row
        send = torch.bincount(owner, minlength=ep).tolist()
        # each choice travels as one row of bytes: its token's hidden state, then its expert (local to
        # the owner) and its weight as two fp32 values
        choice = torch.stack([(ids - owner * self.num_local)[order].to(torch.float32),
                              topk_weights[lo:hi].reshape(-1)[order].to(torch.float32)], dim=1)
        packed = torch.cat([x[lo:hi][token].view(torch.uint8), choice.view(torch.uint8)], dim=1)
        got, received = self.pctx.all_to_all(packed, send)
        width = x.shape[1] * x.element_size()
        rows = got[:, :width].contiguous().view(x.dtype)
        choice = got[:, width:].contiguous().view(torch.float32)
        weighted = self._local(rows, choice[:, 1:].to(topk_weights.dtype), choice[:, :1].long())
        # each row returns to its sender, in its order (the counts are known: no exchange)
        back, _ = self.pctx.all_to_all(weighted, received, send)
        out = x.new_zeros(share, x.shape[1])
        out.index_add_(0, token, back)
        return out if self.pctx.dp_size > 1 else self.pctx.all_gather(out, dim=0)[:tokens]

    def rebalance(self) -> int:
        """EPLB: re-place the experts from the load counted since the last time (rank 0's plan, so all
        ranks agree) and move the weights of every slot whose expert changed, between two steps.
        Returns the slots that changed."""
        placement, rank, slots = self.placement, self.pctx.ep_rank, self.num_local
        # attention DP: each rank counted its own requests' choices; the plan balances them all
        new = placement.plan(self.pctx.communicator.all_reduce(placement.window.clone())
                             if self.pctx.dp_size > 1 else None)
        if self.pctx.communicator is not None:
            new = self.pctx.communicator.broadcast(new, src=0)
        moves = placement.moves(new)
        sends = sorted((m for m in moves if m.src // slots == rank and m.dst // slots != rank), key=lambda m: m.dst)
        counts = [sum(1 for m in sends if m.dst // slots == r) for r in range(self.pctx.ep_size)]
        src = torch.tensor([m.src % slots for m in sends], dtype=torch.long)
        got13, _ = self.pctx.all_to_all(self.w13.data[src].flatten(1), counts)
        got2, _ = self.pctx.all_to_all(self.w2.data[src].flatten(1), counts)
        w13, w2 = self.w13.data.clone(), self.w2.data.clone()
        for m in moves:  # a copy within the rank
            if m.dst // slots == rank and m.src // slots == rank:
                w13[m.dst % slots], w2[m.dst % slots] = self.w13.data[m.src % slots], self.w2.data[m.src % slots]
        received = sorted((m for m in moves if m.dst // slots == rank and m.src // slots != rank),
                          key=lambda m: (m.src // slots, m.dst))  # senders' order, rank by rank
        for i, m in enumerate(received):
            w13[m.dst % slots] = got13[i].view(w13.shape[1:])
            w2[m.dst % slots] = got2[i].view(w2.shape[1:])
        self.w13.data, self.w2.data = w13, w2
        placement.commit(new)
        return len(moves)

    def finish(self, routed: torch.Tensor, partial: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output: `routed` (this layer's forward) plus `partial`, a tensor-parallel partial
        sum (the shared experts), reduced across ranks once."""
        if self.ep:
            return routed if partial is None else routed + self.pctx.all_reduce(partial)
        return self.pctx.all_reduce(routed if partial is None else routed + partial)


def prepare_experts(model: nn.Module, method: Any) -> int:
    """`--quantization` on the experts: every FusedMoE of `model` onto `method` (the linear method the
    flag selected); returns how many it prepared."""
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    for layer in layers:
        layer.prepare(method)
    return len(layers)


class Router(nn.Module):
    """A replicated (out, hidden) projection without bias, in plain F.linear as transformers computes
    it: the router's logits, or the shared expert's gate."""

    def __init__(self, hidden: int, out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out, hidden), requires_grad=False)
        self.weight.weight_loader = _copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool,
                 weights_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids), each (tokens, top_k): softmax over all experts in fp32, the top k, divided
    by their sum when `renormalize` (Mixtral always; Qwen-MoE with norm_topk_prob), then cast to
    `weights_dtype` (None: kept in fp32, as Mixtral's router leaves them)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if weights_dtype is None else weights.to(weights_dtype)), ids


def group_limited_topk(scores: torch.Tensor, top_k: int, num_groups: int, topk_group: int, group_score: str,
                       fill: float) -> torch.Tensor:
    """Expert ids (tokens, top_k) chosen only among the `topk_group` best of `num_groups` equal groups of
    experts (DeepSeek's node-limited routing): a group scores its best expert ("max", DeepSeek-V2's
    group_limited_greedy) or the sum of its best two ("top2", DeepSeek-V3); the other groups' experts
    score `fill` before the top k is taken."""
    tokens, experts = scores.shape
    if experts % num_groups:
        raise ValueError(f"n_group={num_groups} does not divide the {experts} routed experts")
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    per_group = grouped.max(dim=-1).values if group_score == "max" else grouped.topk(2, dim=-1).values.sum(dim=-1)
    keep = torch.zeros_like(per_group, dtype=torch.bool)
    keep.scatter_(1, per_group.topk(topk_group, dim=-1, sorted=False).indices, True)
    masked = scores.masked_fill(~keep.repeat_interleave(experts // num_groups, dim=1), fill)
    return masked.topk(top_k, dim=-1, sorted=False).indices


def routed_top_k(cfg: Any, num_experts: int) -> int:
    """`num_experts_per_tok`, checked against the experts; and the SiLU-gated experts every MoE block
    here computes."""
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (silu only)")
    top_k = int(cfg.num_experts_per_tok)
    if not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and the {num_experts} experts")
    return top_k


class SparseMoeBlock(nn.Module):
    """Router, routed experts and (Qwen2-MoE) a shared expert scaled by a sigmoid gate, in place of the
    dense MLP. Subclasses set how the config names its sizes and how routing weights are formed."""

    renormalize_always = False
    """Mixtral: the top-k weights are always divided by their sum; Qwen-MoE: when norm_topk_prob."""
    fp32_weights = False
    """Mixtral keeps the routing weights in fp32; Qwen-MoE casts them to the activations' dtype."""

    def __init__(self, cfg: Any, pctx: ParallelContext) -> None:
        super().__init__()
        self.pctx = pctx
        num_experts = self.num_experts(cfg)
        self.top_k = routed_top_k(cfg, num_experts)
        self.renormalize = self.renormalize_always or bool(getattr(cfg, "norm_topk_prob", False))
        self.gate = Router(cfg.hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, cfg.hidden_size, self.expert_intermediate(cfg), pctx)
        shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
        self.shared_expert = SharedExpert(cfg.hidden_size, shared, pctx) if shared else None
        self.shared_expert_gate = Router(cfg.hidden_size, 1) if shared else None

    @staticmethod
    def num_experts(cfg: Any) -> int:
        return int(cfg.num_experts)

    @staticmethod
    def expert_intermediate(cfg: Any) -> int:
        return int(cfg.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = softmax_topk(self.gate(x), self.top_k, self.renormalize,
                                    None if self.fp32_weights else x.dtype)
        out = self.experts(x, weights, ids)
        if self.shared_expert is None:
            return self.experts.finish(out)
        # the gate is per token and replicated: applied to the partial sum before the reduce
        return self.experts.finish(out, torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x))


class SharedExpert(nn.Module):
    """A dense SiLU MLP every token goes through; its down projection is left unreduced, so the block
    reduces routed and shared experts together."""

    def __init__(self, hidden: int, intermediate: int, pctx: ParallelContext) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, False, pctx)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, pctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.matmul(ops.get("silu_and_mul")(*self.gate_up_proj(x)), None)


def is_sparse_layer(cfg: Any, idx: int) -> bool:
    """Qwen2-MoE / Qwen3-MoE: layer `idx` is sparse unless `mlp_only_layers` lists it, there are no
    experts, or it falls between `decoder_sparse_step` strides (transformers' own test)."""
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return (idx not in (getattr(cfg, "mlp_only_layers", None) or []) and int(getattr(cfg, "num_experts", 0)) > 0
            and (idx + 1) % step == 0)


_PER_EXPERT = re.compile(r"^(?P<block>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
_FUSED = re.compile(r"^(?P<block>.+)\.experts\.(?P<proj>gate_up_proj|gate_proj|up_proj|down_proj)$")
"""All experts stacked in one tensor: transformers' (experts, 2 * inter, hidden) gate_up_proj, or
gate_proj / up_proj (experts, inter, hidden) apart (a GGUF file's ffn_gate_exps / ffn_up_exps)."""


class MoeWeightsMixin:
    """`load_weights` for a LlamaForCausalLM subclass whose sparse blocks hold FusedMoE experts: expert
    tensors go to the stacked parameters (per-expert names as `save_pretrained` writes them, or
    transformers' fused 3-D `gate_up_proj` / `down_proj`); everything else to the base loader."""

    expert_projections = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}
    """Per-expert checkpoint projection -> (stacked parameter, shard)."""
    block_aliases: dict[str, str] = {}
    """Checkpoint module names -> this model's (Mixtral's `block_sparse_moe` -> `mlp`)."""

    def launch_refused(self, flag: str | None, checkpoint_quant: Any, gguf_file: Any) -> str | None:
        """Why this model cannot launch as asked (None: it can): a quantized checkpoint's packed experts,
        and a GGUF file's expert tensors, have no loader yet. (`--quantization` is fine: the runner
        prepares the experts with the flag's linear method, `prepare_experts`.)"""
        if not any(isinstance(m, FusedMoE) for m in self.modules()):  # type: ignore[attr-defined]
            return None
        arch = type(self).__name__
        if checkpoint_quant is not None:
            return (f"--model: a {checkpoint_quant.describe()} checkpoint of {arch}: quantized "
                    f"mixture-of-experts weights are not supported yet; use a float checkpoint (and "
                    f"--quantization to quantize it on load)")
        if gguf_file is not None and not self.gguf_experts:
            return (f"--model: {gguf_file}: GGUF files of {arch} are not loaded (transformers reads no GGUF "
                    f"config for it); use the Hugging Face safetensors folder")
        return None

    gguf_experts = False
    """Whether this family loads from GGUF (Qwen2-MoE, Qwen3-MoE: the architectures transformers reads a
    GGUF config for)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters(remove_duplicate=False))  # type: ignore[attr-defined]
        parts: dict[str, set[tuple[int, int]]] = {}

        def others() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                for old, new in self.block_aliases.items():
                    name = name.replace(f".{old}.", f".{new}.")
                target = self._expert_target(name, tensor, params, parts)
                if not target:
                    yield name, tensor

        loaded = super().load_weights(others())  # type: ignore[misc]
        return loaded | {n for n, got in parts.items() if len(got) == params[n].num_shards}

    def _expert_target(self, name: str, tensor: Any, params: dict[str, nn.Parameter],
                       parts: dict[str, set[tuple[int, int]]]) -> bool:
        """Load `name` if it is an expert tensor; False if it is not one."""
        if m := _PER_EXPERT.match(name):
            if m["proj"] not in self.expert_projections:
                raise KeyError(name)
            stacked, shard = self.expert_projections[m["proj"]]
            expert = int(m["expert"])
            todo = [(expert, shard, tensor)]
        elif m := _FUSED.match(name):
            stacked = "w2" if m["proj"] == "down_proj" else "w13"
            if m["proj"] == "gate_up_proj":
                todo = [(None, shard, half) for shard, half in enumerate(tensor.chunk(2, dim=1))]
            else:
                todo = [(None, 1 if m["proj"] == "up_proj" else 0, tensor)]
        else:
            return False
        target = f"{m['block']}.experts.{stacked}"
        param = params.get(target)
        if param is None:
            raise KeyError(name)
        for expert, shard, part in todo:
            if expert is not None and expert >= param.num_experts:
                raise KeyError(name)
            if expert is None:  # all experts stacked: the loader keeps this rank's
                param.weight_loader(param, part.to(param.dtype), None, shard)
                parts.setdefault(target, set()).update((e, shard) for e in range(param.shape[0]))
                continue
            for local in param.local_slots(expert):  # none: another rank's expert (--ep_size)
                param.weight_loader(param, part.to(param.dtype), local, shard)
                parts.setdefault(target, set()).add((local, shard))
        return True
