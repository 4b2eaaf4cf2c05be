"""Quantized checkpoints: which format a checkpoint is in (config.json's `quantization_config`),
whether heterollm can run it, and whether `--quantization` agrees with it.

Formats run: GPTQ (4-bit, group-wise, with or without act-order; AutoGPTQ's `gptq` and gptqmodel's
`gptq_v2` zero-point storage), AWQ (4-bit, group-wise, zero point, the `gemm` packing) and FP8
(e4m3 weights with a per-tensor `weight_scale`, or `weight_scale_inv` per `weight_block_size`
block as DeepSeek-V3 / Qwen3 FP8 checkpoints carry them). Everything else is refused with its
reason; nothing is run half-way."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FORMATS = ("gptq", "awq", "fp8")
"""The checkpoint formats (and `--quantization` values) read from `quantization_config`."""


@dataclass(frozen=True)
class CheckpointQuant:
    """What the linear layers of a quantized checkpoint hold."""

    format: str
    """"gptq", "awq" or "fp8"; also the op registry key `quantized_linear.<format>`."""
    group_size: int | None
    """Input features per scale group (the FP8 block's width); None: one group per output row."""
    block_rows: int | None = None
    """FP8 block-wise: output rows per scale block; None elsewhere."""
    desc_act: bool = False
    """GPTQ act-order: input features are grouped through `g_idx`, not in contiguous runs."""
    zero_offset: int = 0
    """Added to the stored zero point: 1 for AutoGPTQ's format, which stores zero - 1."""
    skip: tuple[str, ...] = ()
    """`modules_to_not_convert`: name fragments of linear layers the checkpoint keeps in float."""

    def describe(self) -> str:
        if self.format == "fp8":
            return f"fp8 ({f'blocks of {self.block_rows}x{self.group_size}' if self.block_rows else 'per-tensor'})"
        group = f"group {self.group_size}" if self.group_size else "per-channel"
        return f"{self.format} (4-bit, {group}{', desc_act' if self.desc_act else ''})"

    def flag_values(self) -> tuple[str, ...]:
        """`--quantization` values that mean this format (FastDeploy spells block-wise FP8 its own way)."""
        return (self.format, "block_wise_fp8") if self.block_rows else (self.format,)


def checkpoint_quantization(hf_config: Any) -> CheckpointQuant | None:
    """The checkpoint's format, or None for a float checkpoint. Raises ValueError with the reason for a
    `quantization_config` heterollm cannot run."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict()
    method = str(qc.get("quant_method", "")).lower()
    if method not in _PARSERS:
        raise ValueError(f"quant_method {method!r} is not supported (supported: {', '.join(FORMATS)})")
    return _PARSERS[method](qc)


def _group(qc: dict, key: str) -> int | None:
    size = int(qc.get(key, -1))
    if size != -1 and (size <= 0 or size % 8):
        raise ValueError(f"{key} {size} is not supported (a positive multiple of 8, or -1)")
    return None if size == -1 else size


def _skip(qc: dict) -> tuple[str, ...]:
    return tuple(qc.get("modules_to_not_convert") or ())


def _gptq(qc: dict) -> CheckpointQuant:
    if int(qc.get("bits", 4)) != 4:
        raise ValueError(f"gptq bits={qc['bits']} is not supported (4-bit only)")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"gptq checkpoint_format {fmt!r} is not supported (gptq, gptq_v2): its packing differs")
    if qc.get("lm_head"):
        raise ValueError("gptq with a quantized lm_head is not supported")
    if qc.get("dynamic"):
        raise ValueError("gptq per-module `dynamic` overrides are not supported")
    return CheckpointQuant("gptq", _group(qc, "group_size"), desc_act=bool(qc.get("desc_act", False)),
                           zero_offset=1 if fmt == "gptq" else 0, skip=_skip(qc))


def _awq(qc: dict) -> CheckpointQuant:
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits != 4:
        raise ValueError(f"awq bits={bits} is not supported (4-bit only)")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"awq version {version!r} is not supported (gemm): its packing differs")
    if not qc.get("zero_point", True):
        raise ValueError("awq without zero_point is not supported")
    return CheckpointQuant("awq", _group(qc, "group_size" if "group_size" in qc else "q_group_size"),
                           skip=_skip(qc))


def _fp8(qc: dict) -> CheckpointQuant:
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ValueError(f"fp8 fmt {fmt!r} is not supported (e4m3)")
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise ValueError(f"fp8 activation_scheme {scheme!r} is not supported (dynamic): static input scales "
                         "quantize activations, and heterollm runs FP8 checkpoints weight-only")
    block = qc.get("weight_block_size")
    if block is None:
        return CheckpointQuant("fp8", None, skip=_skip(qc))
    if len(block) != 2 or min(block) <= 0:
        raise ValueError(f"fp8 weight_block_size {block} is not [rows, columns]")
    return CheckpointQuant("fp8", int(block[1]), block_rows=int(block[0]), skip=_skip(qc))


_PARSERS = {"gptq": _gptq, "awq": _awq, "fp8": _fp8}


def check_quantization_flag(flag: str | None, quant: CheckpointQuant | None) -> None:
    """`--quantization` against the checkpoint: a float checkpoint cannot be read as a packed format,
    and a packed checkpoint runs only as what it is. Raises ValueError naming the flag and the format."""
    if quant is None:
        if flag in FORMATS or flag == "block_wise_fp8":
            raise ValueError(f"--quantization={flag}: the checkpoint has no quantization_config (it is not a "
                             f"{flag} checkpoint); wint8 / wint4 quantize a float checkpoint at load")
        return
    if flag is not None and flag not in quant.flag_values():
        raise ValueError(f"--quantization={flag} conflicts with the checkpoint's quantization_config: "
                         f"{quant.describe()}; leave --quantization unset or pass --quantization={quant.format}")
