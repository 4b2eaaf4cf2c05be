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


@pytest.mark.slow  # 14 s (the invalidation test below stays in the default run)
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


@pytest.mark.slow  # 9 s: converts the real GGUF again (every SmolLM2 test of the default run goes through the cache)
def test_unwritable_cache_is_skipped(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("HETEROLLM_CACHE_DIR", str(blocker))
    cfg = gguf_cache.load_config(smollm2_gguf())
    assert cfg.num_hidden_layers == 30


@pytest.mark.slow  # converts the real GGUF three times (18 s)
def test_metadata_cache_is_invalidated_when_the_file_changes(tmp_path, monkeypatch):
    """The cache is keyed by the file's path, size and modification time (README): a cached entry
    is used as long as they hold, and a touched or moved file is converted afresh."""
    import os
    import shutil

    monkeypatch.setenv("HETEROLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "a" / "model.gguf"
    path.parent.mkdir()
    shutil.copy2(smollm2_gguf(), path)
    assert gguf_cache.load_config(path).num_hidden_layers == 30  # SmolLM2-135M
    folder = gguf_cache.cache_folder(path)
    # mark the cached entry: while the key holds, the mark is what comes back
    cfg = (folder / "config.json").read_text().replace('"num_hidden_layers": 30', '"num_hidden_layers": 3')
    (folder / "config.json").write_text(cfg)
    assert gguf_cache.load_config(path).num_hidden_layers == 3, "an unchanged file is read from the cache"

    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert gguf_cache.cache_folder(path) != folder
    assert gguf_cache.load_config(path).num_hidden_layers == 30, "a touched file is converted again"

    moved = tmp_path / "b" / "model.gguf"
    moved.parent.mkdir()
    shutil.copy2(path, moved)
    assert gguf_cache.cache_folder(moved) != gguf_cache.cache_folder(path)

    with open(path, "ab") as f:  # same path and mtime, another size
        f.write(b"\0" * 32)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert gguf_cache.cache_folder(path) not in (folder, gguf_cache.cache_folder(moved))


def _tensor_table(reader):
    return [(t.name, t.tensor_type, t.shape.tolist(), t.data_offset, t.data.tobytes()) for t in reader.tensors]


@pytest.mark.parametrize("alignment", [32, 64])
def test_the_tensor_reader_steps_over_metadata_arrays_to_the_same_tensors(tmp_path, alignment):
    """loader.tensor_reader skips arrays of strings and scalars without reading them; every tensor
    (name, type, shape, offset, bytes) and every field name must be GGUFReader's, and the scalar
    fields after the arrays must read the same: a wrong skip shifts all of them."""
    from heterollm.model_executor.loader import tensor_reader

    out = tmp_path / "arrays.gguf"
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_custom_alignment(alignment)
    w.add_array("test.strings", ["", "a", "\u00e9t\u00e9", "x" * 300, "\n\0"])
    w.add_array("test.ints", list(range(-5, 1000)))
    w.add_array("test.floats", [0.5, -1.25, 3.0])
    w.add_array("test.bools", [True, False, True])
    w.add_array("test.empty", [])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_string("test.after", "still here")
    w.add_uint64("test.number", 12345678901)
    rng = np.random.default_rng(0)
    w.add_tensor("a", rng.standard_normal((3, 7)).astype(np.float32))
    w.add_tensor("b", gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), KIND.Q4_1),
                 raw_dtype=KIND.Q4_1)
    w.add_tensor("c", rng.standard_normal(5).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for path in (out, smollm2_gguf()):
        fast, slow = tensor_reader(path), gguf.GGUFReader(str(path))
        assert _tensor_table(fast) == _tensor_table(slow)
        assert list(fast.fields) == list(slow.fields) and fast.data_offset == slow.data_offset
    fast = tensor_reader(out)
    assert fast.fields["test.after"].contents() == "still here" and fast.fields["test.number"].contents() == 12345678901
    assert fast.fields["test.strings"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]
    assert fast.alignment == alignment
