"""CpuPagedAttention against a dense reference: the conformance kit's attention check (mixed
batches over shuffled block tables, the cache starting as NaN as uninitialized memory may, so any
read of an unwritten or padding slot that escapes the mask shows up), at more block sizes and
steps than the kit runs, through the C++ decode kernel (heterollm_cpu/kernels.py) and through the
torch path it falls back to; and the kernel alone against a float64 reference."""
import pytest
import torch

from heterollm.testing.conformance import check_mla_attention, check_paged_attention
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_mla_mixed_steps_match_dense_reference(block_size, dtype):
    """MLA's latent attention (one latent per token, the value inside it) over the kit's mixed steps."""
    check_mla_attention(CpuPagedAttention(), torch.device("cpu"), block_size, steps=12, dtype=dtype)


def test_the_kernels_are_built_here():
    """scripts/setup.sh builds them; a missing build would leave serving on the slow path unnoticed."""
    assert kernels.enabled() and kernels.library_path() is not None and kernels.available()


def test_a_build_for_another_cpu_is_not_served(monkeypatch):
    """`-march=native` compiles for this CPU: a library built where AVX-512 exists would die of SIGILL
    on an AVX2-only CPU sharing the folder, so the build folder's key names the vector extensions (and
    only those: a flag like `hypervisor` does not force a rebuild)."""
    import heterollm_cpu.platform as cpu_platform

    flags = cpu_platform._cpu_flags()
    here = kernels._key()
    avx512_flags = {"avx512f", "avx512bw", "avx512_bf16"}
    keys = {}
    # the same three CPUs whichever this one is (an AVX-512 machine as well as an AVX2-only one)
    for name, cpu in (("avx2", (flags - avx512_flags) | {"avx2"}), ("avx512", flags | avx512_flags | {"avx2"}),
                      ("neither", flags - avx512_flags - {"avx2"})):
        monkeypatch.setattr(cpu_platform, "_cpu_flags", lambda cpu=cpu: cpu)
        keys[name] = kernels._key()
    monkeypatch.setattr(cpu_platform, "_cpu_flags", lambda: flags ^ {"hypervisor"})
    assert len(set(keys.values())) == 3 and kernels._key() == here
    assert kernels.build_dirs()[0].name == kernels._key()


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


needs_prefill_kernel = pytest.mark.skipif(
    not (kernels.available() and torch.ops.heterollm_cpu.paged_prefill_supported()),
    reason="the C++ prefill kernel needs the built kernels and AVX512_BF16")


@needs_prefill_kernel
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [1, 16])
def test_mixed_bf16_steps_through_the_prefill_kernel(head_dim, block_size, monkeypatch):
    """The conformance kit's mixed steps at model-sized heads in bf16, where prefill chunks (with and
    without cached context) go through the C++ prefill kernel: any read of an unwritten slot of the
    NaN-filled cache would show."""
    calls = []
    real = torch.ops.heterollm_cpu.paged_prefill

    class Spy:
        def __call__(self, *args):
            calls.append(args[4].tolist())
            return real(*args)

    monkeypatch.setattr(torch.ops.heterollm_cpu, "paged_prefill", Spy())
    check_paged_attention(CpuPagedAttention(), torch.device("cpu"), block_size, steps=8, dtype=torch.bfloat16,
                          head_dim=head_dim)
    assert calls  # the first chunks of the kit's prompts (longer chunks over a context: the test below)


def _prefill_reference(q, cache, tables, starts, ctx_lens, q_lens, scale):
    """float64 causal attention of each chunk over its context and its own keys, read position by
    position from the blocks: row t of a chunk sees keys 0 .. ctx + t."""
    kv_heads, block_size = cache.shape[1], cache.shape[3]
    group = q.shape[1] // kv_heads
    out = []
    for c in range(len(starts)):
        total = int(ctx_lens[c] + q_lens[c])
        pos = torch.arange(total)
        k = cache[0][:, tables[c, pos // block_size], pos % block_size].double().repeat_interleave(group, 0)
        v = cache[1][:, tables[c, pos // block_size], pos % block_size].double().repeat_interleave(group, 0)
        rows = slice(int(starts[c]), int(starts[c] + q_lens[c]))
        scores = q[rows].double().transpose(0, 1) @ k.transpose(1, 2) * scale  # (H, n, total)
        causal = pos[None, :] <= (int(ctx_lens[c]) + torch.arange(int(q_lens[c])))[:, None]
        out.append((rows, (scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v).transpose(0, 1)))
    return out


@needs_prefill_kernel
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size, chunks", [
    (9, 3, 64, 16, [(0, 128), (0, 37), (50, 20), (0, 1), (5, 17)]),  # SmolLM2's heads
    (8, 2, 128, 3, [(0, 40), (7, 33)]),
    (4, 4, 64, 1, [(0, 17), (100, 5)]),
    (16, 1, 64, 128, [(0, 300)]),
    (12, 2, 64, 5, [(3, 2), (0, 64), (31, 1)]),
])
def test_prefill_kernel_matches_a_float64_reference(heads, kv_heads, head_dim, block_size, chunks):
    gen = torch.Generator().manual_seed(heads * 1000 + head_dim + block_size)
    blocks_of = [(c + n + block_size - 1) // block_size for c, n in chunks]
    num_blocks = sum(blocks_of) + 5
    cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, generator=gen).to(torch.bfloat16)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(chunks), max(blocks_of), dtype=torch.long)
    used = 0
    for c, n in enumerate(blocks_of):
        tables[c, :n] = order[used:used + n]
        used += n
    q_lens = torch.tensor([n for _, n in chunks])
    ctx_lens = torch.tensor([c for c, _ in chunks])
    starts = torch.cumsum(q_lens, 0) - q_lens
    qkv = torch.randn(int(q_lens.sum()), heads + 2 * kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    q = qkv[:, :heads]  # a strided view, as the decoder passes it
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    torch.ops.heterollm_cpu.paged_prefill(q, cache, starts, ctx_lens, q_lens, tables, scale, out)
    want = _prefill_reference(q, cache, tables, starts, ctx_lens, q_lens, scale)
    # bf16 probabilities times bf16 values, rounded to bf16: ~3 bf16 ulps of values of size ~1
    for rows, ref in want:
        torch.testing.assert_close(out[rows].double(), ref, atol=2e-2, rtol=2e-2)


@needs_prefill_kernel
def test_prefill_kernel_refuses_what_it_cannot_serve():
    cache = torch.zeros(2, 2, 4, 8, 64, dtype=torch.bfloat16)
    q = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    chunk = (torch.tensor([0]), torch.tensor([0]), torch.tensor([3]), torch.tensor([[0]]))
    torch.ops.heterollm_cpu.paged_prefill(q, cache, *chunk, 1.0, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.heterollm_cpu.paged_prefill(q.float(), cache, *chunk, 1.0, torch.empty_like(q).float())
    with pytest.raises(RuntimeError, match="64 or 128"):
        q32, c32 = torch.zeros(3, 4, 32, dtype=torch.bfloat16), torch.zeros(2, 2, 4, 8, 32, dtype=torch.bfloat16)
        torch.ops.heterollm_cpu.paged_prefill(q32, c32, *chunk, 1.0, torch.empty_like(q32))
    with pytest.raises(RuntimeError, match="block table is short"):
        torch.ops.heterollm_cpu.paged_prefill(q, cache, chunk[0], torch.tensor([6]), *chunk[2:], 1.0,
                                              torch.empty_like(q))
    with pytest.raises(RuntimeError, match="outside the query"):
        torch.ops.heterollm_cpu.paged_prefill(q, cache, chunk[0], chunk[1], torch.tensor([4]), chunk[3], 1.0,
                                              torch.empty_like(q))
    with pytest.raises(RuntimeError, match="block id out of range"):
        torch.ops.heterollm_cpu.paged_prefill(q, cache, *chunk[:3], torch.tensor([[9]]), 1.0, torch.empty_like(q))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_kv_writes_what_the_torch_write_does(dtype):
    """`heterollm_cpu::store_kv` (csrc/kv_store.cpp) against attention.py's `_write_kv` on the same cache:
    the fresh blocks zeroed, each token's K / V rows in its slot (keys as strided views of a fused qkv,
    as a model hands them over), nothing else touched; a slot outside the cache is refused."""
    from heterollm_cpu.attention import _write_kv

    assert kernels.available()
    torch.manual_seed(0)
    kvh, nb, bs, d, t = 2, 6, 4, 8, 5
    cache = torch.randn(2, kvh, nb, bs, d).to(dtype)
    ref = cache.clone()
    qkv = torch.randn(t, 3 * kvh * d).to(dtype)
    key, value = qkv[:, kvh * d:2 * kvh * d].view(t, kvh, d), qkv[:, 2 * kvh * d:].view(t, kvh, d)
    fresh, slots = torch.tensor([3, 5]), torch.tensor([13, 14, 20, 1, 22])
    torch.ops.heterollm_cpu.store_kv(cache, fresh, slots, key, value)
    _write_kv(ref, fresh, slots, key, value)
    assert torch.equal(cache, ref)
    assert (cache[:, :, 3, [0, 3]] == 0).all() and (cache[:, :, 5, [1, 3]] == 0).all()  # fresh blocks' other rows
    with pytest.raises(RuntimeError, match="slot 24 out of range"):
        torch.ops.heterollm_cpu.store_kv(cache, fresh, torch.tensor([24, 0, 1, 2, 3]), key, value)
