"""What the engine hands back per request."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from heterollm.interfaces import TokenLogprobs

if TYPE_CHECKING:
    import torch


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (OpenAI usage.prompt_tokens_details.cached_tokens)."""
    ttft_slo_missed: bool = False
    """The request asked for a first token within `ttft_slo_ms` and did not get it in time."""
    spec_num_draft_tokens: int = 0
    """Speculative decoding: drafts verified for the request's sequences."""
    spec_num_accepted_tokens: int = 0
    """Of those, accepted by the target (each step also emits one token of the target's own)."""

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted drafts / verified drafts (None when no draft was verified)."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else None

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first."""
        if self.finished_time is None or self.first_token_time is None or self.num_generated_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_generated_tokens - 1)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    """"stop" (EOS, stop token or stop string), "length" (max_tokens / max_model_len), "abort"."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended generation, when one did."""
    cumulative_logprob: float | None = None
    """The sum of the generated tokens' logprobs (the model's own distribution), when computed
    (`logprobs` asked for, or best_of > n, which ranks the sequences by it)."""
    delta_text: str = ""
    """Text new since the previous output for this request (for streaming)."""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    pooled: torch.Tensor | None = None
    """A pooling request's result (CPU, fp32): its embedding, or its relevance score as a (1,) tensor;
    `outputs` then holds one completion without tokens."""
    kv_transfer_params: dict[str, Any] | None = None
    """PD, on a PREFILL instance: what a DECODE instance needs to pull this request's K/V (set on the
    final output of a request sent with kv_transfer_params {"do_remote_decode": true})."""
    error: str | None = None
    """Why the request ended with finish_reason "error" (a DECODE instance's KV pull that failed)."""


@dataclass
class EmbeddingRequestOutput:
    """`LLM.embed`'s result for one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]


@dataclass
class ScoringRequestOutput:
    """`LLM.score`'s result for one pair: its relevance score."""

    request_id: str
    prompt_token_ids: list[int]
    score: float
