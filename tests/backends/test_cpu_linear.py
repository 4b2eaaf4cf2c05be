"""CPU linear methods (`linear.none` prepacked or on `bf16_linear`, `linear.wint8`, `linear.wint4`, `linear.w8a8`) against
F.linear, the op-registry fallback that selects them, and their errors."""
import logging

import pytest
import torch
import torch.nn.functional as F

from heterollm.model_executor import ops
from heterollm.model_executor.linear_method import model_bytes, prepare_linears, select_linear_method
from heterollm_cpu import kernels
from heterollm_cpu.linear import (Bf16Panels, DynamicInt8, OneDnnLinear, PackedWeight, WeightOnlyInt4, WeightOnlyInt8,
                                  int8_per_channel, pack_bf16_panels, pack_int8_panels, pack_int8_quads,
                                  unpack_bf16_panels, unpack_int8_panels, unpack_int8_quads, w8a8_reference)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().mean() / ref.abs().mean())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_prepacked_matches_f_linear(dtype, rows):
    torch.manual_seed(0)
    w, b, x = torch.randn(96, 64, dtype=dtype), torch.randn(96, dtype=dtype), torch.randn(rows, 64, dtype=dtype)
    method = OneDnnLinear()
    y = method.apply(method.prepare(w), x, b)
    assert y.dtype == dtype and y.shape == (rows, 96)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.float(), F.linear(x, w, b).float(), atol=tol * 10, rtol=tol)


@pytest.fixture
def bf16_dot(monkeypatch):
    """`linear.none` with bf16 weights on `heterollm_cpu::bf16_linear` on any CPU (its scalar loop without
    AVX512_BF16)."""
    if not kernels.available():
        pytest.skip("CPU kernels not built")
    import heterollm_cpu.linear as cpu_linear

    monkeypatch.setattr(cpu_linear, "_cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    return OneDnnLinear()


@pytest.mark.parametrize("n, k", [(40, 64), (33, 66), (16, 2), (100, 600), (1, 4)])
def test_bf16_panels_round_trip(n, k):
    w = torch.randn(n, k).bfloat16()
    panels = pack_bf16_panels(w)
    assert panels.shape == (-(-n // 16), k // 2, 32) and panels.is_contiguous()
    assert torch.equal(unpack_bf16_panels(panels, n), w)
    c = (n - 1) % 16  # the last channel's last pair: in its panel's last pair-row, at 2c, 2c + 1
    assert torch.equal(panels[-1, -1, 2 * c:2 * c + 2], w[n - 1, k - 2:])
    assert not unpack_bf16_panels(panels, panels.shape[0] * 16)[n:].any()  # the padding channels are zeros
    with pytest.raises(ValueError, match="even in_features"):
        pack_bf16_panels(torch.randn(4, 5).bfloat16())


def _fp32_sum_bound(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|bf16_linear - exact| allowed: bf16 products are exact in fp32, the fp32 sums of K terms err by at most
    K eps32 sum |x w|, and the result is rounded to bf16 once (half an ulp, 2^-9 relative)."""
    k = x.shape[-1]
    return ref.abs() * 2.0 ** -8 + k * 2.0 ** -23 * (x.double().abs() @ w.double().abs().T) + 1e-30


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows, n, k", [(1, 40, 64), (2, 33, 66), (3, 16, 2), (4, 17, 96), (5, 100, 600),
                                        (9, 1, 64), (1, 49, 1536), (200, 48, 1536), (0, 40, 64)])
def test_bf16_linear_is_the_exact_product_rounded_once(bf16_dot, rows, n, k, bias):
    """`bf16_linear` against the float64 product of the same bf16 values: within the fp32 sum's error and
    one bf16 rounding, for tiles of 1-4 rows and their tails, panels cut short (N not a multiple of 16, one
    panel of a pair), K of one pair and K past a row block (200 x 1536: three blocks of 84 rows)."""
    torch.manual_seed(rows * 7 + n + k)
    w, x = torch.randn(n, k).bfloat16(), torch.randn(rows, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    state = bf16_dot.prepare(w)
    assert isinstance(state, Bf16Panels) and state.n == n
    y = bf16_dot.apply(state, x, b)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    assert ((y.double() - ref).abs() <= _fp32_sum_bound(x, w, ref) + (ref.abs() * 2.0 ** -8 if bias else 0)).all()
    if rows:
        err = (y.double() - ref).abs().max()
        assert err < 0.1 * ref.abs().max()  # not zeros, not another channel's sums


def test_bf16_linear_leading_dims_other_dtypes_and_rows_of_nan(bf16_dot):
    torch.manual_seed(0)
    w, b = torch.randn(40, 64).bfloat16(), torch.randn(40).bfloat16()
    state = bf16_dot.prepare(w)
    x = torch.randn(2, 3, 64).bfloat16()
    y = bf16_dot.apply(state, x, b)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y, bf16_dot.apply(state, x.reshape(6, 64), b).view(2, 3, 40), atol=0, rtol=0)
    x32 = torch.randn(3, 64)  # fp32 activations on a bf16 weight: through bf16 and back
    y32 = bf16_dot.apply(state, x32, b.float())
    assert y32.dtype == torch.float32
    torch.testing.assert_close(y32, bf16_dot.apply(state, x32.bfloat16(), b).float(), atol=0, rtol=0)
    x[1, 2, 5] = float("nan")
    y = bf16_dot.apply(state, x, b)
    assert y[1, 2].isnan().all() and not y.view(6, 40)[[0, 1, 2, 3, 4]].isnan().any()


def test_bf16_linear_routes_only_even_bf16_weights(bf16_dot):
    assert isinstance(bf16_dot.prepare(torch.randn(8, 64).bfloat16()), Bf16Panels)
    assert not isinstance(bf16_dot.prepare(torch.randn(8, 63).bfloat16()), Bf16Panels)  # odd K: oneDNN / F.linear
    assert not isinstance(bf16_dot.prepare(torch.randn(8, 64)), Bf16Panels)  # fp32


def test_bf16_linear_reload_refreshes_the_panels_in_place(bf16_dot):
    """`--dynamic_load_weight`: a compiled step holds the panels tensor, so new weights go into it."""
    w, w2, x = torch.randn(24, 64).bfloat16(), torch.randn(24, 64).bfloat16(), torch.randn(2, 64).bfloat16()
    state = bf16_dot.prepare(w)
    panels = state.panels
    assert bf16_dot.reload(state, w2) is state and state.panels is panels
    torch.testing.assert_close(bf16_dot.apply(state, x, None), bf16_dot.apply(bf16_dot.prepare(w2), x, None),
                               atol=0, rtol=0)
    wider = bf16_dot.reload(state, torch.randn(32, 64).bfloat16())  # another shape: a fresh state
    assert wider.n == 32


@pytest.mark.skipif(not kernels.available(), reason="CPU kernels not built")
def test_bf16_linear_refuses_mismatched_inputs():
    panels = pack_bf16_panels(torch.randn(40, 64).bfloat16())
    op = torch.ops.heterollm_cpu.bf16_linear
    with pytest.raises(RuntimeError, match="x and panels must be bfloat16"):
        op(torch.randn(2, 64), panels, 40, None)
    with pytest.raises(RuntimeError, match="x has 62 features, the panels 64"):
        op(torch.randn(2, 62).bfloat16(), panels, 40, None)
    with pytest.raises(RuntimeError, match="3 panels hold 33-48 output channels, not 49"):
        op(torch.randn(2, 64).bfloat16(), panels, 49, None)
    with pytest.raises(RuntimeError, match="bias must be a vector of 40"):
        op(torch.randn(2, 64).bfloat16(), panels, 40, torch.randn(39).bfloat16())
    with pytest.raises(RuntimeError, match="contiguous"):
        op(torch.randn(2, 64).bfloat16(), panels.transpose(0, 1), 40, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wint8_error_is_int8_sized(dtype):
    torch.manual_seed(0)
    w, x = torch.randn(128, 96, dtype=dtype), torch.randn(5, 96, dtype=dtype)
    method = WeightOnlyInt8()
    codes, scale = method.prepare(w)
    assert codes.dtype == torch.int8 and codes.abs().max() <= 127
    err = _rel_err(method.apply((codes, scale), x, None), F.linear(x.float(), w.float()))
    assert 1e-4 < err < 0.02  # quantized (not a pass-through) and within int8 error


def _w8a8_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|y - x @ w.T| for W8A8 with round-to-nearest codes, worked out by hand: with x = sx (qx + ex),
    w = sw (qw + ew), |ex|, |ew| <= 1/2, the product's error per term is
    |x| sw/2 + |w| sx/2 + sx sw/4, summed over K (sx = max|x row| / 127, sw = max|w row| / 127)."""
    x, w = x.double(), w.double()
    sx = x.abs().amax(-1, keepdim=True) / 127  # (M, 1)
    sw = w.abs().amax(-1) / 127  # (N)
    return sw / 2 * x.abs().sum(-1, keepdim=True) + sx / 2 * w.abs().sum(-1) + sx * sw / 4 * x.shape[-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_error_within_its_quantization_bound(dtype):
    """W8A8 against the float64 product: inside the hand-derived bound everywhere (plus the output's
    rounding to bf16), and quantized (not a pass-through of the float weights or activations)."""
    torch.manual_seed(0)
    w, x = torch.randn(80, 96, dtype=dtype), torch.randn(6, 96, dtype=dtype)
    x[2] *= 50  # rows of very different ranges: each row its own scale
    x[3, 7] = 40  # an outlier widens its own row's scale only
    method = DynamicInt8()
    state = method.prepare(w)  # whichever kernel this CPU takes: its layout of int8_per_channel's codes
    codes, scale = int8_per_channel(w)
    assert codes.dtype == torch.int8 and codes.abs().max() == 127 and torch.equal(state[1], scale)
    y = method.apply(state, x, None)
    exact = F.linear(x.double(), w.double())
    rounding = exact.abs() * (2 ** -8 if dtype == torch.bfloat16 else 1e-6)
    assert ((y.double() - exact).abs() <= _w8a8_bound(x, w) + rounding + 1e-6).all()
    # quantized, not a pass-through: well above what the float product in this dtype gets wrong
    assert _rel_err(y, exact.float()) > 3 * _rel_err(F.linear(x, w), exact.float())


@pytest.mark.skipif(not kernels.available(), reason="CPU kernels not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64, 48), (7, 100, 37), (2, 3, 96, 40), (300, 64, 40), (0, 64, 40),
                                   "strided"])
def test_w8a8_kernel_is_its_torch_reference(dtype, shape):
    """The C++ op computes linear.py's torch path operation for operation: the same int8 codes and
    integer sums, so the outputs differ by at most the rounding of the last steps (the compiler may
    reorder the two scale products and fuse the bias into an FMA: an ulp or two of the larger term);
    rows of zeros and leading dimensions included."""
    torch.manual_seed(1)
    if shape == "strided":  # every second column of a wider tensor: rows of stride 128
        k, n, lead = 64, 40, [5]
        x = torch.randn(5, 128, dtype=dtype)[:, ::2]
    else:
        *lead, k, n = shape
        x = torch.randn(*lead, k, dtype=dtype)
    w, b = torch.randn(n, k, dtype=dtype), torch.randn(n, dtype=dtype)
    if x.numel():
        (x.view(-1, k) if x.is_contiguous() else x)[0] = 0
    codes, scale = int8_per_channel(w)
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -22
    for bias in (None, b):
        y, r = torch.ops.heterollm_cpu.w8a8_linear(x, codes, scale, bias), w8a8_reference(x, codes, scale, bias)
        assert y.shape == (*lead, n) and y.dtype == dtype
        if not y.numel():
            continue
        assert (y.reshape(-1, n)[0] == (0 if bias is None else b)).all()
        larger = r.abs().float() + (0 if bias is None else b.abs().float())
        assert ((y.float() - r.float()).abs() <= larger * ulp).all()
        # an int8 code off by one would move the output by a whole weight step: far more than the ulps
        assert ((y.float() - r.float()).abs() <= 1e-3 * r.abs().float().max()).all()
    assert torch.equal(torch.ops.heterollm_cpu.w8a8_linear(x, codes, scale, None),
                       torch.ops.heterollm_cpu.w8a8_linear(x.contiguous(), codes, scale, None))


@pytest.mark.parametrize("path", ["method", "reference"])
def test_w8a8_hand_worked_codes_and_scales(path):
    """Codes and integer sums worked out by hand. Weights: w0 = [1, 0.5, -0.25, 0.3] has scale 1/127 and
    codes [127, 64, -32, 38] (63.5 and -31.75 round to nearest); w1 = [0, 0, 1, -1] codes [0, 0, 127, -127].
    Activations, each row its own scale: x0 = [127, 2.5, -0.5, 0] (scale 1) codes [127, 2, 0, 0] (2.5 and
    -0.5 round half to even); x1 = [2, -1, 0.5, 0] (scale 2/127) codes [127, -64, 32, 0]; a row of zeros
    gives zeros. Sums: x0.w0 = 127*127 + 2*64 = 16257, x0.w1 = 0, x1.w0 = 16129 - 4096 - 1024 = 11009,
    x1.w1 = 32*127 = 4064; y = sum * x scale * w scale. The four columns sit twice in 20, at 0-3 (the
    kernel's 16-wide vector loop) and at 16-19 (its scalar tail), zeros between: every sum doubles."""
    w4 = torch.tensor([[1.0, 0.5, -0.25, 0.3], [0.0, 0.0, 1.0, -1.0]])
    x4 = torch.tensor([[127.0, 2.5, -0.5, 0.0], [2.0, -1.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])
    w, x = torch.zeros(2, 20), torch.zeros(3, 20)
    w[:, :4] = w[:, 16:] = w4
    x[:, :4] = x[:, 16:] = x4
    codes, scale = int8_per_channel(w)
    assert codes[:, :4].tolist() == codes[:, 16:].tolist() == [[127, 64, -32, 38], [0, 0, 127, -127]]
    method = DynamicInt8()
    y = method.apply(method.prepare(w), x, None) if path == "method" else w8a8_reference(x, codes, scale, None)
    sums = 2 * torch.tensor([[16257, 0], [11009, 4064], [0, 0]], dtype=torch.float64)
    expected = sums * torch.tensor([[1.0], [2 / 127], [1.0]], dtype=torch.float64) / 127
    torch.testing.assert_close(y.double(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("path", ["method", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_rows_with_nan_or_infinity_give_nan_and_tiny_rows_zero(path, dtype):
    """A NaN or an infinity anywhere in a row (in the vector loop's columns or the tail's) makes that
    row's outputs NaN, as F.linear's would be, and leaves the other rows alone; a row too small to
    scale (under 127 / FLT_MAX) gives zeros."""
    torch.manual_seed(2)
    w, x = torch.randn(8, 20), torch.randn(6, 20)
    x[0, 3], x[1, 18], x[2, 5], x[3, 17] = float("nan"), float("nan"), float("inf"), float("-inf")
    x[4] = 1e-38
    x, w = x.to(dtype), w.to(dtype)
    codes, scale = int8_per_channel(w)
    method = DynamicInt8()
    y = method.apply(method.prepare(w), x, None) if path == "method" else w8a8_reference(x, codes, scale, None)
    assert y[:4].isnan().all()
    assert (y[4] == 0).all()
    assert y[5].isfinite().all() and _rel_err(y[5:], F.linear(x[5:].float(), w.float())) < 0.02


def test_w8a8_takes_float_weights_only():
    with pytest.raises(ValueError, match=r"--quantization=w8a8: takes float32 or bfloat16 weights, not torch.float16"):
        DynamicInt8().prepare(torch.randn(16, 32, dtype=torch.float16))


@pytest.mark.parametrize("built", [True, False])
@pytest.mark.parametrize("flags, slow", [({"avx2", "fma"}, True), ({"avx2", "avx512_vnni"}, False),
                                          ({"avx2", "avx_vnni"}, False), ({"avx2", "amx_int8"}, False),
                                          ({"asimd"}, False)])
def test_w8a8_on_an_x86_cpu_without_int8_dot_products(monkeypatch, caplog, flags, slow, built):
    """Measured on an AVX2-only EPYC: torch._int_mm 45x slower than the float32 GEMM, w8a8 offline 20x
    slower than float32. There the AVX2 kernel `int8_gemm` takes over where the kernels are built (the
    method packs its panels); without them the launch says so once (the method is built once per load)."""
    import heterollm_cpu.linear as cpu_linear

    monkeypatch.setattr(cpu_linear, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(kernels, "available", lambda: built)
    with caplog.at_level(logging.WARNING, logger="heterollm.cpu.linear"):
        method = DynamicInt8()
    assert method.panels == (slow and built)
    assert method.dot == ("avx512_vnni" in flags and "amx_int8" not in flags and built)
    assert ("--quantization w8a8: this CPU has no int8 dot-product instructions (VNNI or AMX-int8)" in caplog.text) \
        == (slow and not built)


needs_int8_gemm = pytest.mark.skipif(not kernels.available() or "avx2" not in kernels.vector_features(),
                                     reason="int8_gemm runs on the CPU kernels of an AVX2 CPU")


@pytest.mark.parametrize("n, k", [(40, 64), (33, 65), (16, 2), (100, 600), (7, 1)])
def test_int8_panels_round_trip(n, k):
    """`pack_int8_panels` puts codes[16p + c, 2j + i] at panels[p, j, c, i]; padding rows and columns are zero."""
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    panels = pack_int8_panels(codes)
    assert panels.shape == ((n + 15) // 16, (k + 1) // 2, 16, 2) and panels.is_contiguous()
    assert torch.equal(unpack_int8_panels(panels, n, k), codes)
    p, j, c, i = (n - 1) // 16, (k - 1) // 2, (n - 1) % 16, (k - 1) % 2
    assert panels[p, j, c, i] == codes[n - 1, k - 1]
    assert panels.sum(dtype=torch.int64) == codes.sum(dtype=torch.int64)


def _activation_bound(x: torch.Tensor, w: torch.Tensor, qmax: int) -> torch.Tensor:
    """|y - x @ w.T| when only x is rounded, per row to a step of s = max |x row| / qmax: each term is off
    by at most |w| s / 2, summed over K (w: the weights the codes stand for)."""
    s = x.double().abs().amax(-1, keepdim=True) / qmax
    return s / 2 * w.double().abs().sum(-1)


@needs_int8_gemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qmax", [127, 32767])
@pytest.mark.parametrize("rows, n, k", [(1, 40, 64), (2, 33, 65), (5, 16, 37), (6, 48, 600), (7, 100, 1536),
                                        (13, 24, 576), (200, 70, 1536), (0, 40, 64)])
def test_int8_gemm_is_the_codes_product_within_the_activation_rounding(dtype, qmax, rows, n, k):
    """The kernel against F.linear on the weights its codes stand for, in float64: off by no more than
    the activations' rounding to [-qmax, qmax] per row (worked out by hand) plus the output's rounding.
    Covered: tiles of 1-6 rows and their tails, several row blocks (200 rows of 1536), panels with a
    partial last one (33, 40, 70, 100 channels), an odd K (a padded pair), sums over more than the
    kernel's 256-feature int32 chunks (600, 1536), bias and no bias, no rows."""
    torch.manual_seed(rows * 7 + n)
    w, b = torch.randn(n, k), torch.randn(n)
    x = torch.randn(rows, k)
    if rows > 1:
        x[1] *= 40  # each row its own scale
    codes, scale = int8_per_channel(w)
    wq = codes.double() * scale.double()[:, None]
    x, b = x.to(dtype), b.to(dtype)
    for bias in (None, b):
        y = torch.ops.heterollm_cpu.int8_gemm(x, pack_int8_panels(codes), scale, qmax, bias)
        assert y.shape == (rows, n) and y.dtype == dtype
        exact = x.double() @ wq.t() + (0 if bias is None else bias.double())
        rounding = exact.abs() * (2 ** -8 if dtype == torch.bfloat16 else 1e-6) + 1e-5
        assert ((y.double() - exact).abs() <= _activation_bound(x, wq, qmax) + rounding).all()
    if rows and qmax == 32767:  # 16-bit activations: far inside wint8's weight error
        assert ((y.double() - exact).abs().max() / exact.abs().max()).item() < (1e-2 if dtype == torch.bfloat16 else 1e-4)


@needs_int8_gemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_gemm_at_qmax_127_is_w8a8(dtype):
    """At qmax 127 the kernel quantizes the rows as w8a8 does and makes the same integer sums: it equals
    `w8a8_reference` up to the last steps' rounding, with leading dimensions and strided rows."""
    torch.manual_seed(3)
    w, b = torch.randn(72, 96, dtype=dtype), torch.randn(72, dtype=dtype)
    x = torch.randn(3, 4, 192, dtype=dtype)[..., ::2]
    codes, scale = int8_per_channel(w)
    y = torch.ops.heterollm_cpu.int8_gemm(x, pack_int8_panels(codes), scale, 127, b)
    r = w8a8_reference(x, codes, scale, b)
    assert y.shape == r.shape == (3, 4, 72)
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -22
    assert ((y.float() - r.float()).abs() <= (r.abs().float() + b.abs().float()) * ulp * 2).all()


@pytest.mark.parametrize("op", ["int8_gemm", "int8_dot_gemm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kernels_rows_with_nan_or_infinity_give_nan_and_tiny_rows_zero(op, dtype):
    """A NaN or an infinity in a row (in the vector loop's columns or the tail's) makes that row NaN and
    leaves the others alone; a row of zeros or too small to scale gives the bias."""
    if not kernels.available() or (op == "int8_gemm" and "avx2" not in kernels.vector_features()):
        pytest.skip(f"{op} needs the CPU kernels" + (" of an AVX2 CPU" if op == "int8_gemm" else ""))
    torch.manual_seed(4)
    w, b, x = torch.randn(20, 21), torch.randn(20), torch.randn(7, 21)
    x[0, 3], x[1, 18], x[2, 5], x[3, 20] = float("nan"), float("nan"), float("inf"), float("-inf")
    x[4], x[5] = 1e-38, 0
    codes, scale = int8_per_channel(w)
    if op == "int8_gemm":
        y = torch.ops.heterollm_cpu.int8_gemm(x.to(dtype), pack_int8_panels(codes), scale, 32767, b.to(dtype))
    else:
        panels, w_sums = pack_int8_quads(codes)
        y = torch.ops.heterollm_cpu.int8_dot_gemm(x.to(dtype), panels, scale, w_sums, b.to(dtype))
    assert y[:4].isnan().all()
    assert torch.equal(y[4:6].float(), b.to(dtype).float().expand(2, -1))
    assert y[6].isfinite().all() and _rel_err(y[6:], F.linear(x[6:], w, b)) < 0.02


@needs_int8_gemm
def test_int8_gemm_refuses_mismatched_inputs():
    codes, scale = int8_per_channel(torch.randn(20, 30))
    panels = pack_int8_panels(codes)
    with pytest.raises(RuntimeError, match="does not match the panels' 30 features"):
        torch.ops.heterollm_cpu.int8_gemm(torch.randn(2, 28), panels, scale, 127, None)
    with pytest.raises(RuntimeError, match="panels hold 2 panels of 16, w_scale 40 channels"):
        torch.ops.heterollm_cpu.int8_gemm(torch.randn(2, 30), panels, torch.ones(40), 127, None)
    with pytest.raises(RuntimeError, match=r"qmax must be in \[1, 32767\]"):
        torch.ops.heterollm_cpu.int8_gemm(torch.randn(2, 30), panels, scale, 40000, None)


@pytest.mark.parametrize("n, k", [(40, 64), (33, 65), (16, 4), (100, 600), (7, 1), (5, 6)])
def test_int8_quads_round_trip(n, k):
    """`pack_int8_quads` puts codes[16p + c, 4j + i] at panels[p, j, c, i] (zero padding rows and columns)
    and w_sums = 128 * each channel's sum of codes."""
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    panels, w_sums = pack_int8_quads(codes)
    assert panels.shape == ((n + 15) // 16, (k + 3) // 4, 16, 4) and panels.is_contiguous()
    assert torch.equal(unpack_int8_quads(panels, n, k), codes)
    p, j, c, i = (n - 1) // 16, (k - 1) // 4, (n - 1) % 16, (k - 1) % 4
    assert panels[p, j, c, i] == codes[n - 1, k - 1]
    assert panels.sum(dtype=torch.int64) == codes.sum(dtype=torch.int64)
    assert w_sums.dtype == torch.int32 and w_sums.tolist() == (128 * codes.long().sum(1)).tolist()


needs_kernels = pytest.mark.skipif(not kernels.available(), reason="CPU kernels not built")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, n, k", [(1, 40, 64), (2, 33, 65), (8, 16, 37), (9, 48, 600), (17, 100, 1536),
                                        (300, 24, 1536), (0, 40, 64), (3, 16, 5)])
def test_int8_dot_gemm_makes_w8a8s_integer_sums(dtype, rows, n, k):
    """`int8_dot_gemm` (AVX512-VNNI's byte dot product where the CPU has it, a scalar loop elsewhere) quantizes
    the rows as w8a8 does and makes the same integer sums as torch's _int_mm: it equals `w8a8_reference` up
    to the last steps' rounding (an int8 code or a sum off by one would move an output by a whole weight
    step). Covered: tiles of 1-8 rows and their tails, two row blocks (300 rows of 1536), partial last panels,
    K padded to a multiple of 4 (65, 37, 5), bias and none, rows of zeros, leading dimensions, no rows."""
    torch.manual_seed(rows * 5 + n)
    w, b = torch.randn(n, k, dtype=dtype), torch.randn(n, dtype=dtype)
    x = torch.randn(rows, k, dtype=dtype)
    if rows > 1:
        x[1] *= 40  # each row its own scale
        x[0] = 0
    codes, scale = int8_per_channel(w)
    panels, w_sums = pack_int8_quads(codes)
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -22
    for bias in (None, b):
        y = torch.ops.heterollm_cpu.int8_dot_gemm(x, panels, scale, w_sums, bias)
        r = w8a8_reference(x, codes, scale, bias)
        assert y.shape == (rows, n) and y.dtype == dtype
        if not rows:
            continue
        larger = r.abs().float() + (0 if bias is None else b.abs().float())
        assert ((y.float() - r.float()).abs() <= larger * ulp * 2).all()
    lead = x.view(1, rows, k) if rows % 2 else x.view(-1, 2, k) if rows else x.view(0, 5, k)
    assert torch.equal(torch.ops.heterollm_cpu.int8_dot_gemm(lead, panels, scale, w_sums, None).reshape(rows, n),
                       torch.ops.heterollm_cpu.int8_dot_gemm(x, panels, scale, w_sums, None))


@needs_kernels
def test_int8_dot_gemm_sums_past_one_int32_chunk():
    """K beyond the kernel's 65,536-feature int32 chunk (16,384 quads): each chunk's exact int32 sum, then
    added in fp32. At the largest codes (x all 127 after scaling, w all +-127) one chunk alone would
    overflow int32 without the split's bound: checked against the float64 product of the codes."""
    k, n = 65536 + 12, 16
    codes = torch.full((n, k), 127, dtype=torch.int8)
    codes[1::2] = -127
    scale = torch.full((n,), 1 / 127)
    x = torch.ones(2, k)
    x[1, ::3] = -1
    panels, w_sums = pack_int8_quads(codes)
    y = torch.ops.heterollm_cpu.int8_dot_gemm(x, panels, scale, w_sums, None)
    exact = (x.double() * 127).round() @ codes.double().t() * (1 / 127) * (1 / 127)
    assert (y.double() - exact).abs().max() <= exact.abs().max() * 2 ** -22


@needs_kernels
def test_int8_dot_gemm_refuses_mismatched_inputs():
    codes, scale = int8_per_channel(torch.randn(20, 30))
    panels, w_sums = pack_int8_quads(codes)
    with pytest.raises(RuntimeError, match="does not match the panels' 32 features"):
        torch.ops.heterollm_cpu.int8_dot_gemm(torch.randn(2, 28), panels, scale, w_sums, None)
    with pytest.raises(RuntimeError, match="panels hold 2 panels of 16, w_scale 40 channels"):
        torch.ops.heterollm_cpu.int8_dot_gemm(torch.randn(2, 30), panels, torch.ones(40), torch.zeros(40, dtype=torch.int32), None)
    with pytest.raises(RuntimeError, match=r"w_sums must be \(N\) int32"):
        torch.ops.heterollm_cpu.int8_dot_gemm(torch.randn(2, 30), panels, scale, w_sums.float(), None)
    with pytest.raises(RuntimeError, match=r"panels must be \(P, ceil\(K / 4\), 16, 4\) int8"):
        torch.ops.heterollm_cpu.int8_dot_gemm(torch.randn(2, 30), pack_int8_panels(codes), scale, w_sums, None)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_w8a8_on_int8_dot_gemm_is_its_torch_path(monkeypatch, dtype):
    """With AVX512-VNNI (forced here, so any CPU runs the route: the op's scalar loop without VNNI) w8a8 packs
    quads and runs `int8_dot_gemm`: the same numbers as `w8a8_reference`, leading dimensions and bias kept;
    float16 goes through fp32."""
    import heterollm_cpu.linear as cpu_linear

    monkeypatch.setattr(cpu_linear, "_cpu_flags", lambda: {"avx2", "avx512f", "avx512_vnni"})
    method = DynamicInt8()
    assert method.dot and not method.panels
    torch.manual_seed(6)
    w, b, x = torch.randn(40, 96), torch.randn(40), torch.randn(2, 5, 96)
    weight = w.to(dtype) if dtype != torch.float16 else w  # w8a8 takes fp32 or bf16 weights
    state = method.prepare(weight)
    assert len(state) == 3 and state[0].shape == (3, 24, 16, 4)
    y = method.apply(state, x.to(dtype), b.to(dtype))
    codes, scale = int8_per_channel(weight)
    r = w8a8_reference(x.to(dtype), codes, scale, b.to(dtype)).float()
    assert y.dtype == dtype and y.shape == (2, 5, 40)
    ulp = 2 ** -22 if dtype == torch.float32 else 2 ** -10 if dtype == torch.float16 else 2 ** -7
    assert ((y.float() - r).abs() <= (r.abs() + b.to(dtype).float().abs()) * ulp * 2).all()


@pytest.fixture(params=["kernel", "torch"])
def int8_path(request, monkeypatch):
    """wint8 on `heterollm_cpu::int8_gemm` (the kernels on an AVX2 CPU) or on torch's `_weight_int8pack_mm`."""
    if request.param == "kernel" and (not kernels.available() or "avx2" not in kernels.vector_features()):
        pytest.skip("int8_gemm runs on the CPU kernels of an AVX2 CPU")
    if request.param == "torch":
        monkeypatch.setattr(kernels, "available", lambda: False)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_wint8_both_paths_are_the_codes_product(int8_path, dtype):
    """Either path multiplies by the weights the codes stand for (within the activations' 16-bit rounding
    on the kernel, the dtype's rounding on torch's), with bias; float16 goes through the kernel in fp32."""
    if int8_path == "torch" and dtype == torch.float16:
        pytest.skip("torch's _weight_int8pack_mm takes fp32 / bf16")
    torch.manual_seed(5)
    w, b, x = torch.randn(40, 96), torch.randn(40), torch.randn(9, 96)
    method = WeightOnlyInt8()
    state = method.prepare(w.to(dtype))
    assert state[0].dim() == (4 if int8_path == "kernel" else 2)
    codes, scale = int8_per_channel(w.to(dtype))
    ref = F.linear(x.double(), codes.double() * scale.double()[:, None], b.double())
    y = method.apply(state, x.to(dtype), b.to(dtype))
    assert y.dtype == dtype and y.shape == (9, 40)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < tol


@needs_int8_gemm
def test_int8_gemm_traces_under_torch_compile():
    """The op has a shape rule: a compiled step (--enable_graph) takes it into its graph."""
    method = WeightOnlyInt8()
    state = method.prepare(torch.randn(40, 64))
    x = torch.randn(3, 64)
    compiled = torch.compile(lambda t: method.apply(state, t, None), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), method.apply(state, x, None))


def _int4_route(route: str, monkeypatch) -> str:
    import heterollm_cpu.linear as cpu_linear

    if route != "torch" and not kernels.available():
        pytest.skip("CPU kernels not built")
    flags = {"avx2", "fma"} | ({"avx512f", "avx512_vnni"} if route == "dot" else set())
    monkeypatch.setattr(cpu_linear, "_cpu_flags", lambda: flags)
    if route == "torch":
        monkeypatch.setattr(kernels, "available", lambda: False)
    assert WeightOnlyInt4().dot == (route == "dot")
    return route


@pytest.fixture(params=["kernel", "dot", "torch"])
def int4_path(request, monkeypatch):
    """wint4 on the C++ kernel of AVX2 CPUs (`heterollm_cpu::int4_linear`), on the AVX512-VNNI one
    (`int4_dot_linear`: the CPU flags forced, so any CPU runs the route, its scalar loop without VNNI), or
    on torch's int4 kernel (no CPU kernels built)."""
    return _int4_route(request.param, monkeypatch)


@pytest.fixture(params=["kernel", "dot"])
def int4_kernel_path(request, monkeypatch):
    """`int4_path`'s two C++ kernels."""
    return _int4_route(request.param, monkeypatch)


def int4_dot_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
                       group: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`heterollm_cpu::int4_dot_linear` in torch ops, in float64 after the activation codes: each
    group of a row of x quantized as quantize_rows.h does (fp32: s = max |x| / 127, q = round(x * (127 / max))
    half to even; a group of zeros: q = 0, s = 1; a NaN or an infinity: s = NaN), y = sum_g (q . code) * s *
    scale + min * (the group's sum of x), with the (N, K / G) scales and minima as the kernel holds them."""
    k, n = x.shape[-1], codes.shape[0]
    g = x.reshape(-1, k).float().view(-1, k // group, group)
    amax = g.abs().amax(-1, keepdim=True)
    finite = g.isfinite().all(-1, keepdim=True)
    live = finite & (amax > torch.tensor(127, dtype=torch.float32) / torch.finfo(torch.float32).max)
    inv = torch.where(live, torch.full_like(amax, 127).div_(amax), torch.zeros_like(amax))
    q = torch.where(live, g * inv, 0).round_().clamp_(-127, 127)
    s = torch.where(live, amax * (1 / 127), torch.where(finite, 1.0, float("nan")))[..., 0]  # (rows, G)
    dot = torch.einsum("rgf,ngf->rng", q.double(), codes.view(n, k // group, group).double())
    y = (dot * (s.double()[:, None, :] * scale.double()[None])).sum(-1)
    y = y + (g.double().sum(-1)[:, None, :] * low.double()[None]).sum(-1)
    if bias is not None:
        y = y + bias.double()
    return y.view(*x.shape[:-1], n)


def test_wint4_reproduces_q4_1_weights_exactly(int4_path):
    """Weights that are already 4-bit per group of 32 (as a dequantized Q4_1 GGUF is) survive
    wint4 unchanged: the result equals F.linear up to fp32 rounding."""
    torch.manual_seed(0)
    n, k = 64, 128
    codes = torch.randint(0, 16, (n, k // 32, 32))
    codes[..., 0], codes[..., 1] = 0, 15  # each group spans the full code range
    scale, low = torch.rand(n, k // 32, 1) * 0.1 + 0.01, torch.randn(n, k // 32, 1)
    w = (codes * scale + low).view(n, k)
    x = torch.randn(3, k)
    method = WeightOnlyInt4()
    state = method.prepare(w)
    assert len(state) == (3 if int4_path == "torch" else 5)
    y = method.apply(state, x, None)
    if int4_path != "dot":
        torch.testing.assert_close(y, F.linear(x, w), atol=1e-3, rtol=1e-4)
        return
    # the codes survive exactly, the scales and minima to fp16; x goes in as int8 per group of 32
    from heterollm_cpu.linear import dequantize_int4_panels, unpack_int4_quads

    assert torch.equal(unpack_int4_quads(state[0], n), codes.view(n, k).to(torch.uint8))
    torch.testing.assert_close(dequantize_int4_panels(*state), w, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(y, F.linear(x, w), atol=0.02 * F.linear(x, w).abs().max().item(), rtol=0)


def test_wint4_error_on_random_weights_and_bias(int4_path):
    torch.manual_seed(0)
    w, b, x = torch.randn(64, 96, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16), torch.randn(
        4, 96, dtype=torch.bfloat16)
    method = WeightOnlyInt4()
    err = _rel_err(method.apply(method.prepare(w), x, b), F.linear(x.float(), w.float(), b.float()))
    assert 0.005 < err < 0.12


@pytest.mark.skipif(not kernels.available(), reason="CPU kernels not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 100, 128, 129])  # tiles of 3 rows and their tails; > 128: dequantize + GEMM
@pytest.mark.parametrize("n, k, group", [(40, 64, 32), (96, 256, 128), (24, 192, 64), (16, 32, 32)])
def test_int4_kernel_is_the_dequantized_weights_product(dtype, rows, n, k, group):
    """`heterollm_cpu::int4_linear` against F.linear on the weight its codes stand for (in float64): any
    output width (a partial last panel), groups wider than 32 features, the bias added, x's dtype kept."""
    from heterollm_cpu.linear import dequantize_int4_panels, pack_int4_panels

    torch.manual_seed(rows)
    codes = torch.randint(0, 16, (n, k))
    scale, low = torch.rand(n, k // group) * 0.1 + 0.01, torch.randn(n, k // group)
    panels, scales, mins = pack_int4_panels(codes, scale, low)
    w = dequantize_int4_panels(panels, scales, mins, group, n)
    torch.testing.assert_close(w, (codes.float().view(n, -1, group) * scale[..., None] + low[..., None]).view(n, k))
    x, bias = torch.randn(rows, k, dtype=dtype), torch.randn(n, dtype=dtype)
    for b in (None, bias):
        y = torch.ops.heterollm_cpu.int4_linear(x.view(1, rows, k), panels, scales, mins, group, n, b)
        assert y.shape == (1, rows, n) and y.dtype == dtype
        ref = F.linear(x.double(), w.double(), None if b is None else b.double())
        tol = 1e-4 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(y[0].double(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.skipif(not kernels.available(), reason="CPU kernels not built")
@pytest.mark.parametrize("rows", [1, 4])
def test_int4_kernel_sums_a_wide_group_without_overflow(rows):
    """A group of 8,192 features (a GPTQ layer with one group per row) at the largest codes and
    activations: 4,096 pair products of 2 * 15 * 32767 would overflow int32, so the kernel adds its
    int32 sums into fp32 every 2,048 pairs."""
    from heterollm_cpu.linear import dequantize_int4_panels, pack_int4_panels

    n, k = 16, 8192
    codes = torch.full((n, k), 15)
    codes[1] = 0
    scale, low = torch.full((n, 1), 0.5), torch.zeros(n, 1)
    panels, scales, mins = pack_int4_panels(codes, scale, low)
    x = torch.ones(rows, k) * 3.0
    y = torch.ops.heterollm_cpu.int4_linear(x, panels, scales, mins, k, n, None)
    ref = F.linear(x.double(), dequantize_int4_panels(panels, scales, mins, k, n).double())
    assert ref[0, 0] == 15 * 0.5 * 3.0 * k and ref[0, 1] == 0
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-3)


@needs_kernels
@pytest.mark.parametrize("op", ["int4_linear", "int4_dot_linear"])
def test_int4_kernels_refuse_a_layout_that_does_not_match(op):
    from heterollm_cpu.linear import pack_int4_panels, pack_int4_quads

    codes, scale, low = torch.randint(0, 16, (40, 64)), torch.rand(40, 2), torch.rand(40, 2)
    panels, scales, mins = (pack_int4_panels if op == "int4_linear" else pack_int4_quads)(codes, scale, low)
    run = getattr(torch.ops.heterollm_cpu, op)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="not 50 channels"):
        run(x, panels, scales, mins, 32, 50, None)
    with pytest.raises(RuntimeError, match="does not match the panels' 64 features"):
        run(torch.randn(2, 96), panels, scales, mins, 32, 40, None)
    with pytest.raises(RuntimeError, match="scales must be contiguous"):
        run(x, panels, scales[:, :1], mins, 32, 40, None)
    if op == "int4_dot_linear":
        with pytest.raises(RuntimeError, match="multiple of 8"):
            run(x, panels, scales, mins, 12, 40, None)
        with pytest.raises(RuntimeError, match=r"scales must be contiguous \(P, K / group, 16\) float16"):
            run(x, panels, scales.float(), mins, 32, 40, None)
        with pytest.raises(RuntimeError, match=r"panels must be \(P, K / 8, 64\) uint8"):
            run(x, pack_int4_panels(codes, scale, low)[0], scales, mins, 32, 40, None)


@pytest.mark.parametrize("rows", [3, 140])  # the quantized path and the dequantize + GEMM path
def test_int4_kernel_keeps_a_nan_or_infinity_in_its_row(int4_kernel_path, rows):
    """A row of x with a NaN or an infinity gives outputs that are not numbers (NaN, or infinities as
    F.linear's may be), and only that row: another sequence of the batch keeps its numbers."""
    method = WeightOnlyInt4()
    state = method.prepare(torch.randn(48, 64))
    x = torch.randn(rows, 64)
    clean = method.apply(state, x, None)
    x[1, 3], x[2, 5] = float("nan"), float("inf")
    y = method.apply(state, x, None)
    assert not y[1:3].isfinite().any()
    torch.testing.assert_close(y[0], clean[0])
    torch.testing.assert_close(y[3:], clean[3:])


def _quads_as_rows(state: tuple) -> tuple[torch.Tensor, ...]:
    """A `pack_int4_quads` state back as (N, K) codes and (N, K / G) scales and minima (fp16 values)."""
    from heterollm_cpu.linear import unpack_int4_quads

    panels, scales, mins, group, n = state
    rows = lambda t: t.transpose(1, 2).reshape(-1, t.shape[1])[:n]  # noqa: E731
    return unpack_int4_quads(panels, n).long(), rows(scales), rows(mins), group


def test_wint4_float16_activations_go_through_the_kernel_in_fp32(int4_kernel_path):
    """--dtype float16: the kernels take fp32 / bf16, so fp16 rows (and bias) are widened, multiplied and
    rounded back, not the whole weight dequantized on every call."""
    from heterollm_cpu.linear import dequantize_int4_panels

    torch.manual_seed(0)
    method = WeightOnlyInt4()
    state = method.prepare(torch.randn(48, 64))
    x, b = torch.randn(3, 64, dtype=torch.float16), torch.randn(48, dtype=torch.float16)
    y = method.apply(state, x, b)
    assert y.dtype == torch.float16
    if int4_kernel_path == "dot":
        ref = int4_dot_reference(x.float(), *_quads_as_rows(state), b.float())
    else:
        ref = F.linear(x.double(), dequantize_int4_panels(*state).double(), b.double())
    torch.testing.assert_close(y.double(), ref, atol=2e-2, rtol=2e-3)


@pytest.mark.parametrize("n, k", [(40, 64), (16, 32), (33, 96), (100, 576)])
def test_int4_quads_round_trip(n, k):
    """`pack_int4_quads`: 64-byte octet rows of 16 channels (zero codes pad N), byte 4n + i holding features
    8t + i (low nibble) and 8t + 4 + i (high); the panel-major scales and minima in fp16."""
    from heterollm_cpu.linear import pack_int4_quads, unpack_int4_quads

    torch.manual_seed(n)
    codes, scale, low = torch.randint(0, 16, (n, k)), torch.rand(n, k // 32), torch.randn(n, k // 32)
    panels, scales, mins = pack_int4_quads(codes, scale, low)
    p = -(-n // 16)
    assert panels.shape == (p, k // 8, 64) and panels.dtype == torch.uint8
    assert scales.shape == mins.shape == (p, k // 32, 16) and scales.dtype == mins.dtype == torch.float16
    assert panels[0, 0, 4 * 1 + 2].item() == codes[1, 2].item() | codes[1, 6].item() << 4
    assert torch.equal(unpack_int4_quads(panels, n), codes.to(torch.uint8))
    back = _quads_as_rows((panels, scales, mins, 32, n))
    assert torch.equal(back[1], scale.half()) and torch.equal(back[2], low.half())
    assert not panels[n // 16:].any() if n % 16 == 0 else not unpack_int4_quads(panels, 16 * p)[n:].any()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 128])  # tiles of 4 rows and their tails
@pytest.mark.parametrize("n, k, group", [(40, 64, 32), (96, 256, 128), (24, 192, 64), (16, 32, 32), (33, 1536, 32)])
def test_int4_dot_linear_is_its_reference(dtype, rows, n, k, group):
    """`heterollm_cpu::int4_dot_linear` against `int4_dot_reference` (the same activation codes,
    the integer sums exact): any output width (a partial last panel), groups wider than 32, leading
    dimensions, the bias added, x's dtype kept."""
    from heterollm_cpu.linear import pack_int4_quads

    torch.manual_seed(rows * 7 + n)
    codes = torch.randint(0, 16, (n, k))
    scale, low = torch.rand(n, k // group) * 0.1 + 0.01, torch.randn(n, k // group)
    panels, scales, mins = pack_int4_quads(codes, scale, low)
    x, bias = torch.randn(rows, k, dtype=dtype), torch.randn(n, dtype=dtype)
    for b in (None, bias):
        y = torch.ops.heterollm_cpu.int4_dot_linear(x.view(1, rows, k), panels, scales, mins, group, n, b)
        assert y.shape == (1, rows, n) and y.dtype == dtype
        ref = int4_dot_reference(x, codes, scale.half(), low.half(), group, b)
        tol = 1e-5 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(y[0].double(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_dot_linear_takes_prefill_rows_in_blocks(dtype):
    """Prefill-sized inputs go through the same int8 products, in row blocks of 256 KB of codes (170 rows of
    1,536 features): 300 and 700 rows against `int4_dot_reference`."""
    from heterollm_cpu.linear import pack_int4_quads

    torch.manual_seed(1)
    n, k = 40, 1536
    codes, scale, low = torch.randint(0, 16, (n, k)), torch.rand(n, k // 32) * 0.1, torch.randn(n, k // 32)
    state = pack_int4_quads(codes, scale, low)
    for rows in (300, 700):
        x, b = torch.randn(rows, k, dtype=dtype), torch.randn(n, dtype=dtype)
        y = torch.ops.heterollm_cpu.int4_dot_linear(x, *state, 32, n, b)
        ref = int4_dot_reference(x, codes, scale.half(), low.half(), 32, b)
        tol = 1e-5 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(y.double(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 140])
def test_int4_dot_linear_sums_a_wide_group(rows):
    """One group of 8,192 features at the largest codes and activation codes (15 * 127 * 8,192 in int32)."""
    from heterollm_cpu.linear import pack_int4_quads

    n, k = 16, 8192
    codes = torch.full((n, k), 15)
    codes[1] = 0
    panels, scales, mins = pack_int4_quads(codes, torch.full((n, 1), 0.5), torch.zeros(n, 1))
    y = torch.ops.heterollm_cpu.int4_dot_linear(torch.full((rows, k), 3.0), panels, scales, mins, k, n, None)
    assert (y[:, 0] == 15 * 0.5 * 3.0 * k).all() and (y[:, 1] == 0).all()


def test_wint4_keeps_fp32_scales_for_a_layer_past_fp16s_range(int4_kernel_path):
    """The VNNI layout holds scales and minima in fp16: a layer whose groups reach past 65,504 is packed for
    `int4_linear` (fp32 scales) instead, and still gives F.linear's numbers to 4-bit precision."""
    torch.manual_seed(0)
    w = torch.randn(32, 64)
    w[3, 5] = 1e6
    method = WeightOnlyInt4()
    state = method.prepare(w)
    assert state[0].shape[-1] == 16 and state[1].dtype == torch.float32
    assert method.prepare(torch.randn(32, 64))[0].shape[-1] == (64 if int4_kernel_path == "dot" else 16)
    x = torch.randn(2, 64)
    assert _rel_err(method.apply(state, x, None), F.linear(x, w)) < 0.01


def test_int4_kernel_traces_under_torch_compile(int4_kernel_path):
    """The ops have a shape rule: a compiled step (--enable_graph) takes them into its graph."""
    torch.manual_seed(0)
    method = WeightOnlyInt4()
    state = method.prepare(torch.randn(48, 64))
    x = torch.randn(3, 64)
    compiled = torch.compile(lambda t: method.apply(state, t, None), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), method.apply(state, x, None))


def test_wint4_needs_group_multiple():
    with pytest.raises(ValueError, match="wint4.*not a multiple of the group size 32"):
        WeightOnlyInt4().prepare(torch.randn(8, 40))


def test_wint4_names_output_rows_the_kernel_cannot_pack(int4_path):
    """torch's int4 packing takes rows in sixteens: a layer of 40 (a tiny MLA latent) is refused with
    its size, not a kernel RuntimeError. The C++ kernel takes any width."""
    if int4_path == "torch":
        with pytest.raises(ValueError, match="wint4: out_features 40 is not a multiple of 16"):
            WeightOnlyInt4().prepare(torch.randn(40, 64))
    else:
        method = WeightOnlyInt4()
        x = torch.randn(2, 64)
        assert method.apply(method.prepare(torch.randn(40, 64)), x, None).shape == (2, 40)
    WeightOnlyInt4().prepare(torch.randn(48, 64))


def test_activation_falls_back_family_then_torch():
    """The cpu linear methods serve a plugin family that has none of its own; an op no family in
    the chain offers is unavailable, and asking for it names what is offered."""
    from heterollm_cpu.fused import register_ops

    register_ops()  # what a CPU launch does (the test then passes alone, not only after a launch)
    try:
        chosen = ops.activate("example", "cpu")
        assert chosen["linear.wint4"] == "cpu" and chosen["rms_norm"] == "cpu" and chosen["fused_moe"] == "torch"
        assert isinstance(select_linear_method("wint8"), WeightOnlyInt8)
        ops.activate("example")
        assert select_linear_method(None) is None  # torch's F.linear
        with pytest.raises(ValueError, match=r"--quantization=wint8: not supported .*offers: none"):
            select_linear_method("wint8")
        ops.activate("cpu")
        with pytest.raises(ValueError, match=r"--quantization=fp8: .*offers: w8a8, wint4, wint8"):
            select_linear_method("fp8")
    finally:
        ops.activate("cpu")


def test_prepare_keeps_tied_weights_and_counts_bytes():
    from heterollm.model_executor.layers import ColumnParallelLinear, ParallelLMHead, VocabParallelEmbedding
    from heterollm.model_executor.parallel import ParallelContext

    pctx = ParallelContext(0, 1, None)
    model = torch.nn.Module()
    model.embed = VocabParallelEmbedding(100, 64, pctx)
    model.head = ParallelLMHead(100, 64, pctx)
    model.head.weight = model.embed.weight
    model.proj = ColumnParallelLinear(64, 32, False, pctx)
    for p in model.parameters():
        p.data.normal_()
    before = model_bytes(model)
    assert prepare_linears(model, WeightOnlyInt8()) == 2
    assert model.embed.weight.numel() == 100 * 64  # still used by the embedding lookup
    assert model.proj.weight.numel() == 0
    after = model_bytes(model)
    assert after < before + 100 * 64 and after > 100 * 64 * 4
    ids = torch.tensor([1, 2])
    torch.testing.assert_close(model.head.logits(model.embed(ids)), model.embed(ids) @ model.embed.weight.t(),
                               atol=0.5, rtol=0.05)


def test_engine_rejects_unknown_quantization(tmp_path, cli):
    from helpers import build_tiny_model
    folder = build_tiny_model(tmp_path / "m", "llama")
    r = cli("generate", "--model", str(folder), "--prompt", "hi", "--quantization", "w4afp8", "--max_tokens", "2")
    assert r.rc == 2
    assert "--quantization=w4afp8: not supported by the selected backend (it offers: w8a8, wint4, wint8)" in r.err
    assert "Traceback" not in r.err


@pytest.mark.parametrize("quantization", ["wint8", "wint4", "w8a8"])
def test_quantized_tiny_model_tracks_unquantized(tmp_path, quantization, caplog):
    """A tiny model with quantized linears: per-token logprobs of the unquantized greedy
    continuation stay close (prompt logprobs compare the same positions for both)."""
    from heterollm import LLM, SamplingParams

    from helpers import build_tiny_model
    folder = build_tiny_model(tmp_path / "m", "llama")
    prompt = list(range(300, 340))
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    ref = LLM(str(folder), dtype="float32").generate([prompt], params)[0].prompt_logprobs[1:]
    with caplog.at_level(logging.INFO, logger="heterollm.runner"):
        llm = LLM(str(folder), dtype="float32", quantization=quantization)
    assert f"linear method {quantization}" in caplog.text
    got = llm.generate([prompt], params)[0].prompt_logprobs[1:]
    drift = max(abs(a.logprob - b.logprob) for a, b in zip(ref, got))
    assert 1e-5 < drift < {"wint8": 0.05, "w8a8": 0.1, "wint4": 0.5}[quantization]
