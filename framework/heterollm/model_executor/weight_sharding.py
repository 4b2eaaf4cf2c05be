"""`--enable_attn_dp_weight_sharding`: under attention data parallelism every rank runs attention
whole, so each would hold every attention weight; with this flag a rank keeps a 1 / dp share of
each attention weight's rows between steps, and the decoder layer all-gathers its attention's weights
over the DP ranks as it starts and drops them again when it ends (a ZeRO-3-style trade of memory for
communication: one all-gather per weight and layer). The hooks sit on the layer, not on its
attention module, because a layer runs its attention in parts (`DecoderAttention.project` /
`attend` / `output`). Every rank runs every layer in every step (an idle rank runs its placeholder
token), so the gathers line up.

A weight is sharded when it is a 2-D parameter of a module named `self_attn` whose rows divide by
dp; the others (norms, biases, a weight of odd size) stay whole. Sharded linear layers keep float
weights (a prepared, packed weight cannot be gathered by rows), so `prepare_linears` skips them."""
from __future__ import annotations

import torch
from torch import nn

from heterollm.model_executor.parallel import ParallelContext


class _GatheredAttention:
    """The hooks of one decoder layer: gather its attention's sharded weights before the layer runs, drop
    them after."""

    def __init__(self, params: list[nn.Parameter], pctx: ParallelContext) -> None:
        self.params, self.pctx = params, pctx
        self.shards: list[torch.Tensor] = []

    def before(self, module: nn.Module, args: tuple) -> None:
        self.shards = [p.data for p in self.params]
        for p in self.params:
            p.data = self.pctx.communicator.all_gather(p.data, dim=0)

    def after(self, module: nn.Module, args: tuple, output: object) -> None:
        for p, shard in zip(self.params, self.shards):
            p.data = shard
        self.shards = []


def shard_attention_weights(model: nn.Module, pctx: ParallelContext) -> int:
    """Keep this DP rank's share of every shardable attention weight of the loaded `model` and hook
    the layer holding each attention module to gather them; returns the bytes a rank no longer holds."""
    dp, rank, saved = pctx.dp_size, pctx.dp_rank, 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] != "self_attn":
            continue
        params = [p for p in module.parameters() if p.dim() == 2 and p.shape[0] % dp == 0 and p.numel()]
        if not params:
            continue
        for p in params:
            rows = p.shape[0] // dp
            saved += (p.shape[0] - rows) * p.shape[1] * p.element_size()
            p.data = p.data.narrow(0, rank * rows, rows).clone()
        for sub in module.modules():
            sub.dp_sharded = True  # prepare_linears leaves these layers float
        hooks = _GatheredAttention(params, pctx)
        layer = model.get_submodule(name.rpartition(".")[0])
        layer.register_forward_pre_hook(hooks.before)
        layer.register_forward_hook(hooks.after)
    return saved
