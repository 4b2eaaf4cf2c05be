"""SamplingParams: what a request asks of the sampler and of the output processor."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from heterollm.sampling.structured import StructuredOutputsParams


class SamplingParamsError(ValueError):
    """A bad sampling parameter; `field` names it (HTTP 400 / CLI exit 2)."""

    def __init__(self, field_name: str, message: str) -> None:
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


@dataclass
class SamplingParams:
    """Per-request sampling. temperature 0 means greedy.

    `logprobs`: number of top alternatives returned per generated token (the chosen token's own
    logprob is always included); `prompt_logprobs` likewise per prompt position.
    """

    n: int = 1
    max_tokens: int | None = 16
    """None: until EOS or the model's max length."""
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1: no top-k."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    """OpenAI's: token id -> a finite bias added to that token's logit before sampling (over HTTP
    clamped to [-100, 100]); ids outside the vocabulary are refused at admission."""
    allowed_token_ids: list[int] | None = None
    """vLLM's: only these tokens may be sampled (non-empty; in the vocabulary)."""
    bad_words: list[str] = field(default_factory=list)
    """vLLM's: words never generated. Each is tokenized as-is and with a leading space at admission;
    a one-token word's token is banned, a longer word's last token is banned right after the
    generated tokens end with its other tokens."""
    truncate_prompt_tokens: int | None = None
    """vLLM's: keep only the last k prompt tokens (k >= 1; -1: max_model_len)."""
    best_of: int | None = None
    """vLLM v0's: sample best_of (>= n) sequences, return the n with the highest cumulative logprob
    (None: n)."""
    structured_outputs: StructuredOutputsParams | dict | None = None
    """vLLM's: constrain the output to a JSON schema, any JSON object, a regex, a choice, a grammar
    or a structural tag (a StructuredOutputsParams, or a dict of its fields); needs
    --guided_decoding_backend auto or xgrammar."""
    bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False, compare=False)
    """Set by the engine at admission: the token ids of each bad word's variants."""
    all_stop_token_ids: list[int] = field(default_factory=list, init=False, repr=False, compare=False)
    """The tokens min_tokens masks until it is reached: stop_token_ids, plus (set by the engine at
    admission) the model's EOS ids unless ignore_eos."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.all_stop_token_ids = list(self.stop_token_ids)
        if self.bad_words is None:
            self.bad_words = []
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            known = set(StructuredOutputsParams.__dataclass_fields__)
            unknown = sorted(set(self.structured_outputs) - known)
            if unknown:
                raise SamplingParamsError(f"structured_outputs.{unknown[0]}", "is not a structured output field "
                                          f"(known: {', '.join(sorted(known - {'origin'}))})")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise SamplingParamsError("structured_outputs", "must be a StructuredOutputsParams or a dict of its fields")
        self._check()

    def _check(self) -> None:
        def need(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise SamplingParamsError(name, f"{msg}, got {getattr(self, name)!r}")

        need(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        need(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1), "max_tokens",
             "must be an integer >= 1")
        need(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be an integer >= 0")
        need(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", "must be <= max_tokens")
        need(math.isfinite(self.temperature) and self.temperature >= 0, "temperature", "must be a finite number >= 0")
        need(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be -1, 0 (disabled) or a positive integer")
        need(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        need(math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
             "must be a finite number > 0")
        need(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        need(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        need(self.best_of is None or (_is_int(self.best_of) and self.best_of >= self.n), "best_of",
             "must be an integer >= n")
        need(self.seed is None or (isinstance(self.seed, int) and -2**63 <= self.seed
                                   and self.seed + self.num_sequences <= 2**63),
             "seed", "must be an integer that fits in 64 bits (signed)")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "must be non-negative integers")
        need(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20), "logprobs",
             "must be an integer in [0, 20]")
        need(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
             "prompt_logprobs", "must be an integer in [0, 20]")
        need(self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
            _is_int(k) and k >= 0 and _is_number(v) and math.isfinite(v) for k, v in self.logit_bias.items())),
             "logit_bias", "must map non-negative integer token ids to finite numbers")
        need(self.allowed_token_ids is None or (isinstance(self.allowed_token_ids, list) and self.allowed_token_ids
                                                and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)),
             "allowed_token_ids", "must be a non-empty list of non-negative integers")
        need(isinstance(self.bad_words, list) and all(isinstance(w, str) and w.strip() for w in self.bad_words),
             "bad_words", "must be a list of strings that are not blank")
        need(self.truncate_prompt_tokens is None or (_is_int(self.truncate_prompt_tokens) and (
            self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1)), "truncate_prompt_tokens",
             "must be -1 (max_model_len) or an integer >= 1")

    @property
    def num_sequences(self) -> int:
        """Sequences sampled for the request: best_of, or n."""
        return self.n if self.best_of is None else self.best_of

    @property
    def needs_cumulative_logprob(self) -> bool:
        """best_of > n ranks its sequences by cumulative logprob, asked for or not."""
        return self.num_sequences > self.n

    @property
    def has_logits_processors(self) -> bool:
        """Whether the sampler masks or biases this request's logits (min_tokens decides per step)."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words_token_ids
                    or (self.min_tokens and self.all_stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
