"""--dynamic_load_weight: new weights replace the old between steps. Greedy output switches exactly
at the reload (checked against transformers running model A, then model B on A's KV cache), the
prefix cache does not serve blocks computed with the old weights, a partial payload replaces only
what it names, and a bad update changes nothing."""
from __future__ import annotations

import pytest
import torch

from helpers import build_tiny_model, hf_greedy
from heterollm import LLM, SamplingParams
from heterollm.scheduler.request import RequestRejected

FLAGS = dict(dtype="float32", block_size=8, num_gpu_blocks_override=128, max_model_len=128, dynamic_load_weight=1)
PROMPT = list(range(300, 324))  # three full blocks: a second run would hit the prefix cache
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("reload")
    return build_tiny_model(root / "a", "llama", seed=0), build_tiny_model(root / "b", "llama", seed=1)


def hf_switch(a, b, prompt: list[int], k: int, total: int) -> list[int]:
    """Greedy tokens where the forwards for tokens 0..k-1 run model A and the later ones model B,
    B reading the KV cache A wrote (what a reload between steps does to a running request)."""
    from transformers import AutoModelForCausalLM, DynamicCache
    ma, mb = (AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32).eval() for f in (a, b))
    cache, out = DynamicCache(), []
    with torch.no_grad():
        logits = ma(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits
        out.append(int(logits[0, -1].argmax()))
        for i in range(1, total):
            model = ma if i < k else mb
            logits = model(input_ids=torch.tensor([[out[-1]]]), past_key_values=cache, use_cache=True).logits
            out.append(int(logits[0, -1].argmax()))
    return out


def test_a_reload_switches_the_model_and_empties_the_prefix_cache(models):
    a, b = models
    llm = LLM(str(a), **FLAGS)
    assert llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids == hf_greedy(a, [PROMPT], 10)[0]
    assert llm.engine.kv.pool.num_cached > 0
    result = llm.update_weights(path=str(b))
    assert result["tensors"] == _names(b)
    assert llm.engine.kv.pool.num_cached == 0
    assert llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids == hf_greedy(b, [PROMPT], 10)[0]
    llm.shutdown()


def _names(folder) -> int:
    from safetensors import safe_open
    return sum(len(list(safe_open(str(f), "pt").keys())) for f in folder.glob("*.safetensors"))


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_running_request_switches_exactly_at_the_reload(models, overlap):
    a, b = models
    llm = LLM(str(a), **FLAGS, enable_schedule_overlap=overlap)
    engine = llm.engine
    engine.add_request({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                       request_id="r")
    request = engine.scheduler.requests["r"]
    while len(request.output_token_ids) + request.num_pending < 3:  # tokens 0..2 sampled (or in flight) by A
        engine.step()
    k = len(request.output_token_ids) + request.num_pending
    llm.update_weights(path=str(b))
    done = None
    while done is None:
        done = next((o for o in engine.step() if o.finished), None)
    assert done.outputs[0].token_ids == hf_switch(a, b, PROMPT, k, 8)
    llm.shutdown()


def test_a_partial_payload_replaces_only_what_it_names(models, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save
    from transformers import AutoModelForCausalLM
    a, b = models
    with safe_open(str(next(b.glob("*.safetensors"))), "pt") as fh:
        head = {"lm_head.weight": fh.get_tensor("lm_head.weight")}
    llm = LLM(str(a), **FLAGS)
    assert llm.update_weights(payload=save(head))["tensors"] == 1
    mixed = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32).eval()
    mixed.lm_head.weight.data.copy_(head["lm_head.weight"])
    mixed.save_pretrained(tmp_path / "mixed")
    assert llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids == hf_greedy(tmp_path / "mixed", [PROMPT], 10)[0]
    llm.shutdown()


def test_a_bad_update_changes_nothing(models):
    from safetensors.torch import save
    a, _ = models
    llm = LLM(str(a), **FLAGS)
    before = llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    good = torch.zeros(64)  # model.norm.weight has 64: it would zero the final norm if applied
    for bad, words in [({"model.norm.weight": good, "model.layers.0.mlp.down_proj.weight": torch.zeros(3, 3)},
                        "do not fit"),
                       ({"model.norm.weight": good, "model.layers.9.bogus.weight": torch.zeros(2)}, "does not have")]:
        with pytest.raises(RequestRejected, match=words) as info:
            llm.update_weights(payload=save(bad))
        assert info.value.field == "path"
        assert llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids == before
    with pytest.raises(RequestRejected, match="neither a .safetensors file"):
        llm.update_weights(path="/nonexistent/weights")
    llm.shutdown()


def test_reloading_needs_the_flag(models):
    a, b = models
    llm = LLM(str(a), **{**FLAGS, "dynamic_load_weight": 0})
    with pytest.raises(RequestRejected, match="--dynamic_load_weight") as info:
        llm.update_weights(path=str(b))
    assert info.value.field == "dynamic_load_weight"
    llm.shutdown()
