"""--dtype auto (README "Models"): the checkpoint's dtype, bf16 for a GGUF, replaced by bf16 or fp32
where the platform lacks native support. Expected values are the README's rule, case by case."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from heterollm.model_executor.runner import resolve_dtype


class FakePlatform:
    """A platform with native support for exactly `native` (fp32 always)."""

    def __init__(self, *native: str) -> None:
        self.native = {"float32", *native}

    def supports_dtype(self, dtype: str) -> bool:
        return dtype in self.native


def hf(dtype: torch.dtype | None) -> SimpleNamespace:
    return SimpleNamespace(dtype=dtype)


@pytest.mark.parametrize("declared,gguf,native,want", [
    (torch.bfloat16, False, ("bfloat16",), torch.bfloat16),
    (torch.bfloat16, False, (), torch.float32),                       # no native bf16: fp32
    (torch.float16, False, ("float16", "bfloat16"), torch.float16),
    (torch.float16, False, ("bfloat16",), torch.bfloat16),             # no fp16: bf16 ...
    (torch.float16, False, (), torch.float32),                         # ... or fp32
    (torch.float32, False, ("bfloat16", "float16"), torch.float32),    # the checkpoint's own dtype
    (None, False, ("bfloat16",), torch.float32),                       # none declared: fp32
    (torch.float32, True, ("bfloat16",), torch.bfloat16),              # a GGUF is served in bf16 ...
    (torch.float32, True, (), torch.float32),                          # ... unless the platform lacks it
])
def test_auto_follows_the_checkpoint_and_the_platform(declared, gguf, native, want):
    assert resolve_dtype("auto", hf(declared), FakePlatform(*native), gguf) == want


def test_an_explicit_dtype_is_kept_even_without_native_support():
    assert resolve_dtype("bfloat16", hf(torch.float32), FakePlatform(), False) == torch.bfloat16


def test_the_engine_runs_the_resolved_dtype(tmp_path):
    """End to end on this machine's CPU platform: a bf16 checkpoint runs in bf16 where the CPU has
    native bf16, else in fp32."""
    from helpers import build_tiny_model
    from heterollm import LLM, SamplingParams

    import json

    folder = build_tiny_model(tmp_path / "m", "llama")
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = "bfloat16"  # declared bf16, as most hub checkpoints are
    (folder / "config.json").write_text(json.dumps(config))
    llm = LLM(str(folder), dtype="auto", num_gpu_blocks_override=32, max_model_len=64)
    try:
        native = llm.engine.selection.platform.supports_dtype("bfloat16")
        assert llm.engine.dtype == (torch.bfloat16 if native else torch.float32)
        assert llm.engine.executor.runner.dtype == llm.engine.dtype
        [out] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 2
    finally:
        llm.shutdown()


@pytest.mark.parametrize("native", [True, False])
def test_an_explicit_bf16_without_native_support_runs_and_says_so(tmp_path, monkeypatch, caplog, native):
    """`--dtype bfloat16` on a CPU without AVX-512-bf16 / AMX (an AVX2-only EPYC): oneDNN has no bf16
    kernels there, so the linears keep plain bf16 weights for torch's emulated GEMM, the answer comes
    out, and one warning says what that costs against the float32 `--dtype auto` would pick."""
    import logging

    from helpers import build_tiny_model
    from heterollm import LLM, SamplingParams
    from heterollm_cpu.linear import Bf16Panels, OneDnnLinear, PackedWeight, _bf16_dot_here
    from heterollm_cpu.platform import CpuPlatform

    monkeypatch.setattr(CpuPlatform, "supports_dtype", lambda self, dtype: native or dtype == "float32")
    if not native:  # as on an AVX2-only CPU, whatever this one has
        import heterollm_cpu.linear as cpu_linear

        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
        monkeypatch.setattr(cpu_linear, "_bf16_dot_here", lambda: False)
    folder = build_tiny_model(tmp_path / "m", "llama")
    with caplog.at_level(logging.WARNING, logger="heterollm.engine"):
        llm = LLM(str(folder), dtype="bfloat16", num_gpu_blocks_override=32, max_model_len=64)
    try:
        assert llm.engine.dtype == torch.bfloat16
        warned = [r.getMessage() for r in caplog.records if "no native bfloat16" in r.getMessage()]
        assert warned == ([] if native else [
            "--dtype bfloat16: platform cpu has no native bfloat16, so its products run emulated: slower for "
            "batches, though fewer weight bytes can still make one sequence faster (--dtype auto picks float32 "
            "here)"])
        layer = llm.engine.executor.runner.model.model.layers[0].mlp.down_proj
        assert isinstance(layer.method, OneDnnLinear)
        if native and _bf16_dot_here():  # AVX512_BF16 and the kernels: bf16_linear
            assert isinstance(layer.state, Bf16Panels)
        elif native and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            assert isinstance(layer.state, PackedWeight)
        if not native:
            assert isinstance(layer.state, torch.Tensor) and layer.state.dtype == torch.bfloat16
        [out] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 3
    finally:
        llm.shutdown()


def test_the_warning_promises_nothing_where_the_asked_dtype_is_no_smaller(tmp_path, monkeypatch, caplog):
    """float16 asked for where only bf16 is native and the checkpoint is bf16: `auto` would pick bf16,
    of the same size, so the warning says only that it is slower."""
    import json
    import logging

    from helpers import build_tiny_model
    from heterollm import LLM
    from heterollm_cpu.platform import CpuPlatform

    monkeypatch.setattr(CpuPlatform, "supports_dtype", lambda self, dtype: dtype in ("float32", "bfloat16"))
    folder = build_tiny_model(tmp_path / "m", "llama")
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="heterollm.engine"):
        llm = LLM(str(folder), dtype="float16", num_gpu_blocks_override=32, max_model_len=64)
    llm.shutdown()
    warned = [r.getMessage() for r in caplog.records if "no native" in r.getMessage()]
    assert warned == ["--dtype float16: platform cpu has no native float16, so its products run emulated: slower "
                      "(--dtype auto picks bfloat16 here)"]
