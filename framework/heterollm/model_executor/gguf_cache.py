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
    config = AutoConfig.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    config = _complete_moe(config, gguf_file)
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


def load_tokenizer(gguf_file: Path) -> Any:
    from transformers import AutoTokenizer

    folder = cache_folder(gguf_file)
    if (folder / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(folder))
        except Exception as exc:
            logger.warning("ignoring the cached tokenizer in %s (%s)", folder, exc)
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
