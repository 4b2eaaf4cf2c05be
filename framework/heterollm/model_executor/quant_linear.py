"""Linear layers of a quantized checkpoint: the parameters they load into, the `QuantizedWeight` a
backend's method receives, and the torch default method.

`attach_quantized` gives each quantized layer the parameters of quant_checkpoint's layout
(`qcodes`, `qscale`, `qzero`, `g_idx`) in place of `weight`, with loaders that shard and merge them
as the layer does its weight. After loading, `prepare_quantized` hands each one's `QuantizedWeight`
to the method the active family registers as `quantized_linear.<format>` (`quantized_linear.gptq`,
`.awq`, `.fp8`): a backend plugs in its own kernels there, with no edit to the core. The default here
(family `torch`) dequantizes to the compute dtype, which costs the memory of a float model."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from heterollm.model_executor import ops
from heterollm.model_executor.layers import MergedColumnParallelLinear, ParallelLMHead, RowParallelLinear
from heterollm.model_executor.linear_method import LinearBase, LinearMethod
from heterollm.model_executor.quant_config import (FORMATS, CheckpointQuant, check_quantization_flag,
                                                    checkpoint_quantization)


@dataclass
class QuantizedWeight:
    """One rank's quantized weight of a linear layer (N, K): what `quantized_linear.<format>` methods
    prepare."""

    format: str
    """"gptq", "awq" or "fp8"."""
    codes: torch.Tensor
    """(N, K) uint8 codes 0..15 (gptq, awq) or float8_e4m3fn values (fp8)."""
    scales: torch.Tensor
    """(N, G) fp32; column j covers input features [j * group_size, (j + 1) * group_size) (the last
    group may be partial), or the groups `g_idx` names."""
    zeros: torch.Tensor | None
    """(N, G) fp32 zero points, w = (code - zero) * scale; None for fp8, w = code * scale."""
    group_size: int
    """Input features per group."""
    g_idx: torch.Tensor | None
    """(K,) int32 group of each input feature (GPTQ act-order); None: contiguous groups."""
    dtype: torch.dtype
    """The model's compute dtype."""

    def group_of_columns(self) -> torch.Tensor:
        """(K,) int64: the scale column of each input feature."""
        k = self.codes.shape[1]
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(k, device=self.codes.device) // self.group_size

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight (N, K), computed in fp32 and cast to `dtype` (default: the compute dtype)."""
        cols = self.group_of_columns()
        w = self.codes.float()
        if self.zeros is not None:
            w = w - self.zeros[:, cols]
        return (w * self.scales[:, cols]).to(dtype or self.dtype)


class QuantizedLinearMethod(LinearMethod):
    """A `quantized_linear.<format>` method: `prepare` receives a `QuantizedWeight` instead of a float
    weight."""


class DequantizedLinear(QuantizedLinearMethod):
    """The default for every format: the float weight in the compute dtype, multiplied with F.linear.
    Correct everywhere, and no smaller than the float model."""

    name = "dequantized"

    def prepare(self, weight: QuantizedWeight) -> torch.Tensor:  # type: ignore[override]
        return weight.dequantize()

    def apply(self, state: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, state, bias)


for _fmt in FORMATS:
    ops.register(f"quantized_linear.{_fmt}")(DequantizedLinear)


def _is_skipped(name: str, quant: CheckpointQuant, parts: list[str]) -> bool:
    return any(s in name or any(s in f"{name.rpartition('.')[0]}.{p}" for p in parts) for s in quant.skip)


def attach_quantized(model: nn.Module, quant: CheckpointQuant, stacked: dict[str, tuple[str, int]]) -> int:
    """Give every linear layer of `model` but the output head (and `quant.skip`) the quantized
    parameters, replacing `weight`; `stacked` maps checkpoint projections to merged layers (q_proj ->
    qkv_proj). Call under the device and dtype the model was built with. Returns the layer count.
    Raises ValueError for a layer whose shape the format cannot split."""
    count = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, LinearBase) or isinstance(layer, ParallelLMHead):
            continue
        parts = [p for p, (merged, _) in stacked.items() if merged == name.rpartition(".")[2]]
        if _is_skipped(name, quant, parts):
            continue
        _attach(name, layer, quant)
        count += 1
    return count


def _groups(name: str, layer: LinearBase, quant: CheckpointQuant) -> tuple[int, int, bool]:
    """(group size, scale columns on this rank, whether the scales are split by rank)."""
    k = layer.weight.shape[1]  # this rank's input features
    tp = layer.pctx.tp_size if isinstance(layer, RowParallelLinear) else 1
    if quant.group_size is None or quant.group_size >= k * tp:
        return k, 1, False  # one group per output row: every rank holds the whole scale column
    if tp > 1 and k % quant.group_size:
        raise ValueError(f"{name}: {k} input features per rank is not a multiple of the {quant.format} group "
                         f"size {quant.group_size}; use another --tp_size")
    if tp > 1 and quant.desc_act:
        raise ValueError(f"{name}: gptq act-order (desc_act) scatters groups across the input features, "
                         "which a row-parallel split does not keep; run it with --tp_size 1")
    return quant.group_size, -(-k // quant.group_size), tp > 1


def _attach(name: str, layer: LinearBase, quant: CheckpointQuant) -> None:
    weight = layer.weight
    n, k = weight.shape
    group, num_groups, split = _groups(name, layer, quant)
    row_loader = weight.weight_loader
    code_dtype = torch.float8_e4m3fn if quant.format == "fp8" else torch.uint8
    params = {"qcodes": (torch.empty(n, k, dtype=code_dtype), row_loader),
              "qscale": (torch.empty(n, num_groups, dtype=torch.float32), row_loader if split or not
                         isinstance(layer, RowParallelLinear) else _copy_loader)}
    if quant.format != "fp8":
        params["qzero"] = (torch.empty(n, num_groups, dtype=torch.float32), params["qscale"][1])
    if quant.desc_act:
        params["g_idx"] = (torch.empty(k, dtype=torch.int32), _replicated_loader(layer))
    for pname, (tensor, loader) in params.items():
        param = nn.Parameter(tensor, requires_grad=False)
        param.weight_loader = loader
        if isinstance(layer, MergedColumnParallelLinear):
            param.num_shards = weight.num_shards
        layer.register_parameter(pname, param)
    layer.register_parameter("weight", None)
    layer.quant = _Layout(quant.format, group, weight.dtype)


@dataclass
class _Layout:
    format: str
    group_size: int
    dtype: torch.dtype


def _copy_loader(param: nn.Parameter, loaded: torch.Tensor, *_: Any) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def _replicated_loader(layer: LinearBase):
    """g_idx: every rank and every merged part holds the same one (GPTQ orders the input features by
    the input's statistics, which q/k/v and gate/up share); parts that differ are refused."""
    seen: set[int] = set()

    def load(param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        if seen and not torch.equal(param.data, loaded.to(param.dtype)):
            raise ValueError(f"the merged projections of {type(layer).__name__} have different g_idx "
                             "(act-order permutations); heterollm merges them into one layer")
        _copy_loader(param, loaded)
        seen.add(shard)
    return load


def quantized_weight(layer: LinearBase) -> QuantizedWeight | None:
    """The loaded quantized weight of `layer`, or None for a float layer."""
    layout: _Layout | None = getattr(layer, "quant", None)
    if layout is None:
        return None
    g_idx = getattr(layer, "g_idx", None)
    zeros = getattr(layer, "qzero", None)
    return QuantizedWeight(layout.format, layer.qcodes.data, layer.qscale.data,
                           None if zeros is None else zeros.data, layout.group_size,
                           None if g_idx is None else g_idx.data, layout.dtype)


def release_quantized(layer: LinearBase) -> None:
    """Drop the loaded tensors once the method prepared its own state."""
    for pname in ("qcodes", "qscale", "qzero", "g_idx"):
        param = getattr(layer, pname, None)
        if param is not None:
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def prepare_quantized(model: nn.Module, method: QuantizedLinearMethod) -> int:
    """Move every quantized layer of `model` onto `method` (the active `quantized_linear.<format>`),
    releasing the loaded tensors; returns how many it prepared."""
    count = 0
    for layer in model.modules():
        weight = quantized_weight(layer) if isinstance(layer, LinearBase) else None
        if weight is None:
            continue
        layer.state = method.prepare(weight)
        layer.method = method
        release_quantized(layer)
        count += 1
    return count


def checkpoint_methods(flag: str | None, hf_config: Any) -> tuple[CheckpointQuant | None, QuantizedLinearMethod | None]:
    """The checkpoint's format and the active family's `quantized_linear.<format>` method (None, None for
    a float checkpoint). Raises ValueError naming what is wrong: a format heterollm cannot run, a
    `--quantization` that conflicts with it, a backend without the method."""
    try:
        quant = checkpoint_quantization(hf_config)
    except ValueError as exc:
        raise ValueError(f"--model: its config.json quantization_config: {exc}") from None
    check_quantization_flag(flag, quant)
    if quant is None:
        return None, None
    key = f"quantized_linear.{quant.format}"
    if not ops.has(key):
        raise ValueError(f"--model: a {quant.describe()} checkpoint, and the selected backend has no {key} "
                         f"method")
    return quant, ops.get(key)()
