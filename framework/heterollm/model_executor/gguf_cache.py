"""A GGUF file's config and tokenizer, converted once and kept as ordinary Hugging Face files.

transformers builds both from the GGUF metadata by parsing the whole file in Python (seconds for
a 49k-token vocabulary), on every start. The first start saves the result (`config.json`,
`tokenizer.json`, the chat template, ...) under `envs.cache_dir()/gguf/<key>`, keyed by the
file's path, size and modification time and the transformers version; later starts load those
small files. A cache that cannot be written or read is skipped (logged), never an error."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import xxhash

from heterollm import envs

logger = logging.getLogger("heterollm.loader")

FORMAT = 3
"""Bumped when what is cached changes (2: mixture-of-experts widths completed from the metadata;
3: a llama file with experts read as Mixtral)."""


def cache_folder(gguf_file: Path) -> Path:
    import transformers

    stat = gguf_file.stat()
    key = f"{FORMAT}|{gguf_file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return envs.cache_dir() / "gguf" / f"{gguf_file.stem}-{xxhash.xxh3_64_hexdigest(key.encode())}"


def load_config(gguf_file: Path) -> Any:
    from transformers import AutoConfig

    folder = cache_folder(gguf_file)
    if (folder / "config.json").is_file():
        try:
            return AutoConfig.from_pretrained(str(folder))
        except Exception as exc:  # a damaged cache entry: rebuild it
            logger.warning("ignoring the cached config in %s (%s)", folder, exc)
    config = deepseek2_config(gguf_file)  # an architecture transformers reads no GGUF config for
    if config is None:
        config = _complete_moe(AutoConfig.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name), gguf_file)
    _store(folder, "config.json", config.save_pretrained)
    return config


def _complete_moe(config: Any, gguf_file: Path) -> Any:
    """What transformers' GGUF config leaves out for mixture-of-experts files: the experts' and the
    shared expert's widths (`<arch>.expert_feed_forward_length`, `<arch>.expert_shared_feed_forward_length`),
    which it leaves at the class default; and a llama-architecture file with experts (what llama.cpp
    writes for Mixtral), which it reads as a dense Llama: that becomes a MixtralConfig with the file's
    expert count, experts per token and (per-expert) feed-forward width."""
    import gguf

    fields = gguf.GGUFReader(str(gguf_file)).fields
    arch_field = fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else ""

    def value(key: str) -> Any:
        field = fields.get(f"{arch}.{key}")
        return None if field is None else field.contents()

    experts = value("expert_count")
    if not experts:
        return config
    if config.model_type in ("llama", "mistral"):
        from transformers import MixtralConfig

        width = value("expert_feed_forward_length") or value("feed_forward_length")
        dense = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
        return MixtralConfig.from_dict({**dense, "num_local_experts": int(experts),
                                        "num_experts_per_tok": int(value("expert_used_count") or 2),
                                        "intermediate_size": int(width), "architectures": ["MixtralForCausalLM"]})
    for key, attr in (("expert_feed_forward_length", "moe_intermediate_size"),
                      ("expert_shared_feed_forward_length", "shared_expert_intermediate_size")):
        if (width := value(key)) is not None and hasattr(config, attr):
            setattr(config, attr, int(width))
    return config


def deepseek2_config(gguf_file: Path) -> Any:
    """A DeepseekV2Config / DeepseekV3Config from a `deepseek2` file's metadata (llama.cpp's converter
    for DeepSeek-V2, V3 and Kimi-K2), which transformers does not read; None for other architectures.
    llama.cpp's MLA metadata: head_count_kv 1 and key / value lengths of the latent view, the per-head
    sizes in key_length_mla / value_length_mla (older files: in key_length / value_length). Routing:
    expert_gating_func 2 (sigmoid, with the correction bias tensor exp_probs_b) is V3's; otherwise V2's
    softmax, group-limited when expert_group_count > 1. YaRN's mscale_all_dim is 10 x yarn_log_multiplier
    (the converter writes 0.1 x it), and mscale equals it, as in the published checkpoints."""
    import gguf
    from transformers import DeepseekV2Config, DeepseekV3Config

    reader = gguf.GGUFReader(str(gguf_file))
    fields = reader.fields
    arch_field = fields.get("general.architecture")
    if arch_field is None or arch_field.contents() != "deepseek2":
        return None

    def value(key: str, default: Any = None) -> Any:
        field = fields.get(key if key.startswith(("tokenizer.", "general.")) else f"deepseek2.{key}")
        return default if field is None else field.contents()

    names = {t.name for t in reader.tensors}
    rope = int(value("rope.dimension_count"))
    heads = int(value("attention.head_count"))
    key_mla, value_mla = value("attention.key_length_mla"), value("attention.value_length_mla")
    experts = int(value("expert_count"))
    common = dict(
        vocab_size=int(value("vocab_size") or len(value("tokenizer.ggml.tokens"))),
        hidden_size=int(value("embedding_length")), intermediate_size=int(value("feed_forward_length")),
        moe_intermediate_size=int(value("expert_feed_forward_length")), num_hidden_layers=int(value("block_count")),
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=int(value("context_length")),
        rms_norm_eps=float(value("attention.layer_norm_rms_epsilon")), q_lora_rank=value("attention.q_lora_rank"),
        kv_lora_rank=int(value("attention.kv_lora_rank")), qk_rope_head_dim=rope,
        qk_nope_head_dim=int(key_mla if key_mla is not None else value("attention.key_length")) - rope,
        v_head_dim=int(value_mla if value_mla is not None else value("attention.value_length")),
        n_routed_experts=experts, num_experts_per_tok=int(value("expert_used_count")),
        n_shared_experts=int(value("expert_shared_count", 0)),
        first_k_dense_replace=int(value("leading_dense_block_count", 0)),
        routed_scaling_factor=float(value("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(value("expert_weights_norm", False)),
        n_group=value("expert_group_count"), topk_group=value("expert_group_used_count"),
        tie_word_embeddings="output.weight" not in names, bos_token_id=value("tokenizer.ggml.bos_token_id"),
        eos_token_id=value("tokenizer.ggml.eos_token_id"), hidden_act="silu")
    theta = float(value("rope.freq_base", 10000.0))
    if value("rope.scaling.type") == "yarn":
        mscale = 10 * float(value("rope.scaling.yarn_log_multiplier", 0.0))
        original = int(value("rope.scaling.original_context_length"))
        common["rope_parameters"] = {"rope_type": "yarn", "rope_theta": theta, "factor": float(value("rope.scaling.factor")),
                                     "original_max_position_embeddings": original, "mscale": mscale,
                                     "mscale_all_dim": mscale, "beta_fast": 32.0, "beta_slow": 1.0}
    else:
        common["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    if int(value("expert_gating_func", 1)) == 2:
        return DeepseekV3Config(**common, architectures=["DeepseekV3ForCausalLM"])
    return DeepseekV2Config(**common, topk_method="group_limited_greedy" if (common["n_group"] or 1) > 1 else "greedy",
                            architectures=["DeepseekV2ForCausalLM"])


def load_tokenizer(gguf_file: Path) -> Any:
    from transformers import AutoTokenizer

    folder = cache_folder(gguf_file)
    if (folder / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(folder))
        except Exception as exc:
            logger.warning("ignoring the cached tokenizer in %s (%s)", folder, exc)
    if deepseek2_config(gguf_file) is not None:  # AutoTokenizer would read the config transformers lacks
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    _store(folder, "tokenizer_config.json", tokenizer.save_pretrained)
    return tokenizer


def _store(folder: Path, marker: str, save) -> None:
    """Save into a scratch folder, then move the files in; `marker` goes last, so a reader never
    sees it before the files it vouches for."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            save(tmp)
            names = sorted(os.listdir(tmp), key=lambda n: n == marker)
            for name in names:
                os.replace(os.path.join(tmp, name), folder / name)
    except (OSError, shutil.Error) as exc:
        logger.info("not caching GGUF metadata in %s: %s", folder, exc)
