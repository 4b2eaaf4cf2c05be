"""Tokenizer loading (HF folder or GGUF metadata), chat template, incremental detokenization."""
from heterollm.tokenizer.detokenizer import IncrementalDetokenizer
from heterollm.tokenizer.loader import Tokenizer, load_tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer", "load_tokenizer"]
