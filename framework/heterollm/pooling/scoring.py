"""Scoring pairs: how (query, document) pairs become prompts, per kind of scorer.

- Qwen3-Reranker (`--enable_qwen3_reranker`): its published template, system prompt, instruction,
  `<Query>` and `<Document>`, the assistant turn opened with an empty think block; the score is
  P("yes") over {"no", "yes"} at the last position. A query that already starts with the template
  (`<|im_start|>`, as vLLM's examples format it on the client) is used as is, the document appended.
- A *ForSequenceClassification cross-encoder: the tokenizer's own pair encoding (text_1, text_2).
- An embedding model (--task embed): the cosine of the two normalized embeddings.
"""
from __future__ import annotations

from typing import Any

import torch

from heterollm.pooling.params import PoolingError
from heterollm.pooling.task import PoolingSetup

QWEN3_RERANKER_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
                         "and the Instruct provided. Note that the answer can only be \"yes\" or \"no\"."
                         "<|im_end|>\n<|im_start|>user\n")
QWEN3_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_RERANKER_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def pair_up(text_1: str | list[str], text_2: str | list[str], names: tuple[str, str] = ("text_1", "text_2"),
            ) -> list[tuple[str, str]]:
    """vLLM's pairing: one text_1 with each text_2, or the two lists zipped (same length)."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first:
        raise PoolingError(names[0], "must not be empty")
    if not second:
        raise PoolingError(names[1], "must not be empty")
    if len(first) == 1:
        return [(first[0], t) for t in second]
    if len(first) != len(second):
        raise PoolingError(names[1], f"{names[0]} has {len(first)} texts and {names[1]} {len(second)}: give one "
                                     f"{names[0]}, or as many as {names[1]}")
    return list(zip(first, second))


def qwen3_reranker_ids(tokenizer: Any, query: str, document: str, instruction: str | None = None) -> list[int]:
    """Qwen3-Reranker's prompt, tokenized in its three parts as its model card does."""
    if query.startswith("<|im_start|>"):
        return tokenizer.encode(query + document, add_special_tokens=False)
    body = f"<Instruct>: {instruction or QWEN3_RERANKER_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
    return (tokenizer.encode(QWEN3_RERANKER_PREFIX, add_special_tokens=False)
            + tokenizer.encode(body, add_special_tokens=False)
            + tokenizer.encode(QWEN3_RERANKER_SUFFIX, add_special_tokens=False))


def pair_ids(setup: PoolingSetup, tokenizer: Any, first: str, second: str, instruction: str | None = None) -> list[int]:
    """The prompt a model-scored pair runs as (setup.scores_by_model)."""
    if setup.reranker:
        return qwen3_reranker_ids(tokenizer, first, second, instruction)
    return list(tokenizer(first, second)["input_ids"])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1))
