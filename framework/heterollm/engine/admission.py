"""What the engine does to a request's SamplingParams when it admits it: a private copy (the
caller's object is never changed), the prompt truncated as truncate_prompt_tokens asks, token ids
checked against the vocabulary, bad words tokenized once, EOS joined to the stop tokens min_tokens
masks, and max_tokens filled in; and the best_of ranking of the finished sequences."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from heterollm.engine.outputs import CompletionOutput
from heterollm.sampling import SamplingParams, SamplingParamsError
from heterollm.scheduler.request import RequestRejected


@dataclasses.dataclass(frozen=True)
class AdmissionLimits:
    """What admission checks a request against."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    encode: Callable[[str], list[int]]
    """Text -> token ids without special tokens (for bad words)."""


def admit_params(params: SamplingParams, prompt_ids: list[int],
                 limits: AdmissionLimits) -> tuple[SamplingParams, list[int]]:
    """(the request's own copy of `params`, completed; the prompt ids it keeps). Raises
    RequestRejected naming the field at fault."""
    try:
        params = dataclasses.replace(params)  # validated again: the caller may have changed a field
    except SamplingParamsError as exc:
        raise RequestRejected(exc.field, str(exc)) from None
    prompt_ids = truncate_prompt(prompt_ids, params.truncate_prompt_tokens, limits.max_model_len)
    _check_vocab("logit_bias", list(params.logit_bias or {}), limits.vocab_size)
    _check_vocab("allowed_token_ids", params.allowed_token_ids or [], limits.vocab_size)
    params.bad_words_token_ids = bad_words_token_ids(params.bad_words, limits.encode)
    _check_vocab("bad_words", [t for word in params.bad_words_token_ids for t in word], limits.vocab_size)
    if not params.ignore_eos:
        params.all_stop_token_ids += sorted(limits.eos_token_ids - set(params.all_stop_token_ids))
    if params.max_tokens is None:
        params.max_tokens = max(1, limits.max_model_len - len(prompt_ids))
    return params, prompt_ids


def truncate_prompt(prompt_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The last `keep` prompt tokens (-1: max_model_len; None: all of them)."""
    if keep is None:
        return prompt_ids
    if keep > max_model_len:
        raise RequestRejected("truncate_prompt_tokens", f"truncate_prompt_tokens: {keep} is more than "
                                                        f"max_model_len {max_model_len}")
    keep = max_model_len if keep == -1 else keep
    return prompt_ids[-keep:]


def bad_words_token_ids(words: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """vLLM's tokenization of bad words: each word (leading spaces stripped) as-is, and with one
    leading space when that gives a different first token in as many tokens (a word mid-text)."""
    out: list[list[int]] = []
    for word in words:
        plain = encode(word.lstrip())
        if not plain:
            continue
        out.append(plain)
        spaced = encode(" " + word.lstrip())
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def _check_vocab(name: str, token_ids: list[int], vocab_size: int) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestRejected(name, f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


def best_of(completions: list[CompletionOutput], n: int, finished: bool) -> list[CompletionOutput]:
    """vLLM v0's best_of: once every sequence has finished, the n with the highest cumulative
    logprob, re-indexed 0..n-1, each whole in its delta; nothing before (which n is not known yet)."""
    if not finished:
        return []
    ranked = sorted(completions, reverse=True,
                    key=lambda c: -math.inf if c.cumulative_logprob is None else c.cumulative_logprob)[:n]
    return [dataclasses.replace(c, index=i, delta_text=c.text, delta_token_ids=list(c.token_ids))
            for i, c in enumerate(ranked)]
