"""CPU linear methods (op registry `linear.*`, family `cpu`).

- `linear.none`: bf16 weights on a CPU with AVX512_BF16, where the kernels are built, packed once in
  panels of 16 output channels for `heterollm_cpu::bf16_linear` (csrc/bf16_linear.cpp, the bf16 pair dot
  product; `pack_bf16_panels`): measured on 2 AMD EPYC (Zen 4) vCPUs over SmolLM2-135M's layer shapes,
  1.95x oneDNN's prepacked bf16 GEMM at one row, 1.5-1.6x at 2-4, 1.1-1.2x at 16-64, even at 512-2,048
  (bench/RESULTS.md, session 22).
  Other bf16/fp32 weights reordered once into oneDNN's blocked layout, multiplied with
  `mkldnn._linear_pointwise` (what torch.compile's CPU backend does with frozen weights). Measured
  on a 2-core AVX-512-bf16 machine: 1.1-1.4x faster than `F.linear` at 64 rows, up to 2.5x at 1
  row, because `F.linear` re-packs the weight on every call. A CPU without AVX-512 (an AVX2-only
  AMD EPYC, say) has no oneDNN bf16 kernels: its bf16 weights stay plain tensors for `F.linear`
  (torch emulates bf16 there; `--dtype auto` picks float32 on such a CPU).
- `linear.wint8` (`--quantization wint8`): symmetric int8 per output channel, the C++ op
  `heterollm_cpu::int8_gemm` (csrc/int8_gemm.cpp, AVX2's 16-bit multiply-add on 16-bit activations)
  where the kernels are built on an AVX2 CPU, else `torch._weight_int8pack_mm`.
- `linear.wint4` (`--quantization wint4`): asymmetric 4-bit in groups of 32 input features
  (scale and minimum per group, like GGUF's Q4_1), the C++ op `heterollm_cpu::int4_linear`
  (csrc/int4_linear.cpp), or `torch._weight_int4pack_mm_for_cpu` where the kernels are not built.
- `linear.w8a8` (`--quantization w8a8`): the weights as `wint8`'s (symmetric int8 per output channel,
  fp32 scales), the activations quantized to int8 per row at each call, an int8 GEMM (`torch._int_mm`,
  oneDNN's s8s8 kernel on the CPU's VNNI / AMX-int8 units), then both scales applied: the C++ op
  `heterollm_cpu::w8a8_linear` (csrc/int8_linear.cpp) in one dispatch, or `w8a8_reference` where the
  kernels are not built. On an x86 CPU without int8 dot products (AVX2 only), where `torch._int_mm` is a
  reference loop, the same int8 activation codes and sums on `heterollm_cpu::int8_gemm`; on one with
  AVX512-VNNI and no AMX, on `heterollm_cpu::int8_dot_gemm` (csrc/int8_dot_gemm.cpp, the byte dot product on
  weights packed once).
All three quantize the loaded bf16/fp32 weights at start-up. The weight-only two read 2x / 4x fewer
weight bytes, which pays at small batches (single-stream decode); torch's weight-only int kernels are
slower than the bf16 GEMM at tens of rows, so they are not the throughput setting (`int8_gemm` is not
slower than the fp32 GEMM at any row count on an AVX2 CPU, where it is the wint8 kernel). `w8a8` reads the
int8 bytes and multiplies at the int8 rate at every batch size (the instruction does twice bf16's
products; measured on 2 AMD EPYC vCPUs: a prefill's linears 1.4x faster than bf16, bench/RESULTS.md)."""
from __future__ import annotations

import itertools
import logging
import weakref
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from heterollm.model_executor import ops
from heterollm.model_executor.linear_method import LinearMethod
from heterollm.model_executor.quant_linear import QuantizedLinearMethod, QuantizedWeight
from heterollm_cpu import kernels
from heterollm_cpu.platform import _cpu_flags

logger = logging.getLogger("heterollm.cpu.linear")

# oneDNN picks its blocked layout for a batch-size hint; measured best overall: 1 for bf16, 64 for fp32
_PACK_HINT = {torch.bfloat16: 1, torch.float32: 64}


class PackedWeight:
    """A weight in oneDNN's opaque blocked layout. torch.compile cannot trace an opaque tensor, so a
    compiled step reaches it through the `heterollm_cpu::packed_linear` op by `handle`: a tensor input
    of the graph holding the pack's registry key, (out_features,) with stride 0 over one int64 (its
    shape gives the op's output width at trace time). Being an input, not a constant, it lets the
    decoder layers of a model share one compiled region (llama.py's `DecoderLayer.begin` / `finish`):
    the graph traced for layer 0 runs layer 1 with layer 1's handles. The registry holds the pack only
    while a layer does."""

    _live: weakref.WeakValueDictionary[int, PackedWeight] = weakref.WeakValueDictionary()
    _keys = itertools.count()

    def __init__(self, packed: torch.Tensor) -> None:
        self.packed = packed
        key = next(self._keys)  # kept only in the handle: the op reads it back from there
        self._live[key] = self
        self.handle = torch.full((1,), key, dtype=torch.int64).expand(packed.shape[0])

    @property
    def nbytes(self) -> int:
        """Its logical size (the opaque layout's own is not exposed): what `state_bytes` counts."""
        return self.packed.numel() * self.packed.element_size()


@torch.library.custom_op("heterollm_cpu::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, PackedWeight._live[int(handle[0])].packed, None, "none", [], "")


@packed_linear.register_fake
def _packed_linear_shape(x: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], handle.shape[0])


def pack_bf16_panels(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) bf16, K even -> (ceil(N / 16), K / 2, 32), `bf16_linear`'s layout: panel p, pair-row t holds
    w[16p + c, 2t + i] at 2c + i (output channels past N are zero)."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"bf16_linear takes an even in_features, not {k}")
    p = -(-n // 16)
    padded = weight.new_zeros(p * 16, k)
    padded[:n] = weight
    return padded.view(p, 16, k // 2, 2).permute(0, 2, 1, 3).reshape(p, k // 2, 32).contiguous()


def unpack_bf16_panels(panels: torch.Tensor, n: int) -> torch.Tensor:
    """`pack_bf16_panels`' inverse: the (N, K) weight."""
    p, k2, _ = panels.shape
    return panels.view(p, k2, 16, 2).permute(0, 2, 1, 3).reshape(p * 16, 2 * k2)[:n]


def _bf16_dot_here() -> bool:
    """Whether bf16 weights go on `heterollm_cpu::bf16_linear`: the kernels built on a CPU with AVX512_BF16."""
    return "avx512_bf16" in _cpu_flags() and kernels.available()


class Bf16Panels(NamedTuple):
    """A bf16 weight for `bf16_linear`: `pack_bf16_panels`' panels and the output width."""

    panels: torch.Tensor
    n: int


def dense_apply(state: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T (+ bias) for a state `OneDnnLinear.prepare` made: `bf16_linear` on `Bf16Panels` (x of another
    dtype through bf16 and back, the weight's own precision), oneDNN on a `PackedWeight`, else `F.linear`."""
    if isinstance(state, Bf16Panels):
        if x.dtype == torch.bfloat16:
            return torch.ops.heterollm_cpu.bf16_linear(x, state.panels, state.n, bias)
        b = None if bias is None else bias.to(torch.bfloat16)
        return torch.ops.heterollm_cpu.bf16_linear(x.to(torch.bfloat16), state.panels, state.n, b).to(x.dtype)
    if not isinstance(state, PackedWeight):
        return F.linear(x, state, bias)
    if torch.compiler.is_compiling():
        y = torch.ops.heterollm_cpu.packed_linear(x, state.handle)
        return y if bias is None else y + bias
    return torch.ops.mkldnn._linear_pointwise(x, state.packed, bias, "none", [], "")


class OneDnnLinear(LinearMethod):
    """`linear.none`: the unquantized weight, on `bf16_linear` (bf16 with AVX512_BF16 and the kernels, a
    `Bf16Panels` state), else prepacked for oneDNN (a `PackedWeight`), else plain for `F.linear`."""

    name = "onednn"

    def __init__(self) -> None:  # once per model load (select_linear_method)
        self.dot = _bf16_dot_here()

    def prepare(self, weight: torch.Tensor) -> Any:
        if self.dot and weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0:
            return Bf16Panels(pack_bf16_panels(weight), weight.shape[0])
        if weight.dtype not in _PACK_HINT or not torch.backends.mkldnn.is_available():
            return weight  # fp16 and builds without oneDNN keep F.linear
        if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return weight  # oneDNN packs bf16 only with AVX-512 (bw/vl/dq) or AVX-NE-CONVERT: torch's own bf16 GEMM
        return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_HINT[weight.dtype]))

    def reload(self, state: Any, weight: torch.Tensor) -> Any:
        """In place: a compiled step reaches the pack by its handle, an eager one by the state object."""
        fresh = self.prepare(weight)
        if (isinstance(state, Bf16Panels) and isinstance(fresh, Bf16Panels)
                and state.panels.shape == fresh.panels.shape and state.n == fresh.n):
            state.panels.copy_(fresh.panels)
            return state
        if isinstance(state, PackedWeight) and isinstance(fresh, PackedWeight):
            state.packed = fresh.packed
            return state
        if isinstance(state, torch.Tensor) and isinstance(fresh, torch.Tensor) and state.shape == fresh.shape:
            state.copy_(fresh)
            return state
        return fresh

    def apply(self, state: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return dense_apply(state, x, bias)


def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes per output channel, `wint8`'s and `w8a8`'s: (codes (N, K) int8 in
    [-127, 127], fp32 scales (N) = max |row| / 127), with w ~ codes * scale."""
    w = weight.float()
    scale = w.abs().amax(1).clamp(min=1e-12) / 127
    codes = (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return codes.contiguous(), scale.contiguous()


def pack_int8_panels(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 codes -> (ceil(N / 16), ceil(K / 2), 16, 2) int8, `heterollm_cpu::int8_gemm`'s layout:
    panels of 16 output channels (zero rows pad N), each pair of input features of the 16 channels side by
    side (a zero column pads an odd K): one 32-byte row per pair, byte 2n + i = codes[16p + n, 2j + i]."""
    n, k = codes.shape
    padded = torch.zeros((n + 15) // 16 * 16, k + k % 2, dtype=torch.int8)
    padded[:n, :k] = codes
    return padded.view(-1, 16, padded.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_int8_panels(panels: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """`pack_int8_panels`' inverse: the (N, K) codes."""
    return panels.permute(0, 2, 1, 3).reshape(-1, panels.shape[1] * 2)[:n, :k]


def pack_int8_quads(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) int8 codes -> `heterollm_cpu::int8_dot_gemm`'s weight: panels (ceil(N / 16), ceil(K / 4), 16, 4)
    int8 of 16 output channels (zero rows pad N), each quad of input features of the 16 channels side by
    side (zero columns pad K to a multiple of 4): one 64-byte row per quad, byte 4n + i = codes[16p + n, 4j + i];
    and w_sums (N) int32 = 128 * the sum of each channel's codes (the kernel multiplies q + 128 as unsigned
    bytes and subtracts it)."""
    n, k = codes.shape
    padded = torch.zeros((n + 15) // 16 * 16, (k + 3) // 4 * 4, dtype=torch.int8)
    padded[:n, :k] = codes
    panels = padded.view(-1, 16, padded.shape[1] // 4, 4).permute(0, 2, 1, 3).contiguous()
    return panels, codes.sum(1, dtype=torch.int32).mul_(128)


def unpack_int8_quads(panels: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """`pack_int8_quads`' inverse: the (N, K) codes."""
    return panels.permute(0, 2, 1, 3).reshape(-1, panels.shape[1] * 4)[:n, :k]


def _int8_gemm_here() -> bool:
    """Whether `heterollm_cpu::int8_gemm` runs here at its vector speed: the kernels built on an x86 CPU
    with AVX2 (its 16-bit multiply-add loop; elsewhere it would be a scalar loop)."""
    return kernels.available() and "avx2" in _cpu_flags()


def _in_kernel_dtype(op, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """op(x, bias) for the C++ linears, which take fp32 and bf16 (with the bias in x's dtype): other inputs
    (fp16) go through fp32 and are rounded back."""
    if x.dtype in (torch.float32, torch.bfloat16) and (bias is None or bias.dtype == x.dtype):
        return op(x, bias)
    return op(x.float(), None if bias is None else bias.float()).to(x.dtype)


def int8_apply(state: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, bias: torch.Tensor | None,
               qmax: int) -> torch.Tensor:
    """x @ (codes * scale).T (+ bias) on `heterollm_cpu::int8_gemm`, x quantized per row to [-qmax, qmax]."""
    panels, scale = state
    return _in_kernel_dtype(lambda t, b: torch.ops.heterollm_cpu.int8_gemm(t, panels, scale, qmax, b), x, bias)


class WeightOnlyInt8(LinearMethod):
    """int8 codes per output channel (symmetric, `int8_per_channel`). Where the kernels are built on an AVX2
    CPU: `heterollm_cpu::int8_gemm` (csrc/int8_gemm.cpp) with the activations rounded per row to 16-bit
    integers (1 / 65534 of the row's largest value, far under the weights' int8 step), the weight read as
    int8 at every batch size. Measured on 2 AMD EPYC (AVX2) vCPUs over SmolLM2-135M's 121 layer shapes:
    3.5-4.1x faster than the fp32 GEMM at one row, 2.7-3.2x at 4, 1.5-1.7x at 16, 1.2-1.3x at 64, 1.0x at
    512 rows, and 12-40x faster than torch's `_weight_int8pack_mm` (two runs of bench/linear_kernels.py,
    bench/RESULTS.md). Elsewhere: `_weight_int8pack_mm`."""

    name = "wint8"
    qmax = 32767

    def prepare(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        codes, scale = int8_per_channel(weight)
        if _int8_gemm_here():
            return pack_int8_panels(codes), scale
        return codes, scale.to(weight.dtype)

    def apply(self, state: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        codes, scale = state
        if codes.dim() == 4:
            return int8_apply(state, x, bias, self.qmax)
        y = torch._weight_int8pack_mm(x.contiguous(), codes, scale)
        return y if bias is None else y + bias


def pack_int4_panels(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(N, K) codes in [0, 15] with (N, K / G) scales and minima -> `heterollm_cpu::int4_linear`'s panels
    (P, K / 2, 16) uint8 and its panel-major scales and minima (P, K / G, 16) fp32, N padded with zeros
    to P = ceil(N / 16) panels of 16 output channels: with v[2n + i] = code[16p + n, 2j + i], byte b of
    pair-row j holds v[b] in its low nibble and v[b + 16] in its high one (csrc/int4_linear.cpp)."""
    n, k = codes.shape
    p = -(-n // 16)
    pad = (0, 0, 0, 16 * p - n)
    v = F.pad(codes.to(torch.uint8), pad).view(p, 16, k // 2, 2).permute(0, 2, 1, 3).reshape(p, k // 2, 32)
    panels = (v[..., :16] | (v[..., 16:] << 4)).contiguous()
    return panels, _panel_major(scale), _panel_major(low)


def _panel_major(t: torch.Tensor) -> torch.Tensor:
    """(N, K / G) per-group values -> (ceil(N / 16), K / G, 16) fp32, the 16 channels of a panel side by side
    for each group (zero rows pad N)."""
    p = -(-t.shape[0] // 16)
    return F.pad(t.float(), (0, 0, 0, 16 * p - t.shape[0])).view(p, 16, -1).transpose(1, 2).contiguous()


def pack_int4_quads(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(N, K) codes in [0, 15] with (N, K / G) scales and minima -> `heterollm_cpu::int4_dot_linear`'s panels
    (P, K / 8, 64) uint8 and the panel-major scales and minima of `pack_int4_panels` in fp16 (GGUF Q4_1's
    precision): byte 4n + i of octet-row t holds code[16p + n, 8t + i] in its low nibble and
    code[16p + n, 8t + 4 + i] in its high one (csrc/int4_dot_linear.cpp). Scales or minima past fp16's
    range raise ValueError (the caller packs that layer for `int4_linear`)."""
    if max(scale.abs().max().item(), low.abs().max().item(), 0.0) > torch.finfo(torch.float16).max:
        raise ValueError("4-bit scales or minima past float16's range")
    n, k = codes.shape
    p = -(-n // 16)
    v = F.pad(codes.to(torch.uint8), (0, 0, 0, 16 * p - n)).view(p, 16, k // 8, 2, 4).permute(0, 2, 3, 1, 4)
    panels = (v[:, :, 0] | (v[:, :, 1] << 4)).reshape(p, k // 8, 64).contiguous()
    return panels, _panel_major(scale).half(), _panel_major(low).half()


def unpack_int4_quads(panels: torch.Tensor, n: int) -> torch.Tensor:
    """`pack_int4_quads`' inverse: the (N, K) codes."""
    p, octets, _ = panels.shape
    v = torch.stack([panels & 0x0F, panels >> 4], 2).view(p, octets, 2, 16, 4)  # [p, t, h, n, i]
    return v.permute(0, 3, 1, 2, 4).reshape(p * 16, octets * 8)[:n]


def dequantize_int4_panels(panels: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, gs: int,
                           n: int) -> torch.Tensor:
    """The fp32 (N, K) weight of `pack_int4_panels`' or `pack_int4_quads`' layout (rows of 64 bytes): code *
    scale + min per group (the layouts' reference, which the kernels' tests compare against)."""
    p = panels.shape[0]
    if panels.shape[-1] == 64:
        q = F.pad(unpack_int4_quads(panels, n), (0, 0, 0, 16 * p - n)).view(p * 16, -1, gs).float()
    else:
        pairs = panels.shape[1]
        v = torch.cat([panels & 0x0F, panels >> 4], -1).view(p, pairs, 16, 2).permute(0, 2, 1, 3)  # (P, 16, K/2, 2)
        q = v.reshape(p * 16, -1, gs).float()  # (16 P, K / gs, gs)
    scales, mins = scales.float(), mins.float()
    w = q * scales.transpose(1, 2).reshape(p * 16, -1, 1) + mins.transpose(1, 2).reshape(p * 16, -1, 1)
    return w.view(p * 16, -1)[:n]


def _int4_dot_here() -> bool:
    """Whether 4-bit weights go on `heterollm_cpu::int4_dot_linear`: the kernels built on a CPU with AVX512-VNNI."""
    return "avx512_vnni" in _cpu_flags() and kernels.available()


def pack_int4(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, dot: bool) -> tuple[torch.Tensor, ...]:
    """The C++ kernels' layout for (N, K) 4-bit codes with (N, K / G) scales and minima: `pack_int4_quads`
    where `dot` (AVX512-VNNI), unless a scale or minimum is past fp16's range (that layer keeps fp32 ones on
    `int4_linear`); `pack_int4_panels` otherwise."""
    if dot:
        try:
            return pack_int4_quads(codes, scale, low)
        except ValueError:
            pass
    return pack_int4_panels(codes, scale, low)


class WeightOnlyInt4(LinearMethod):
    """4-bit codes per group of 32 input features, w = code * scale + min (GGUF's Q4_1). With the CPU
    kernels built, the codes are multiplied where they lie, packed once at load:
    - on CPUs with AVX512-VNNI: `heterollm_cpu::int4_dot_linear` (csrc/int4_dot_linear.cpp), the codes as
      the unsigned operand of the byte dot product against x rounded to int8 per group of 32 (llama.cpp's
      Q4_1 x Q8_1 scheme), fp16 scales and minima (`pack_int4_quads`), at every batch size; measured on 2
      AMD EPYC (Zen 4) vCPUs over SmolLM2's 121 layer shapes in bf16 (bench/linear_kernels.py), 1.2x
      `int4_linear` at one row and 2.3-2.6x at 4-512 rows (where `int4_linear` dequantizes for the fp32
      GEMM); the int8 activations add logprob drift (teacher-forced mean 0.060 against 0.045;
      bench/RESULTS.md, session 21);
    - elsewhere (x86 with AVX2 + FMA, or the kernel's scalar loop): `heterollm_cpu::int4_linear`
      (csrc/int4_linear.cpp), x rounded to int16, panels of 16 output channels (`pack_int4_panels`), up
      to 128 rows, then dequantize + fp32 GEMM: on 2 AMD EPYC (AVX2) vCPUs 4.5 ms a step at one row
      against 5.9 ms for the row-major layout before it (torch's `_weight_int4pack_mm_for_cpu` took 900 us
      for one 1536 x 576 layer, the kernel now 31 us), and within 10% of the prepacked fp32 GEMM at 33-128
      rows (bench/RESULTS.md, session 19).
    Without the kernels, torch's int4 kernel (which takes output rows in sixteens only)."""

    name = "wint4"
    group_size = 32

    def __init__(self) -> None:  # once per model load (select_linear_method)
        self.dot = _int4_dot_here()

    def prepare(self, weight: torch.Tensor) -> tuple:
        n, k = weight.shape
        gs = self.group_size
        if k % gs:
            raise ValueError(f"--quantization=wint4: in_features {k} is not a multiple of the group size {gs}")
        use_kernel = kernels.available()
        if n % 16 and not use_kernel:  # torch's int4 CPU packing takes output rows in sixteens
            raise ValueError(f"--quantization=wint4: out_features {n} is not a multiple of 16 (torch's int4 kernel; "
                             "the CPU kernels, `python -m heterollm_cpu.kernels`, take any)")
        w = weight.float().view(n, k // gs, gs)
        low, high = w.amin(-1), w.amax(-1)
        scale = ((high - low) / 15).clamp(min=1e-12)
        codes = ((w - low[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.int32).view(n, k)
        if use_kernel:
            return (*pack_int4(codes, scale, low, self.dot), gs, n)
        packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
        # the kernel computes (code - 8) * scale + zero, so zero = low + 8 * scale
        scales_and_zeros = torch.stack([scale.t(), (low + 8 * scale).t()], -1).contiguous()  # (k / gs, n, 2)
        return packed, scales_and_zeros.to(weight.dtype), gs

    def apply(self, state: tuple, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return int4_apply(state, x, bias)


def int4_apply(state: tuple, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T (+ bias) for a state `WeightOnlyInt4.prepare` made (also CheckpointInt4's): the panels, their
    scales and minima, the group and the output width for the C++ kernels (`int4_dot_linear` for the octet
    layout of `pack_int4_quads`, rows of 64 bytes; `int4_linear` for `pack_int4_panels`'); 3 entries for
    torch's int4 kernel."""
    if len(state) == 5:  # prepared for a C++ kernel
        panels, scales, mins, gs, n = state
        op = torch.ops.heterollm_cpu.int4_dot_linear if panels.shape[-1] == 64 else torch.ops.heterollm_cpu.int4_linear
        return _in_kernel_dtype(lambda t, b: op(t, panels, scales, mins, gs, n, b), x, bias)
    packed, scales_and_zeros, gs = state
    y = torch._weight_int4pack_mm_for_cpu(x.contiguous(), packed, gs, scales_and_zeros)
    return y if bias is None else y + bias


def w8a8_reference(x: torch.Tensor, codes: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """`heterollm_cpu::w8a8_linear` in torch ops, operation for operation: per row of x, amax = max |x|,
    q = round(x * (127 / amax)) (half to even) in [-127, 127], s = amax * (1 / 127) (a row of zeros or of
    values under 127 / FLT_MAX: q = 0, s = 1; a row with a NaN or an infinity: q = 0, s = NaN);
    y = (q @ codes.T) * (s * w_scale) (+ bias), in x's dtype. All in fp32, each operation as the kernel
    does it: the same codes and sums, the output within an ulp or two (the compiler's reordering)."""
    k = x.shape[-1]
    rows = x.reshape(-1, k).float()
    amax = rows.abs().amax(-1, keepdim=True)
    finite = rows.isfinite().all(-1, keepdim=True)
    tiny = torch.tensor(127, dtype=torch.float32) / torch.finfo(torch.float32).max
    live = finite & (amax > tiny)
    inv = torch.where(live, torch.full_like(amax, 127).div_(amax), torch.zeros_like(amax))  # a true division
    q = torch.where(live, rows * inv, 0).round_().clamp_(-127, 127).to(torch.int8)
    scale = torch.where(live, amax * (1 / 127), torch.where(finite, 1.0, float("nan")))
    y = torch._int_mm(q, codes.t()).float() * (scale * w_scale)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], codes.shape[0])


_INT8_DOT = {"avx512_vnni", "avx_vnni", "amx_int8"}
"""x86 flags of the int8 dot-product instructions oneDNN's s8s8 GEMM (torch._int_mm) is built on."""


class DynamicInt8(LinearMethod):
    """W8A8: int8 weights (per output channel) times int8 activations (per token, quantized at each
    call). Only the int8 codes are kept: a tied embedding keeps its own float weight (prepare_linears).
    Where the kernels are built on a CPU with AVX512-VNNI and no AMX: `heterollm_cpu::int8_dot_gemm` on the
    codes packed once (`pack_int8_quads`), the same integer sums as `torch._int_mm`'s; measured on 2 AMD
    EPYC (Zen 4) vCPUs over SmolLM2-135M's 121 layer shapes in bf16: 1.7x faster than `w8a8_linear` (torch's
    `_int_mm`) at 1 row, 1.8-2.3x at 4-16 rows, 1.2x at 64 and 1024 rows (bench/RESULTS.md). With AMX-int8
    oneDNN's AMX GEMM stays (not measured against this kernel)."""

    name = "w8a8"

    qmax = 127

    def __init__(self) -> None:  # once per model load (select_linear_method)
        flags = _cpu_flags()
        # without int8 dot products torch's int8 GEMM is a reference loop: the AVX2 kernel takes over
        self.panels = "avx2" in flags and not flags & _INT8_DOT and _int8_gemm_here()
        # AVX512-VNNI's byte dot product on weights packed once, where torch's _int_mm re-reads the codes each call
        self.dot = "avx512_vnni" in flags and "amx_int8" not in flags and kernels.available()
        if "avx2" in flags and not flags & _INT8_DOT and not self.panels:
            logger.warning("--quantization w8a8: this CPU has no int8 dot-product instructions (VNNI or AMX-int8) and "
                           "the CPU kernels are not built (`python -m heterollm_cpu.kernels`), so torch's int8 GEMM "
                           "runs a reference loop: expect it ~20x slower than float32 (measured on an AVX2-only AMD "
                           "EPYC, bench/RESULTS.md)")

    def prepare(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if weight.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"--quantization=w8a8: takes float32 or bfloat16 weights, not {weight.dtype} "
                             "(set --dtype bfloat16 or float32)")
        codes, scale = int8_per_channel(weight)
        if self.dot:
            panels, w_sums = pack_int8_quads(codes)
            return panels, scale, w_sums
        return (pack_int8_panels(codes), scale) if self.panels else (codes, scale)

    def apply(self, state: tuple[torch.Tensor, ...], x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if len(state) == 3:  # AVX512-VNNI: int8_dot_gemm on the quads
            panels, scale, w_sums = state
            return _in_kernel_dtype(
                lambda t, b: torch.ops.heterollm_cpu.int8_dot_gemm(t, panels, scale, w_sums, b), x, bias)
        codes, scale = state
        if codes.dim() == 4:  # the AVX2 kernel: the same int8 activation codes and integer sums
            return int8_apply(state, x, bias, self.qmax)
        if kernels.available() and x.dtype in (torch.float32, torch.bfloat16) and (bias is None or bias.dtype == x.dtype):
            return torch.ops.heterollm_cpu.w8a8_linear(x, codes, scale, bias)
        return w8a8_reference(x, codes, scale, bias)


_INT4_GROUPS = (256, 128, 64, 32)  # the group sizes torch's int4 CPU kernel takes


class CheckpointInt4(QuantizedLinearMethod):
    """GPTQ and AWQ checkpoints (`quantized_linear.gptq`, `quantized_linear.awq`) on the int4 kernel of `wint4`
    (`int4_linear` on every CPU: its int16 activations keep the checkpoint's greedy tokens and logprobs those
    of its dequantized weights, which `int4_dot_linear`'s int8 ones do not): their
    w = (code - zero) * scale per group is the C++ kernel's code * scale + min with min = -zero * scale
    (any group of a multiple of 32 features), or torch's (code - 8) * scale + (8 - zero) * scale where
    the CPU kernels are not built, so the codes go in unchanged. A group wider than torch's kernel's
    repeats its scale over several kernel groups; GPTQ act-order permutes the input features into contiguous groups once, here, and each
    call gathers x's columns in that order. A layer whose groups fit no kernel group size (input
    features not a multiple of 32) is dequantized to the compute dtype instead."""

    name = "int4-checkpoint"

    def prepare(self, weight: QuantizedWeight) -> Any:  # type: ignore[override]
        n, k = weight.codes.shape
        codes, scales, zeros, group = weight.codes, weight.scales, weight.zeros, weight.group_size
        order = None
        if weight.g_idx is not None:
            order = torch.argsort(weight.g_idx.long(), stable=True)
            if not torch.equal(weight.g_idx.long()[order], torch.arange(k) // group):
                return OneDnnLinear().prepare(weight.dequantize())  # groups of uneven sizes
            codes = codes[:, order]
            order = None if torch.equal(order, torch.arange(k)) else order
        if kernels.available() and group % 32 == 0 and k % group == 0:  # the C++ kernel: any group of 32s
            scale = scales.float()
            return (*pack_int4_panels(codes, scale, -zeros.float() * scale), group, n, order)
        kernel_group = next((g for g in _INT4_GROUPS if group % g == 0 and k % g == 0), None)
        if kernel_group is None:
            return OneDnnLinear().prepare(weight.dequantize())
        per_kernel = torch.arange(k // kernel_group) * kernel_group // group  # scale column of each kernel group
        scale, zero = scales[:, per_kernel], zeros[:, per_kernel]
        packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        scales_and_zeros = torch.stack([scale.t(), ((8 - zero) * scale).t()], -1).contiguous()  # (k / g, n, 2)
        return packed, scales_and_zeros.to(weight.dtype), kernel_group, order

    def apply(self, state: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(state, tuple) or isinstance(state, Bf16Panels):  # dequantized
            return dense_apply(state, x, bias)
        *kernel_state, order = state
        if order is not None:
            x = x.index_select(-1, order)
        return int4_apply(kernel_state, x, bias)


class CheckpointFp8(QuantizedLinearMethod):
    """FP8 checkpoints (`quantized_linear.fp8`): the CPU has no FP8 GEMM, and e4m3 values with per-tensor or
    per-block scales are not int8 codes of one scale per row, so the weight is dequantized once to
    the compute dtype and prepacked like an unquantized one: 2x the checkpoint's weight bytes in
    bf16, 4x in fp32."""

    name = "fp8-dequantized"

    def prepare(self, weight: QuantizedWeight) -> Any:  # type: ignore[override]
        return OneDnnLinear().prepare(weight.dequantize())

    def apply(self, state: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return dense_apply(state, x, bias)


def register_ops(config: Any = None) -> None:
    """The linear methods, family `cpu` (the backend's `register_ops`, fused.py, calls this)."""
    for name, cls in (("none", OneDnnLinear), ("wint8", WeightOnlyInt8), ("wint4", WeightOnlyInt4),
                      ("w8a8", DynamicInt8)):
        ops.register(f"linear.{name}", family="cpu")(cls)
    for name, cls in (("gptq", CheckpointInt4), ("awq", CheckpointInt4), ("fp8", CheckpointFp8)):
        ops.register(f"quantized_linear.{name}", family="cpu")(cls)
