"""CPU linear methods (`linear.none` prepacked, `linear.wint8`, `linear.wint4`) against F.linear,
the op-registry fallback that selects them, and their errors."""
import logging

import pytest
import torch
import torch.nn.functional as F

from heterollm.model_executor import ops
from heterollm.model_executor.linear_method import model_bytes, prepare_linears, select_linear_method
from heterollm_cpu.linear import OneDnnLinear, WeightOnlyInt4, WeightOnlyInt8


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wint8_error_is_int8_sized(dtype):
    torch.manual_seed(0)
    w, x = torch.randn(128, 96, dtype=dtype), torch.randn(5, 96, dtype=dtype)
    method = WeightOnlyInt8()
    codes, scale = method.prepare(w)
    assert codes.dtype == torch.int8 and codes.abs().max() <= 127
    err = _rel_err(method.apply((codes, scale), x, None), F.linear(x.float(), w.float()))
    assert 1e-4 < err < 0.02  # quantized (not a pass-through) and within int8 error


def test_wint4_reproduces_q4_1_weights_exactly():
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
    y = method.apply(method.prepare(w), x, None)
    torch.testing.assert_close(y, F.linear(x, w), atol=1e-3, rtol=1e-4)


def test_wint4_error_on_random_weights_and_bias():
    torch.manual_seed(0)
    w, b, x = torch.randn(64, 96, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16), torch.randn(
        4, 96, dtype=torch.bfloat16)
    method = WeightOnlyInt4()
    err = _rel_err(method.apply(method.prepare(w), x, b), F.linear(x.float(), w.float(), b.float()))
    assert 0.005 < err < 0.12


def test_wint4_needs_group_multiple():
    with pytest.raises(ValueError, match="wint4.*not a multiple of the group size 32"):
        WeightOnlyInt4().prepare(torch.randn(8, 40))


def test_wint4_names_output_rows_the_kernel_cannot_pack():
    """torch's int4 packing takes rows in sixteens: a layer of 40 (a tiny MLA latent) is refused with
    its size, not a kernel RuntimeError."""
    with pytest.raises(ValueError, match="wint4: out_features 40 is not a multiple of 16"):
        WeightOnlyInt4().prepare(torch.randn(40, 64))
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
        with pytest.raises(ValueError, match=r"--quantization=fp8: .*offers: wint4, wint8"):
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
    assert "--quantization=w4afp8: not supported by the selected backend (it offers: wint4, wint8)" in r.err
    assert "Traceback" not in r.err


@pytest.mark.parametrize("quantization", ["wint8", "wint4"])
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
    assert 1e-5 < drift < (0.05 if quantization == "wint8" else 0.5)
