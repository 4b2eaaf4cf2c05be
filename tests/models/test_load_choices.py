"""`--load_choices default_v1`: weight loaders get windows over the memory-mapped checkpoint, so a
tensor-parallel rank reads only its shard. Every family, the quantized formats and pytorch .bin
files load the same parameters as the `default` loader, rank by rank; a rank of two reads about
half the bytes; greedy output is unchanged end to end, tensor-parallel included."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from helpers import assert_same_parameters, build_tiny_model, load_family_weights
from heterollm import LLM, SamplingParams
from heterollm.config import ConfigError
from heterollm.model_executor.checkpoint_slice import CheckpointSlice, ReadStats, materialize, safetensors_slice
from heterollm.model_executor.loader import iter_weights, resolve_model
from quant_writers import build_quantized

FLAGS = dict(dtype="float32", block_size=8, num_gpu_blocks_override=64, max_model_len=128)
PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 130))]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)


# -- the window itself, against the tensor it stands for ------------------------------------------
@pytest.fixture()
def stored(tmp_path):
    w = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6).bfloat16()
    path = tmp_path / "w.safetensors"
    save_file({"w": w, "scalar": torch.tensor(3.5)}, str(path))
    with safe_open(str(path), framework="pt") as handle:
        yield w, handle


def test_moving_the_window_reads_nothing_and_reading_it_reads_only_the_window(stored):
    w, handle = stored
    stats = ReadStats()
    lazy = safetensors_slice(handle, "w", stats)
    assert (lazy.shape, lazy.dtype, stats.read, stats.stored) == (torch.Size([8, 6]), torch.bfloat16, 0, 96)
    window = lazy.to(torch.float32).narrow(0, 2, 4)[1:3, 4:]
    assert (window.shape, window.dtype, stats.read) == (torch.Size([2, 2]), torch.float32, 0)
    got = window.materialize()
    assert got.dtype == torch.float32 and torch.equal(got, w[3:5, 4:].float())
    assert stats.read == 2 * 2 * 2  # four bfloat16 values, not the 96 bytes of the whole tensor
    q, k, v = lazy.split([4, 2, 2])
    assert torch.equal(k.materialize(), w[4:6]) and torch.equal(v.materialize(), w[6:])
    gate, up = lazy.chunk(2)
    assert torch.equal(up.narrow(1, 1, 2).materialize(), w[4:, 1:3])
    with pytest.raises(IndexError, match="outside a dimension of size 4"):
        gate.narrow(0, 3, 2)


def test_anything_else_reads_the_window_and_carries_on_as_a_tensor(stored):
    w, handle = stored
    lazy = safetensors_slice(handle, "w", ReadStats())
    param = torch.zeros(4, 6)
    param.copy_(lazy.narrow(0, 4, 4))  # a torch function: Tensor.copy_ reads its argument
    assert torch.equal(param, w[4:].float())
    order = torch.tensor([1, 0])
    assert torch.equal(lazy.reshape(4, 2, 6)[:, order].reshape(8, 6), w.reshape(4, 2, 6)[:, order].reshape(8, 6))
    assert torch.equal(lazy[torch.tensor([0, 7])], w[[0, 7]])
    assert torch.equal(lazy.narrow(1, 0, 3) * 2, w[:, :3] * 2)
    assert torch.equal(torch.cat([lazy.narrow(0, 0, 1), w[1:]]), w)
    nested = materialize({"a": [lazy.narrow(0, 0, 2)], "b": 1})
    assert torch.equal(nested["a"][0], w[:2]) and nested["b"] == 1
    scalar = safetensors_slice(handle, "scalar", ReadStats())
    assert scalar.shape == torch.Size([]) and scalar.materialize().item() == 3.5


# -- whole models: the same parameters as the default loader, rank by rank -------------------------
FAMILY_SHAPES = {
    "llama": {}, "qwen2": {}, "qwen3": {}, "mistral": {},
    "llama-kv-replicated": {"num_key_value_heads": 1},
    "phi3": {}, "glm": {}, "glm4": {},
    "gemma2": {"head_dim": 16}, "gemma3": {"head_dim": 16},
    "llama-tied": {"tie_word_embeddings": True},
}


@pytest.fixture(scope="module", params=sorted(FAMILY_SHAPES))
def family_folder(request, tmp_path_factory):
    family = request.param.split("-")[0]
    return build_tiny_model(tmp_path_factory.mktemp(request.param), family, **FAMILY_SHAPES[request.param])


def test_every_family_loads_the_same_parameters_on_every_rank(family_folder):
    default, _ = load_family_weights(family_folder, "default")
    v1, stats = load_family_weights(family_folder, "default_v1")
    assert_same_parameters(v1, default)
    assert stats.read == stats.stored  # one rank holds every weight: it reads each byte once
    for rank in range(2):
        default, full = load_family_weights(family_folder, "default", rank, 2)
        v1, shard = load_family_weights(family_folder, "default_v1", rank, 2)
        assert_same_parameters(v1, default)
        assert full.read == full.stored
        assert shard.stored == full.stored
        # norms and replicated K/V heads are read whole; every projection and the embedding, halved
        assert 0.5 * full.stored <= shard.read < 0.65 * full.stored


def test_quantized_formats_load_theassert_same_parameters(tmp_path):
    for fmt, config in {
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
        "fp8_block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]},
    }.items():
        folder, _ = build_quantized(tmp_path / fmt, config)
        source = resolve_model(str(folder))
        default = dict(iter_weights(source, "default"))
        v1 = {name: materialize(t) for name, t in iter_weights(source, "default_v1")}
        assert_same_parameters(v1, default)


def test_pytorch_bin_files_are_memory_mapped(tmp_path):
    folder = build_tiny_model(tmp_path / "llama", "llama")
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        state = {name: handle.get_tensor(name) for name in handle.keys()}
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    source = resolve_model(str(folder))
    lazy = dict(iter_weights(source, "default_v1"))
    assert all(isinstance(t, CheckpointSlice) for t in lazy.values())
    assert_same_parameters({n: materialize(t) for n, t in lazy.items()}, state)
    assert_same_parameters(load_family_weights(folder, "default_v1", 1, 2)[0], load_family_weights(folder, "default", 1, 2)[0])
    # a file in torch's pre-1.6 format cannot be memory-mapped: it is read whole, with the same result
    torch.save(state, folder / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    legacy = dict(iter_weights(source, "default_v1"))
    assert not any(isinstance(t, CheckpointSlice) for t in legacy.values())
    assert_same_parameters(legacy, state)


@pytest.mark.slow  # 9 s: a whole launch to reach the loader's refusal
def test_an_unknown_loader_is_named():
    with pytest.raises(ConfigError, match="--load_choices=fast: expected one of default, default_v1"):
        next(iter_weights(resolve_model("smollm2"), "fast"))


# -- end to end ----------------------------------------------------------------------------------
def _generate(folder, **flags):
    llm = LLM(str(folder), **FLAGS, **flags)
    try:
        outs = llm.generate(PROMPTS, GREEDY)
        runner = getattr(llm.engine.executor, "runner", None)
        reads = runner.checkpoint_reads if runner is not None else None
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], [lp.logprob for o in outs for lp in o.outputs[0].logprobs], reads


@pytest.mark.slow  # 9 s with its two-rank run
def test_default_v1_serves_the_same_tokens_with_one_rank_and_two(tmp_path):
    folder = build_tiny_model(tmp_path / "qwen2", "qwen2")
    tokens, logprobs, full = _generate(folder)
    v1_tokens, v1_logprobs, reads = _generate(folder, load_choices="default_v1")
    assert v1_tokens == tokens and v1_logprobs == logprobs
    assert reads is not None and reads.read == reads.stored == full.stored
    tp_tokens, tp_logprobs, _ = _generate(folder, load_choices="default_v1", tp_size=2)
    assert tp_tokens == tokens
    assert tp_logprobs == pytest.approx(logprobs, abs=1e-4)
