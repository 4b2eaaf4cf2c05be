"""The step's data crossing the engine/executor boundary: SchedulerOutput in, RunnerOutput back."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from heterollm.interfaces.kv_connector import KVTransfers

    from heterollm.pooling import PoolingParams
    from heterollm.sampling import SamplingParams


@dataclass(frozen=True)
class SamplingInfo:
    """What a worker needs to sample for a request: its parameters and its seed offset (child i of
    an n > 1 request samples with seed + i)."""

    params: SamplingParams
    seed_offset: int = 0


@dataclass
class ScheduledRequest:
    """One request's share of a step."""

    request_id: str
    new_token_ids: list[int]
    """Tokens to compute this step: a prefill chunk, or the last sampled token for a decode."""
    num_computed_tokens: int
    """Tokens of this request already in the KV cache before this step."""
    block_ids: list[int]
    """The request's whole block table after this step's allocation."""
    sample: bool
    """Whether to sample a token after this step (False for a prefill chunk that is not the last)."""
    sampling: SamplingInfo
    """The request's sampling parameters and seed offset."""
    output_token_ids: list[int] = field(default_factory=list)
    """Tokens generated so far (for penalties)."""
    prompt_token_ids: list[int] = field(default_factory=list)
    """The full prompt (for penalties and prompt logprobs)."""
    want_prompt_logprobs: bool = False
    grammar_row: int | None = None
    """Structured output: this request's row of SchedulerOutput.grammar_bitmask (None: no grammar)."""
    pooling: PoolingParams | None = None
    """An embedding or scoring request: pooled instead of sampled once `sample` is True (its prompt
    is complete); None for a generation request."""
    num_spec_tokens: int = 0
    """Speculative decoding: the last `num_spec_tokens` of `new_token_ids` are drafts to verify (the
    step samples up to num_spec_tokens + 1 tokens for the request)."""
    spec_parents: list[int] | None = None
    """Tree speculation: each draft's parent among the drafts (-1: the token before them), in
    depth-first order; None: the drafts are one path."""
    mm_items: list[Any] | None = None
    """Multimodal input (heterollm.multimodal.MultiModalItem): every image of the request's prompt,
    sent with each step that computes prompt tokens (the runner encodes those the step reaches and
    takes the rotary positions of the whole prompt from them); None otherwise."""


@dataclass
class SchedulerOutput:
    """Everything the executor needs for one step, in batch order."""

    requests: list[ScheduledRequest]
    finished_request_ids: list[str] = field(default_factory=list)
    """Requests that ended since the last step (their per-request state can be dropped)."""
    grammar_bitmask: torch.Tensor | None = None
    """(rows, ceil(vocab / 32)) int32, packed as xgrammar packs it: the tokens each sampled request
    with a grammar may take this step (see ScheduledRequest.grammar_row); None when none has one."""
    kv_transfers: dict[str, KVTransfers] | None = None
    """KV connector name ("host", "mooncake_store") -> the block moves every rank runs before this
    step's forward, in this order; None when there are none."""

    @property
    def num_tokens(self) -> int:
        return sum(len(r.new_token_ids) for r in self.requests)


@dataclass
class TokenLogprobs:
    """Logprob of the chosen token and the top-k alternatives at one position."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class RunnerOutput:
    """Per scheduled request: the sampled tokens (empty for an unfinished prefill chunk; with
    speculative decoding, the accepted drafts and the target's own next token)."""

    request_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]
    prompt_logprobs: list[list[TokenLogprobs | None] | None]
    pooled: list[torch.Tensor | None] | None = None
    """Per scheduled request: the pooled output (CPU, fp32) of a pooling request whose prompt this step
    completed, else None; None when the step held no pooling request."""
    spec_token_ids: list[list[int]] | None = None
    """Per scheduled request: the drafts a worker-side proposer (a draft model) made for its next
    step ([] for none); None when no worker-side proposer runs."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent in this step's phases on the worker ("prepare", "forward", "sample", and
    "kv_transfer" when the step moved KV blocks), for --enable_profile_step_time and the KV
    transfer counters."""
    kv_done: dict[str, str | None] | None = None
    """PD: request id -> None for a request whose K/V move (a pull into this instance, a push out of it)
    ended on every rank by this step, or why it failed on some rank (the engine ends that request
    with the error); None when no move ended."""
    expert_load: dict[str, Any] | None = None
    """--enable_eplb: the expert-load counters after this step (sparse layer indices, choices per
    logical expert and per physical slot since start, each slot's expert, each rank's choices since
    the last re-placement, re-placements so far); None without EPLB."""
