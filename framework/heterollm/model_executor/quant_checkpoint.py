"""Read a quantized checkpoint's linear layers into one layout, whatever the format.

Each quantized module `<m>` comes out as
- `<m>.qcodes` (N, K): 4-bit codes 0..15 as uint8 (GPTQ, AWQ) or the float8_e4m3fn weight (FP8);
- `<m>.qscale` (N, G) fp32: column j's scale covers input features [j * group, (j + 1) * group);
- `<m>.qzero` (N, G) fp32 zero points (GPTQ, AWQ): w = (code - zero) * scale; FP8: w = code * scale;
- `<m>.g_idx` (K,) int32 (GPTQ act-order only): the group of each input feature.
Every tensor keeps the (N, K) orientation of a float weight, so a model's loaders shard and merge
them exactly as they do `<m>.weight` (rows for column-parallel and merged q/k/v, columns and
groups for row-parallel). The packings, from each format's published writer:
- GPTQ (AutoGPTQ / gptqmodel): qweight (K / 8, N) int32, input feature 8i + j in bits 4j..4j+3 of
  row i; qzeros (G, N / 8) int32, output feature 8i + j in bits 4j of column i, storing zero - 1 in
  the `gptq` format (not in `gptq_v2`); scales (G, N); g_idx (K,).
- AWQ (AutoAWQ gemm): qweight (K, N / 8) int32 and qzeros (G, N / 8), eight output features per
  int32 in the interleaved order 0, 2, 4, 6, 1, 3, 5, 7 (nibble i holds feature order[i]); scales (G, N).
- FP8: weight (N, K) float8_e4m3fn; weight_scale (a scalar, per tensor) or weight_scale_inv
  (ceil(N / rows), ceil(K / cols)) per block; w = weight * scale either way."""
from __future__ import annotations

from collections.abc import Iterator

import torch

from heterollm.config import ConfigError
from heterollm.model_executor.checkpoint_slice import materialize
from heterollm.model_executor.quant_config import CheckpointQuant

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
_AWQ_COLUMN_NIBBLE = [0, 4, 1, 5, 2, 6, 3, 7]  # output feature c of an int32 sits in nibble [c]
_PIECES = {"gptq": {"qweight", "qzeros", "scales"}, "awq": {"qweight", "qzeros", "scales"}}


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """(R, C) int32 -> (8R, C) uint8: eight features per int32 down the first dimension (GPTQ qweight)."""
    nibbles = (packed.unsqueeze(1) >> _SHIFTS.view(1, 8, 1)) & 15
    return nibbles.reshape(-1, packed.shape[1]).to(torch.uint8)


def unpack_columns(packed: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    """(R, C) int32 -> (R, 8C) uint8: eight features per int32 along the second dimension, feature c
    of each int32 in nibble order[c] (sequential when None)."""
    nibbles = (packed.unsqueeze(-1) >> _SHIFTS) & 15
    if order is not None:
        nibbles = nibbles[..., order]
    return nibbles.reshape(packed.shape[0], -1).to(torch.uint8)


def _gptq(name: str, t: dict[str, torch.Tensor], quant: CheckpointQuant) -> dict[str, torch.Tensor]:
    codes = unpack_rows(t["qweight"]).t()
    k = codes.shape[1]
    zeros = unpack_columns(t["qzeros"]).float() + quant.zero_offset
    out = {"qcodes": codes.contiguous(), "qscale": t["scales"].float().t().contiguous(),
           "qzero": zeros.t().contiguous()}
    g_idx = t.get("g_idx")
    group = quant.group_size or k
    if quant.desc_act:
        out["g_idx"] = (g_idx if g_idx is not None else torch.arange(k) // group).to(torch.int32)
    elif g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group):
        raise ConfigError(f"--model: {name}.g_idx is not sequential although quantization_config has "
                          f"desc_act false; the checkpoint is inconsistent")
    return out


def _awq(name: str, t: dict[str, torch.Tensor], quant: CheckpointQuant) -> dict[str, torch.Tensor]:
    codes = unpack_columns(t["qweight"], _AWQ_COLUMN_NIBBLE).t()
    zeros = unpack_columns(t["qzeros"], _AWQ_COLUMN_NIBBLE).float()
    return {"qcodes": codes.contiguous(), "qscale": t["scales"].float().t().contiguous(),
            "qzero": zeros.t().contiguous()}


def _fp8(name: str, t: dict[str, torch.Tensor], quant: CheckpointQuant) -> dict[str, torch.Tensor]:
    weight = t["weight"]
    n, k = weight.shape
    if quant.block_rows is None:
        scale = t["weight_scale"].float()
        if scale.numel() != 1:
            raise ConfigError(f"--model: {name}.weight_scale has shape {tuple(scale.shape)}; a per-tensor "
                              f"FP8 checkpoint has one scale per weight")
        return {"qcodes": weight, "qscale": scale.reshape(1, 1).expand(n, 1).contiguous()}
    scale = t["weight_scale_inv"].float()
    rows, cols = -(-n // quant.block_rows), -(-k // quant.group_size)
    if tuple(scale.shape) != (rows, cols):
        raise ConfigError(f"--model: {name}.weight_scale_inv has shape {tuple(scale.shape)}, expected "
                          f"{(rows, cols)} for blocks of {quant.block_rows}x{quant.group_size}")
    return {"qcodes": weight, "qscale": scale.repeat_interleave(quant.block_rows, 0)[:n].contiguous()}


_UNPACK = {"gptq": _gptq, "awq": _awq, "fp8": _fp8}


def _piece_of(name: str, tensor: torch.Tensor, quant: CheckpointQuant) -> tuple[str, str] | None:
    """(module, piece) when `name` is part of a quantized module, else None (a float tensor)."""
    module, _, kind = name.rpartition(".")
    if quant.format == "fp8":
        if kind in ("weight_scale", "weight_scale_inv") or (kind == "weight" and tensor.dtype == torch.float8_e4m3fn):
            return module, kind
        return None
    return (module, kind) if kind in ("qweight", "qzeros", "scales", "g_idx") else None


def _complete(pieces: dict[str, torch.Tensor], quant: CheckpointQuant) -> bool:
    if quant.format == "fp8":
        return "weight" in pieces and ("weight_scale" in pieces or "weight_scale_inv" in pieces)
    needed = _PIECES[quant.format] | ({"g_idx"} if quant.desc_act else set())
    return needed <= pieces.keys()


def unpack_quantized(weights: Iterator[tuple[str, torch.Tensor]],
                     quant: CheckpointQuant) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) stream with every quantized module's pieces gathered (in any
    order, across files) and replaced by the layout above; float tensors pass through."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        piece = _piece_of(name, tensor, quant)
        if piece is None:
            yield name, tensor
            continue
        module, kind = piece
        pieces = pending.setdefault(module, {})
        pieces[kind] = materialize(tensor)  # unpacking reorders whole tensors; pieces outlive their file
        if _complete(pieces, quant):
            for part, value in _UNPACK[quant.format](module, pending.pop(module), quant).items():
                yield f"{module}.{part}", value
    for module, pieces in pending.items():
        if set(pieces) == {"g_idx"} and not quant.desc_act:  # arrived after its module was read
            g_idx = pieces["g_idx"].long()
            if torch.equal(g_idx, torch.arange(len(g_idx)) // (quant.group_size or len(g_idx))):
                continue
            raise ConfigError(f"--model: {module}.g_idx is not sequential although quantization_config has "
                              f"desc_act false; the checkpoint is inconsistent")
        raise ConfigError(f"--model: quantized module {module} is incomplete in the checkpoint (has "
                          f"{', '.join(sorted(pieces))}; {quant.describe()})")
