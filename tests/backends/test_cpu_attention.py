"""CpuPagedAttention against a dense reference: the conformance kit's attention check (mixed
batches over shuffled block tables, the cache starting as NaN as uninitialized memory may, so any
read of an unwritten or padding slot that escapes the mask shows up), at more block sizes and
steps than the kit runs, through the C++ decode kernel (heterollm_cpu/kernels.py) and through the
torch path it falls back to; and the kernel alone against a float64 reference."""
import pytest
import torch

from heterollm.testing.conformance import check_paged_attention
from heterollm_cpu import kernels
from heterollm_cpu.attention import CpuPagedAttention


@pytest.fixture(params=["kernel", "torch"])
def decode_path(request, monkeypatch):
    if request.param == "kernel":
        assert kernels.available(), "the CPU kernels are not built: python -m heterollm_cpu.kernels"
    else:
        monkeypatch.setattr(kernels, "available", lambda: False)
    return request.param


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_mixed_steps_match_dense_reference(block_size, decode_path):
    check_paged_attention(CpuPagedAttention(), torch.device("cpu"), block_size, steps=12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mixed_steps_in_the_model_dtypes(dtype, decode_path):
    check_paged_attention(CpuPagedAttention(), torch.device("cpu"), 4, steps=8, dtype=dtype)


def test_the_kernels_are_built_here():
    """scripts/setup.sh builds them; a missing build would leave serving on the slow path unnoticed."""
    assert kernels.enabled() and kernels.library_path() is not None and kernels.available()


def _reference(q, cache, tables, lens, scale):
    """float64 softmax(q k^T) v over each row's first `len` keys, gathered position by position."""
    kv_heads, block_size = cache.shape[1], cache.shape[3]
    group = q.shape[1] // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for r in range(q.shape[0]):
        pos = torch.arange(int(lens[r]))
        slots = tables[r, pos // block_size], pos % block_size
        for h in range(q.shape[1]):
            k = cache[0, h // group][slots].double()
            v = cache[1, h // group][slots].double()
            p = torch.softmax(k @ q[r, h].double() * scale, 0)
            out[r, h] = p @ v
    return out


@pytest.mark.parametrize("q_dtype, kv_dtype, tol", [(torch.float32, torch.float32, 1e-5),
                                                     (torch.bfloat16, torch.bfloat16, 2e-2),
                                                     (torch.float32, torch.bfloat16, 1e-5)])
@pytest.mark.parametrize("heads, kv_heads, block_size", [(4, 4, 1), (9, 3, 3), (8, 2, 16), (6, 1, 128)])
@pytest.mark.parametrize("dim", [32, 64, 128])  # 64 and 128 take the AVX-512 loops where the CPU has them
def test_kernel_matches_a_float64_reference(q_dtype, kv_dtype, tol, heads, kv_heads, block_size, dim):
    assert kernels.available()
    gen = torch.Generator().manual_seed(heads * 100 + block_size)
    lens = torch.tensor([1, 2, block_size, block_size + 1, 3 * block_size - 1, 40, 97])
    width = int((lens.max() + block_size - 1) // block_size)
    num_blocks = width + 16
    cache = torch.randn(2, kv_heads, num_blocks, block_size, dim, generator=gen).to(kv_dtype)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in lens])
    q = torch.randn(len(lens), heads, dim, generator=gen).to(q_dtype)
    out = torch.ops.heterollm_cpu.paged_decode(q, cache, tables.reshape(-1), lens, 0.3)
    assert out.dtype == q_dtype and out.shape == q.shape
    # the reference reads the cache as stored; bf16 rounding of the output is the only extra error
    want = _reference(q, cache, tables, lens, 0.3)
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


def test_kernel_refuses_shapes_it_cannot_serve():
    assert kernels.available()
    cache = torch.zeros(2, 3, 4, 8, 16)
    ok = (torch.zeros(1, 6, 16), cache, torch.zeros(1, dtype=torch.long), torch.tensor([8]))
    torch.ops.heterollm_cpu.paged_decode(*ok, 1.0)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        torch.ops.heterollm_cpu.paged_decode(torch.zeros(1, 5, 16), *ok[1:], 1.0)
    with pytest.raises(RuntimeError, match="longer than its block table"):
        torch.ops.heterollm_cpu.paged_decode(*ok[:3], torch.tensor([9]), 1.0)
    with pytest.raises(RuntimeError, match="at least one key"):
        torch.ops.heterollm_cpu.paged_decode(*ok[:3], torch.tensor([0]), 1.0)
    with pytest.raises(RuntimeError, match="same number of blocks"):
        torch.ops.heterollm_cpu.paged_decode(torch.zeros(2, 6, 16), cache, torch.zeros(3, dtype=torch.long),
                                             torch.tensor([1, 1]), 1.0)
