"""SamplingParams: what a request asks of the sampler and of the output processor."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
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
        need(self.seed is None or (isinstance(self.seed, int) and -2**63 <= self.seed and self.seed + self.n <= 2**63),
             "seed", "must be an integer that fits in 64 bits (signed)")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "must be non-negative integers")
        need(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20), "logprobs",
             "must be an integer in [0, 20]")
        need(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
             "prompt_logprobs", "must be an integer in [0, 20]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
