"""The vendor path, end to end, with the template backend (plugins/backend_template) as the vendor:
its own device, flag, op and model override reach the running engine through its one descriptor,
and nothing in framework/ names any of them."""
from __future__ import annotations

from pathlib import Path

import pytest

from heterollm import LLM, SamplingParams
from helpers import build_tiny_model, hf_greedy

PROMPTS = [[5, 6, 7, 8], list(range(100, 121))]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("template-llama") / "llama", "llama")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("template-qwen2") / "qwen2", "qwen2")


def greedy(llm: LLM, n: int = 8) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("fast_path", [True, False])
def test_the_template_flag_op_and_model_run_in_the_engine(llama, fast_path):
    from heterollm_backend_template import ops as template_ops

    template_ops.calls.clear()
    llm = LLM(str(llama), device="template", extension_impl="template", template_fast_path=fast_path,
              block_size=4, num_gpu_blocks_override=64)
    try:
        assert llm.config.template.template_fast_path is fast_path
        model = llm.engine.executor.runner.model
        assert type(model).__name__ == "TemplateLlamaForCausalLM"
        assert llm.engine.selection.model.dist == "heterollm-backend-template"
        tokens = greedy(llm)
    finally:
        llm.shutdown()
    used, unused = ("template.fused_mlp", "template.unfused_mlp")[::1 if fast_path else -1]
    assert template_ops.calls[used] > 0 and template_ops.calls[unused] == 0
    assert tokens == hf_greedy(llama, PROMPTS, 8)


def test_other_architectures_fall_back_to_the_core(qwen2):
    llm = LLM(str(qwen2), device="template", extension_impl="template", block_size=4, num_gpu_blocks_override=64)
    try:
        assert type(llm.engine.executor.runner.model).__name__ == "Qwen2ForCausalLM"
        assert llm.engine.selection.model.family == "core"
        tokens = greedy(llm)
    finally:
        llm.shutdown()
    assert tokens == hf_greedy(qwen2, PROMPTS, 8)


def test_the_template_flag_is_refused_off_its_platform(cli):
    r = cli("generate", "--model", "smollm2", "--prompt", "x", "--template_fast_path")
    assert r.rc == 2 and "--template_fast_path=true: belongs to heterollm-backend-template" in r.err


def test_the_core_names_nothing_of_the_template():
    """Zero edits to framework/: the core does not mention the template's flag, op, model or package."""
    core = Path(__file__).resolve().parents[2] / "framework" / "heterollm"
    words = ("template_fast_path", "template.mlp", "TemplateLlama", "heterollm_backend_template")
    hits = [f"{p.relative_to(core)}: {w}" for p in core.rglob("*.py") for w in words if w in p.read_text()]
    assert not hits, hits
