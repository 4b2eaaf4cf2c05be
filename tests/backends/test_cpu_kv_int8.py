"""The CPU backend's int8 KV cache (--kv_cache_dtype int8): quantize -> dequantize stays within half a
quantization step of each row's own magnitude, the scales stored in the cache are one per token and
KV head (rows of magnitudes 1e-3 to 1e3 side by side in one block would lose the small ones under a
shared scale), and paged attention over the quantized cache matches the dense reference."""
import pytest
import torch

from heterollm.interfaces import AttentionInputs
from heterollm.testing.conformance import check_paged_attention
from heterollm_cpu import kv_int8
from heterollm_cpu.attention import CpuPagedAttention

KV, D = 2, 16


def _spread(tokens: int, seed: int = 0) -> torch.Tensor:
    """(tokens, KV, D) values whose rows' magnitudes run from 1e-3 to 1e3 across tokens and heads."""
    gen = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(-3, 3, tokens * KV).view(KV, tokens).T.unsqueeze(-1)  # heads differ too
    return torch.randn(tokens, KV, D, generator=gen) * magnitudes


def _assert_per_row(rows: torch.Tensor, x: torch.Tensor) -> None:
    """rows (..., row_bytes) hold x (..., D): scale max|x| / 127 per row, error within half a step."""
    absmax = x.abs().amax(-1)
    torch.testing.assert_close(kv_int8.scales(rows), absmax / 127, rtol=1e-6, atol=0)
    error = (kv_int8.dequantize(rows, x.shape[-1], torch.float32) - x).abs().amax(-1)
    assert (error <= absmax / 254 * (1 + 1e-5)).all(), (error / absmax).max()


@pytest.mark.parametrize("head_dim", [16, 6, 64])
def test_round_trip_within_half_a_step_of_each_row(head_dim):
    x = torch.randn(33, KV, head_dim) * torch.logspace(-3, 3, 33).view(33, 1, 1)
    rows = kv_int8.quantize(x)
    assert rows.dtype == torch.int8 and rows.shape == (33, KV, kv_int8.row_bytes(head_dim))
    assert kv_int8.row_bytes(64) == 68 and kv_int8.row_bytes(6) == 12  # values, padding to 4, the fp32 scale
    _assert_per_row(rows, x)
    assert kv_int8.dequantize(kv_int8.quantize(torch.zeros(3, head_dim)), head_dim, torch.bfloat16).eq(0).all()


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_the_cache_holds_one_scale_per_token_and_kv_head(block_size):
    """A prefill of 13 tokens, then a decode, written through `forward` into shuffled blocks of a cache
    whose bytes start as 0xFF: every written slot's K and V rows carry their own token's and head's scale."""
    backend = CpuPagedAttention()
    cache = torch.full(backend.quantized_kv_cache_shape(16, block_size, KV, D, "int8"), -1, dtype=torch.int8)
    table = torch.randperm(16, generator=torch.Generator().manual_seed(block_size))[:-(-14 // block_size)].tolist()
    keys, values = _spread(14, seed=1), _spread(14, seed=2).flip(0)
    for ctx, n in [(0, 13), (13, 1)]:
        inputs = AttentionInputs([n], [ctx], [table[:-(-(ctx + n) // block_size)]], block_size)
        meta = backend.build_metadata(inputs, torch.device("cpu"))
        q = torch.randn(n, 2 * KV, D)
        out = backend.forward(q, keys[ctx:ctx + n], values[ctx:ctx + n], cache, meta, D ** -0.5)
        assert out.isfinite().all()
    pos = torch.arange(14)
    blocks, offsets = torch.tensor(table)[pos // block_size], pos % block_size
    for plane, x in ((0, keys), (1, values)):
        rows = cache[plane][:, blocks, offsets].transpose(0, 1)  # (tokens, KV, row_bytes)
        _assert_per_row(rows, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_mixed_steps_over_an_int8_cache_match_dense_reference(block_size, dtype):
    """The conformance kit's mixed steps (prefill, chunked prefill over cached context, decodes) on a
    0xFF-filled int8 cache, within the kit's int8 tolerance, at the kit's and a model-sized head dim."""
    for head_dim in (16, 64):
        check_paged_attention(CpuPagedAttention(), torch.device("cpu"), block_size, steps=12, dtype=dtype,
                              head_dim=head_dim, kv_cache_dtype="int8")


def test_int8_is_refused_for_latent_attention_and_by_backends_without_it():
    """Launch refusals: an MLA checkpoint's latent cache stays in the model dtype; a backend whose
    attention does not `supports_kv_cache_dtype("int8")` (the device backends' torch paged attention)
    is refused naming it. "auto" is never refused."""
    from types import SimpleNamespace

    from heterollm.model_executor.paged_attention import TorchPagedAttention
    from heterollm.model_executor.registry import _kv_cache_dtype_problems

    dense, mla = SimpleNamespace(), SimpleNamespace(kv_lora_rank=24, qk_rope_head_dim=8)
    assert _kv_cache_dtype_problems("attention cpu", CpuPagedAttention, dense, "int8") == []
    assert _kv_cache_dtype_problems("attention x", TorchPagedAttention, mla, "auto") == []
    [reason] = _kv_cache_dtype_problems("attention cpu", CpuPagedAttention, mla, "int8")
    assert reason.startswith("--kv_cache_dtype=int8: ") and "multi-head latent attention" in reason
    [reason] = _kv_cache_dtype_problems("attention torch", TorchPagedAttention, dense, "int8")
    assert reason.startswith("--kv_cache_dtype=int8: attention torch") and "supports_kv_cache_dtype" in reason
