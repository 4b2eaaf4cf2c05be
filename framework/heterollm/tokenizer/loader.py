"""Load the tokenizer of a model source through transformers and wrap the bits the engine uses."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from heterollm.config import ConfigError


@dataclass
class Tokenizer:
    """The model's tokenizer. Safe to share between the server's event loop (encoding requests) and
    the engine thread (detokenizing outputs): a fast tokenizer's Rust core refuses concurrent use
    ("Already borrowed"), so every call holds one lock."""

    hf: Any
    eos_token_ids: set[int]
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self._lock:
            return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        with self._lock:
            return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
        with self._lock:
            return self.hf.convert_ids_to_tokens(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, add_special_tokens: bool = False,
                            **kwargs: Any) -> list[int]:
        """The rendered conversation's ids; `add_special_tokens` adds the tokenizer's own (BOS) on top of
        what the template writes (vLLM's chat field of that name)."""
        template = chat_template or self.hf.chat_template
        if not template:
            raise ValueError("messages: this model has no chat template; pass --chat_template or use a plain prompt")
        with self._lock:
            text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                               chat_template=template, **kwargs)
        # the template already holds the special tokens (BOS included where the model wants it)
        return self.encode(text, add_special_tokens=add_special_tokens)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)


def load_tokenizer(source: Path, gguf_file: Path | None, tokenizer_override: str | None,
                   eos_from_config: set[int], chat_template: str | None = None) -> Tokenizer:
    from transformers import AutoTokenizer

    try:
        if tokenizer_override:
            hf = AutoTokenizer.from_pretrained(tokenizer_override)
        elif gguf_file is not None:
            from heterollm.model_executor import gguf_cache
            hf = gguf_cache.load_tokenizer(gguf_file)
        else:
            hf = AutoTokenizer.from_pretrained(str(source))
    except (OSError, ValueError) as exc:
        where = tokenizer_override or gguf_file or source
        raise ConfigError(f"--model: cannot load a tokenizer from {where}: {exc}") from None
    if chat_template:
        path = Path(chat_template)
        hf.chat_template = path.read_text(encoding="utf-8") if path.is_file() else chat_template
    eos = set(eos_from_config)
    if hf.eos_token_id is not None:
        eos.add(int(hf.eos_token_id))
    return Tokenizer(hf, eos)
