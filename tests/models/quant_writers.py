"""Tiny quantized checkpoints written the way each format's own tools write them, from the formats'
published packings (not from heterollm's reader), plus the float reference model whose weights are
their dequantized values.

- GPTQ (AutoGPTQ `gptq`, gptqmodel `gptq_v2`): qweight (K / 8, N) int32 with input feature 8i + j in
  bits 4j of row i; qzeros (G, N / 8) int32 with output feature 8i + j in bits 4j of column i,
  storing zero - 1 (`gptq`) or zero (`gptq_v2`); scales (G, N) fp16; g_idx (K,) int32. Act-order
  (desc_act) quantizes the input features in a permuted order: g_idx[perm[i]] = i // group.
- AWQ (AutoAWQ gemm): qweight (K, N / 8) and qzeros (G, N / 8) int32, nibble i of each int32 holding
  output feature order[i] of its eight, order = 0, 2, 4, 6, 1, 3, 5, 7; scales (G, N) fp16.
- FP8: weight (N, K) float8_e4m3fn with weight_scale (per tensor, scalar fp32) or weight_scale_inv
  (ceil(N / rows), ceil(K / cols)) fp32 per block; the value is weight * scale."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from helpers import build_tiny_model

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# projections fed the same input share GPTQ's act-order permutation (it comes from that input's Hessian)
INPUT_SITE = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "o_proj": "attn_out",
              "gate_proj": "mlp_in", "up_proj": "mlp_in", "down_proj": "mlp_out"}


def _int32(values: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns < 2**32 -> int32 with the same bits."""
    return torch.from_numpy(values.numpy().astype(np.uint32).view(np.int32))


def pack_along_rows(codes: torch.Tensor) -> torch.Tensor:
    """(8R, C) 0..15 -> (R, C) int32: feature 8i + j in bits 4j of row i."""
    r = codes.shape[0] // 8
    grouped = codes.long().view(r, 8, -1)
    return _int32(sum(grouped[:, j] << (4 * j) for j in range(8)))


def pack_along_columns(codes: torch.Tensor, order: list[int]) -> torch.Tensor:
    """(R, 8C) 0..15 -> (R, C) int32: nibble i of each int32 holds feature order[i] of its eight."""
    grouped = codes.long().view(codes.shape[0], -1, 8)
    return _int32(sum(grouped[..., order[i]] << (4 * i) for i in range(8)))


def quantize_int4(w: torch.Tensor, g_idx: torch.Tensor, num_groups: int, sym: bool,
                  min_zero: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min/max 4-bit quantization per (row, group): (codes (N, K), scales (G, N) fp16, zeros (G, N),
    dequantized (N, K) fp32)."""
    n, k = w.shape
    scales, zeros = torch.empty(num_groups, n, dtype=torch.float16), torch.empty(num_groups, n, dtype=torch.long)
    codes = torch.empty(n, k, dtype=torch.long)
    for j in range(num_groups):
        cols = (g_idx == j).nonzero().squeeze(1)
        block = w[:, cols]
        if sym:
            scale = (block.abs().amax(1) / 7.5).clamp(min=1e-6).half()
            zero = torch.full((n,), 8)
        else:
            lo, hi = block.amin(1).clamp(max=0), block.amax(1).clamp(min=0)
            scale = ((hi - lo) / 15).clamp(min=1e-6).half()
            zero = (-lo / scale.float()).round().long().clamp(min_zero, 15)
        scales[j], zeros[j] = scale, zero
        codes[:, cols] = (block / scale.float()[:, None] + zero[:, None]).round().clamp(0, 15).long()
    deq = (codes - zeros.t()[:, g_idx]).float() * scales.float().t()[:, g_idx]
    return codes, scales, zeros, deq


def gptq_tensors(w: torch.Tensor, group: int, perm: torch.Tensor | None, v2: bool, sym: bool):
    n, k = w.shape
    order = perm if perm is not None else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.long)
    g_idx[order] = torch.arange(k) // group
    num_groups = -(-k // group)
    codes, scales, zeros, deq = quantize_int4(w, g_idx, num_groups, sym, min_zero=0 if v2 else 1)
    stored_zeros = zeros if v2 else zeros - 1
    return {"qweight": pack_along_rows(codes.t()), "qzeros": pack_along_columns(stored_zeros, list(range(8))),
            "scales": scales, "g_idx": g_idx.to(torch.int32)}, deq


def awq_tensors(w: torch.Tensor, group: int):
    n, k = w.shape
    g_idx = torch.arange(k) // group
    codes, scales, zeros, deq = quantize_int4(w, g_idx, k // group, sym=False, min_zero=0)
    return {"qweight": pack_along_columns(codes.t(), AWQ_ORDER), "qzeros": pack_along_columns(zeros, AWQ_ORDER),
            "scales": scales}, deq


def fp8_tensors(w: torch.Tensor, block: list[int] | None):
    n, k = w.shape
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    if block is None:
        scale = w.abs().amax() / fp8_max
        q = (w / scale).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale": scale.float()}, q.float() * scale
    rows, cols = block
    nb, kb = -(-n // rows), -(-k // cols)
    scale = torch.empty(nb, kb)
    for i in range(nb):
        for j in range(kb):
            scale[i, j] = w[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols].abs().amax() / fp8_max
    full = scale.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
    q = (w / full).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scale}, q.float() * full


def build_quantized(root: Path, quant_config: dict, family: str = "llama", seed: int = 0,
                    site_perms: bool = True, **overrides) -> tuple[Path, Path]:
    """(quantized checkpoint folder, float reference folder holding the dequantized weights)."""
    float_dir = build_tiny_model(root / "float", family, seed=seed, **overrides)
    state = load_file(str(float_dir / "model.safetensors"))
    method = quant_config["quant_method"]
    group = quant_config.get("group_size", -1)
    torch.manual_seed(seed + 1)
    perms: dict[tuple[str, str], torch.Tensor] = {}
    packed, reference = {}, {}
    for name, w in state.items():
        module, _, kind = name.rpartition(".")
        proj = module.rpartition(".")[2]
        if proj not in PROJECTIONS or kind != "weight":
            packed[name] = reference[name] = w
            continue
        k = w.shape[1]
        if method == "gptq":
            perm = None
            if quant_config.get("desc_act"):
                site = (module.rpartition(".")[0].rpartition(".")[0], INPUT_SITE[proj] if site_perms else proj)
                perm = perms.setdefault(site, torch.randperm(k))
            v2 = quant_config.get("checkpoint_format") == "gptq_v2"
            sym = quant_config.get("sym", False)
            tensors, deq = gptq_tensors(w.float(), group if group != -1 else k, perm, v2, sym)
        elif method == "awq":
            tensors, deq = awq_tensors(w.float(), group)
        else:
            tensors, deq = fp8_tensors(w.float(), quant_config.get("weight_block_size"))
        packed.update({f"{module}.{kind_}": t.contiguous() for kind_, t in tensors.items()})
        reference[name] = deq.to(w.dtype)
    ref_dir, q_dir = root / "reference", root / "quantized"
    for folder, tensors in ((ref_dir, reference), (q_dir, packed)):
        shutil.copytree(float_dir, folder)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((q_dir / "config.json").read_text())
    config["quantization_config"] = quant_config
    (q_dir / "config.json").write_text(json.dumps(config, indent=2))
    return q_dir, ref_dir
