"""GGUF loading: the torch dequantizer against the `gguf` package, and the converted-metadata
cache (config and tokenizer saved once as Hugging Face files, identical when read back)."""
import gguf
import numpy as np
import pytest
import torch

from heterollm.model_executor import gguf_cache
from heterollm.model_executor.loader import dequantize_gguf

from helpers import smollm2_gguf

KIND = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", [KIND.Q4_0, KIND.Q4_1, KIND.Q8_0, KIND.F16, KIND.BF16, KIND.F32])
def test_dequantize_is_bit_identical_to_gguf(qtype):
    x = np.random.default_rng(0).standard_normal((48, 256)).astype(np.float32) * 3
    data = gguf.quants.quantize(x, qtype)
    want = torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(-1))
    got = dequantize_gguf(data, qtype)
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
    if qtype not in (KIND.F32,):
        assert not torch.equal(got, torch.from_numpy(x.reshape(-1)))  # really quantized data


def test_metadata_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("HETEROLLM_CACHE_DIR", str(tmp_path))
    path = smollm2_gguf()
    fresh_cfg = gguf_cache.load_config(path)
    folder = gguf_cache.cache_folder(path)
    assert folder.parent == tmp_path / "gguf" and (folder / "config.json").is_file()
    cached_cfg = gguf_cache.load_config(path)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "eos_token_id", "model_type"):
        assert getattr(cached_cfg, key, None) == getattr(fresh_cfg, key, None), key

    fresh_tok = gguf_cache.load_tokenizer(path)
    assert (folder / "tokenizer_config.json").is_file()
    cached_tok = gguf_cache.load_tokenizer(path)
    text = "Hello, wörld! 日本の首都は? <|im_start|>user\n 123  spaces"
    assert cached_tok.encode(text) == fresh_tok.encode(text)
    assert cached_tok.chat_template == fresh_tok.chat_template
    assert len(cached_tok) == len(fresh_tok) and cached_tok.eos_token_id == fresh_tok.eos_token_id
    msgs = [{"role": "user", "content": "What is the capital of Japan?"}]
    assert (cached_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            == fresh_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))


def test_unwritable_cache_is_skipped(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("HETEROLLM_CACHE_DIR", str(blocker))
    cfg = gguf_cache.load_config(smollm2_gguf())
    assert cfg.num_hidden_layers == 30
