"""AWQ, GPTQ and FP8 checkpoints (config.json `quantization_config`) against transformers on the
dequantized weights: tiny checkpoints packed in the tests from each format's published layout
(quant_writers.py), and a float transformers model holding their dequantized values. Greedy tokens
identical; logprobs within 2e-3 (fp32; the int4 kernel sums in its own order). Plus the
`--quantization` conflicts, the formats refused with their reason, and the backend seam."""
from __future__ import annotations

import json

import pytest
import torch

from helpers import hf_greedy, hf_logprobs
from heterollm import LLM, SamplingParams
from heterollm.config import ConfigError
from heterollm.model_executor import ops
from heterollm.model_executor.quant_linear import DequantizedLinear, QuantizedLinearMethod, checkpoint_methods
from heterollm_cpu.linear import CheckpointFp8, CheckpointInt4
from quant_writers import build_quantized

PROMPTS = [[1, 20, 30, 40, 50], list(range(100, 137)), [7, 7, 7]]
NEW = 16
FLAGS = dict(dtype="float32", block_size=8, num_gpu_blocks_override=128, max_model_len=256)

FORMATS = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False},
    "gptq_desc_act": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False},
    "gptq_v2_sym_per_channel": {"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False,
                                "sym": True, "checkpoint_format": "gptq_v2"},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
    "awq_g64": {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
    "fp8_per_tensor": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "fp8_block": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                  "weight_block_size": [32, 32]},
    "fp8_block_partial": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [24, 48]},
}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def checkpoint(request, tmp_path_factory):
    q_dir, ref_dir = build_quantized(tmp_path_factory.mktemp(request.param), FORMATS[request.param])
    return request.param, q_dir, ref_dir


def _generate(folder, **flags):
    llm = LLM(str(folder), **FLAGS, **flags)
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=2)
    return llm, llm.generate(PROMPTS, params)


def test_greedy_and_logprobs_match_dequantized_reference(checkpoint):
    name, q_dir, ref_dir = checkpoint
    llm, outs = _generate(q_dir)
    expected = hf_greedy(ref_dir, PROMPTS, NEW)
    assert [o.outputs[0].token_ids for o in outs] == expected, name
    for prompt, out in zip(PROMPTS, outs):
        gen = out.outputs[0].token_ids
        ref = hf_logprobs(ref_dir, prompt + gen)
        for j, lp in enumerate(out.outputs[0].logprobs):
            assert abs(lp.logprob - ref[len(prompt) - 1 + j][gen[j]].item()) < 2e-3, (name, j)
    # the layers really run the format's method: the int4 kernel for GPTQ / AWQ, the FP8 path for FP8
    qkv = llm.engine.executor.runner.model.model.layers[0].self_attn.qkv_proj
    if name.startswith("fp8"):
        assert isinstance(qkv.method, CheckpointFp8)
    else:
        assert isinstance(qkv.method, CheckpointInt4) and isinstance(qkv.state, tuple)
        assert (qkv.state[-1] is not None) == (name == "gptq_desc_act")  # act-order gathers x's columns
    assert qkv.weight is None and qkv.qcodes.numel() == 0  # the loaded tensors were released


def test_int4_checkpoint_holds_fewer_weight_bytes(tmp_path):
    q_dir, ref_dir = build_quantized(tmp_path, FORMATS["gptq"])
    quantized = LLM(str(q_dir), **FLAGS).engine.executor.runner.weight_bytes
    reference = LLM(str(ref_dir), **FLAGS).engine.executor.runner.weight_bytes
    assert quantized < reference


def _set_quant_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"].update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("flag", ["wint8", "wint4", "awq", "fp8"])
def test_conflicting_quantization_flag_is_a_launch_error(tmp_path, flag):
    q_dir, _ = build_quantized(tmp_path, FORMATS["gptq"])
    with pytest.raises(ConfigError, match=rf"--quantization={flag} conflicts with the checkpoint's "
                                          r"quantization_config: gptq \(4-bit, group 32\)"):
        LLM(str(q_dir), **FLAGS, quantization=flag)


def test_matching_flag_runs_and_float_checkpoint_refuses_a_format_flag(tmp_path):
    q_dir, ref_dir = build_quantized(tmp_path, FORMATS["fp8_block"])
    LLM(str(q_dir), **FLAGS, quantization="block_wise_fp8")  # FastDeploy's name for it
    LLM(str(q_dir), **FLAGS, quantization="fp8")
    with pytest.raises(ConfigError, match=r"--quantization=gptq: the checkpoint has no quantization_config"):
        LLM(str(ref_dir), **FLAGS, quantization="gptq")


@pytest.mark.parametrize("fmt,changes,reason", [
    ("gptq", {"bits": 8}, r"gptq bits=8 is not supported \(4-bit only\)"),
    ("gptq", {"checkpoint_format": "marlin"}, r"gptq checkpoint_format 'marlin' is not supported"),
    ("awq", {"version": "gemv"}, r"awq version 'gemv' is not supported \(gemm\): its packing differs"),
    ("fp8_block", {"activation_scheme": "static"}, r"fp8 activation_scheme 'static' is not supported"),
    ("fp8_block", {"quant_method": "bitsandbytes"}, r"quant_method 'bitsandbytes' is not supported"),
])
def test_unsupported_formats_are_refused_with_the_reason(tmp_path, fmt, changes, reason):
    q_dir, _ = build_quantized(tmp_path, FORMATS[fmt])
    _set_quant_config(q_dir, **changes)
    with pytest.raises(ConfigError, match=r"--model: its config.json quantization_config: " + reason):
        LLM(str(q_dir), **FLAGS)


def test_desc_act_with_different_permutations_in_one_merged_layer_is_refused(tmp_path):
    q_dir, _ = build_quantized(tmp_path, FORMATS["gptq_desc_act"], site_perms=False)
    with pytest.raises(ConfigError, match=r"different g_idx"):
        LLM(str(q_dir), **FLAGS)


class _DeviceGptq(QuantizedLinearMethod):
    """What a device backend registers: its own kernel for `quantized_linear.gptq`, under its family."""

    name = "device-gptq"
    prepared = 0

    def prepare(self, weight):
        type(self).prepared += 1
        return weight.dequantize()

    def apply(self, state, x, bias):
        return torch.nn.functional.linear(x, state, bias)


def test_a_backend_family_plugs_in_its_own_kernel():
    """The seam: a family's `quantized_linear.gptq` wins over the CPU's and the core's defaults, with no edit
    to the core; a family without one falls back to the core's dequantizing default."""
    class Cfg:
        quantization_config = FORMATS["gptq"]
    try:
        ops.register("quantized_linear.gptq", family="test-device")(_DeviceGptq)
        ops.activate("test-device", "cpu")
        assert isinstance(checkpoint_methods(None, Cfg)[1], _DeviceGptq)
        ops.activate("cpu")
        assert isinstance(checkpoint_methods(None, Cfg)[1], CheckpointInt4)
        ops.activate("other")
        assert isinstance(checkpoint_methods(None, Cfg)[1], DequantizedLinear)
    finally:
        ops._IMPLS["quantized_linear.gptq"].pop("test-device", None)
        ops.activate("cpu")


def test_weight_reload_into_a_quantized_checkpoint_is_refused(tmp_path):
    from heterollm.scheduler.request import RequestRejected
    q_dir, ref_dir = build_quantized(tmp_path, FORMATS["awq"])
    llm = LLM(str(q_dir), **FLAGS, dynamic_load_weight=True)
    with pytest.raises(RequestRejected, match="quantized checkpoint"):
        llm.update_weights(str(ref_dir))
