"""The CPU backend's fused rms_norm, silu_and_mul and rotary_embedding (csrc/fused_ops.cpp,
heterollm_cpu/fused.py): against float64 references written from the ops' definitions, bit for bit
against the registry's torch definitions in bf16 (the roundings a model sees), on the strided views
the models pass (q/k heads inside a fused qkv output, the halves of a gate_up output), and in the
registry of a CPU launch."""
import math

import pytest
import torch

from heterollm.model_executor import ops
from heterollm_cpu import fused, kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the CPU kernels are not built")


def _rms_ref(x, w, eps):
    x = x.double()
    return w.double() * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _silu_ref(g, u):
    g = g.double()
    return g / (1 + torch.exp(-g)) * u.double()


def _rope_ref(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    c, s = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _qkv(n, heads, kv_heads, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g) * 3).to(dtype)


@pytest.mark.parametrize("shape", [(1, 576), (37, 576), (5, 100), (300, 64)])
def test_rms_norm_matches_float64(shape):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g) * 5
    w = torch.randn(shape[-1], generator=g)
    out = torch.ops.heterollm_cpu.rms_norm(x, w, 1e-6)
    assert out.shape == x.shape and out.is_contiguous()
    torch.testing.assert_close(out.double(), _rms_ref(x, w, 1e-6), rtol=1e-5, atol=1e-5)


def test_rms_norm_of_head_views_inside_qkv():
    """Qwen3's q_norm / k_norm: (tokens, heads, head_dim) views with the qkv row stride."""
    qkv = _qkv(6, 8, 2, 64, torch.float32)
    w = torch.randn(64)
    q = qkv[:, :8 * 64].view(6, 8, 64)
    k = qkv[:, 8 * 64:10 * 64].view(6, 2, 64)
    for view in (q, k):
        assert not view.is_contiguous()
        torch.testing.assert_close(torch.ops.heterollm_cpu.rms_norm(view, w, 1e-6).double(),
                                   _rms_ref(view, w, 1e-6), rtol=1e-5, atol=1e-5)


def test_silu_and_mul_of_gate_up_halves_matches_float64():
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(9, 2 * 1536, generator=g) * 6
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.ops.heterollm_cpu.silu_and_mul(gate, up)
    assert out.shape == gate.shape and out.is_contiguous()
    torch.testing.assert_close(out.double(), _silu_ref(gate, up), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", [64, 128, 6])
def test_rotary_embedding_of_qk_heads_matches_float64(dim):
    qkv = _qkv(7, 9, 3, dim, torch.float32)
    x = qkv[:, :12 * dim].view(7, 12, dim)  # q and k heads side by side, as the decoder rotates them
    g = torch.Generator().manual_seed(3)
    angles = torch.randn(7, dim // 2, generator=g) * 10
    cos, sin = angles.cos(), angles.sin()
    out = torch.ops.heterollm_cpu.rotary_embedding(x, cos, sin)
    assert out.shape == x.shape and out.is_contiguous()
    torch.testing.assert_close(out.double(), _rope_ref(x, cos, sin), rtol=1e-5, atol=1e-5)


def _nearly_the_same_bits(ours, theirs, scale):
    """bf16 results of two fp32 computations that differ in a few fp32 ulps (sum order, FMA
    contraction, exp): equal but where a rounding to bf16 falls the other way (under 1% of the
    elements), and there by a bf16 ulp or two of the result (2^-6 relative), or of the inputs'
    magnitude where the result cancels to near zero."""
    differ = ours != theirs
    assert float(differ.float().mean()) < 0.01
    gap = (ours[differ].float() - theirs[differ].float()).abs()
    assert bool((gap <= theirs[differ].float().abs() * 2 ** -6 + scale * 2 ** -8).all())


@pytest.mark.parametrize("seed", range(4))
def test_bf16_rounds_where_the_torch_definitions_round(seed):
    """In bf16 the fused ops round their fp32 results, and the intermediates torch rounds (the
    normalized x, silu(gate)), to bf16 where the registry's torch definitions do. A kernel that kept
    those intermediates in fp32, or truncated instead of rounding to nearest even, fails here."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(33, 15 * 64, generator=g) * 3).to(torch.bfloat16)
    w = (torch.randn(576, generator=g) + 1).to(torch.bfloat16)
    x = qkv[:, :576]
    _nearly_the_same_bits(torch.ops.heterollm_cpu.rms_norm(x, w, 1e-5), ops.rms_norm(x, w, 1e-5), 0.0)
    heads = qkv[:, :12 * 64].view(33, 12, 64)
    angles = torch.randn(33, 32, generator=g) * 10
    cos, sin = angles.cos(), angles.sin()
    _nearly_the_same_bits(torch.ops.heterollm_cpu.rotary_embedding(heads, cos, sin),
                          ops.rotary_embedding(heads, cos, sin), float(heads.abs().max()))
    gate, up = (torch.randn(33, 2 * 1536, generator=g) * 4).to(torch.bfloat16).chunk(2, dim=-1)
    _nearly_the_same_bits(torch.ops.heterollm_cpu.silu_and_mul(gate, up), ops.silu_and_mul(gate, up), 0.0)


def test_the_cpu_registry_serves_the_fused_ops():
    """On a CPU launch (register_ops, then activate of the family) the layers get these ops."""
    try:
        fused.register_ops()
        chosen = ops.activate("cpu")
        for name, fn in fused.FUSED.items():
            assert chosen[name] == "cpu" and ops.get(name) is fn
    finally:
        ops.activate("cpu")  # what the rest of the suite runs with


def test_calls_the_kernel_does_not_take_go_to_the_torch_definitions():
    x = torch.randn(4, 64, dtype=torch.float16)
    w = torch.randn(64, dtype=torch.float16)
    assert torch.equal(fused.rms_norm(x, w, 1e-6), ops.rms_norm(x, w, 1e-6))
    x1 = torch.randn(64)  # one dimension
    assert torch.equal(fused.rms_norm(x1, torch.ones(64), 1e-6), ops.rms_norm(x1, torch.ones(64), 1e-6))
    t = torch.randn(64, 4).t()  # last dimension strided
    assert torch.equal(fused.rms_norm(t, torch.ones(64), 1e-6), ops.rms_norm(t, torch.ones(64), 1e-6))
    gate, up = torch.randn(3, 8, dtype=torch.float16), torch.randn(3, 8, dtype=torch.float16)
    assert torch.equal(fused.silu_and_mul(gate, up), ops.silu_and_mul(gate, up))
    rot = torch.randn(3, 2, 8)
    cos, sin = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    assert torch.equal(fused.rotary_embedding(rot, cos, sin), ops.rotary_embedding(rot, cos, sin))


@pytest.mark.parametrize("call, message", [
    (lambda: torch.ops.heterollm_cpu.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6), "weight must be"),
    (lambda: torch.ops.heterollm_cpu.rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.randn(8), 1e-6),
     "float32 or bfloat16"),
    (lambda: torch.ops.heterollm_cpu.silu_and_mul(torch.randn(2, 8), torch.randn(2, 6)), "same shape"),
    (lambda: torch.ops.heterollm_cpu.rotary_embedding(torch.randn(3, 2, 8), torch.randn(2, 4), torch.randn(2, 4)),
     "cos and sin must be"),
    (lambda: torch.ops.heterollm_cpu.rotary_embedding(torch.randn(3, 2, 7), torch.randn(3, 3), torch.randn(3, 3)),
     "even"),
])
def test_bad_inputs_are_refused_by_name(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


def test_a_nan_stays_in_its_row():
    """A NaN (a broken checkpoint, an overflow upstream) poisons its own row as torch's ops do, and
    no other row. (An inf row comes out all NaN here, where torch gives zeros beside the NaN: the
    kernels are built with -ffast-math.)"""
    x = torch.tensor([[1.0, float("nan"), 2.0, 3.0], [1.0, 4.0, 2.0, 3.0]]).to(torch.bfloat16)
    w = torch.ones(4, dtype=torch.bfloat16)
    ours, theirs = torch.ops.heterollm_cpu.rms_norm(x, w, 1e-6), ops.rms_norm(x, w, 1e-6)
    assert bool(ours[0].isnan().all()) and torch.equal(ours[1], theirs[1])
    out = torch.ops.heterollm_cpu.silu_and_mul(x, x)
    assert math.isnan(float(out[0, 1])) and not bool(out[1].isnan().any())


def _argmax_cases():
    """(name, logits fp32): rows the vector loop and its tail both decide, ties across and within
    lanes, NaNs in the vector part and in the tail, all -inf, +inf, short rows (the scalar loop)."""
    g = torch.Generator().manual_seed(7)
    yield "random", torch.randn(9, 49152, generator=g)
    for n in (1, 2, 15, 16, 31, 32, 33, 47, 48, 100):
        yield f"width {n}", torch.randn(5, n, generator=g) * 10
    ties = torch.zeros(6, 100)
    ties[0, [3, 19, 35]] = 5.0         # the same maximum in three lanes: the first index
    ties[1, [40, 8]] = 5.0             # a later lane holds the smaller index
    ties[2, [20, 36, 99]] = 5.0        # two in one lane, one in the tail
    ties[3, [97, 98]] = 5.0            # only in the tail
    ties[4] = -float("inf")            # all -inf: index 0
    ties[5, [50, 70]] = float("inf")
    yield "ties", ties
    nans = torch.randn(6, 100, generator=g)
    nans[0, 37] = float("nan")
    nans[1, [5, 60]] = float("nan")    # the first NaN, not the largest value
    nans[2, 99] = float("nan")         # in the tail
    nans[3, 0] = float("nan")
    nans[4, :] = float("nan")
    yield "nans", nans
    short_nan = torch.tensor([[1.0, float("nan"), 3.0], [float("nan"), 1.0, float("nan")]])
    yield "short nans", short_nan
    # bf16 values that are equal only after rounding: ties the kernel must see as ties
    yield "bf16 ties", torch.tensor([[1.0, 1.001, 1.002, 0.5] * 10])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_torch_argmax_of_the_fp32_logits(dtype):
    for name, logits in _argmax_cases():
        x = logits.to(dtype)
        want = x.float().argmax(-1)
        got = torch.ops.heterollm_cpu.argmax_rows(x)
        assert got.dtype == torch.long and torch.equal(got, want), (name, got, want)


def test_argmax_rows_reads_strided_rows_and_the_registry_serves_it():
    wide = torch.randn(4, 200).to(torch.bfloat16)
    view = wide[:, 3:180]  # rows of 177 values, 200 apart
    assert torch.equal(torch.ops.heterollm_cpu.argmax_rows(view), view.float().argmax(-1))
    t = torch.randn(50, 3).t()  # values strided: copied first
    assert torch.equal(torch.ops.heterollm_cpu.argmax_rows(t), t.argmax(-1))
    x16 = torch.randn(3, 8, dtype=torch.float16)  # a dtype the kernel does not take: the torch definition
    assert torch.equal(fused.argmax(x16), ops.argmax(x16))
    assert torch.equal(fused.argmax(view), view.float().argmax(-1))
    with pytest.raises(RuntimeError, match="rows, vocab"):
        torch.ops.heterollm_cpu.argmax_rows(torch.randn(8))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.heterollm_cpu.argmax_rows(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="empty row"):
        torch.ops.heterollm_cpu.argmax_rows(torch.randn(2, 0))
