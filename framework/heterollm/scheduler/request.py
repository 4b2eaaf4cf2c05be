"""A request's state as it moves through the scheduler and the output processor. It sits below the
scheduler (which imports nothing from the engine); the engine builds and reads it."""
from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, field
from typing import Any
from heterollm.interfaces import TokenLogprobs
from heterollm.interfaces.batch import SamplingInfo
from heterollm.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    """PD, DECODE: admitted, its blocks allocated, its prompt's K/V being pulled from a prefill instance."""
    FINISHED = "finished"


class RequestRejected(ValueError):
    """A request the engine cannot take; `field` names the offending input (HTTP 400 / exit 2)."""

    def __init__(self, field_name: str, message: str, status: int = 400) -> None:
        self.field = field_name
        self.status = status
        super().__init__(message)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    seed_offset: int = 0
    """Added to params.seed: child i of an n > 1 request samples with seed + i."""
    max_model_len: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int | None = None
    """Prompt tokens found in the prefix cache when the request was first scheduled."""
    num_prefill_chunks: int = 0
    """Prefill chunks scheduled after the first (for --chunked_match_frequency)."""
    priority: int = 0
    """--priority_strategy=priority: lower is served first (vLLM's convention); ties go by arrival."""
    ttft_slo_ms: int | None = None
    """Target time to first token: orders requests under --priority_strategy=deadline; a request whose
    first token comes later is counted as a missed deadline under every strategy."""
    ttft_slo_missed: bool = False
    starved: bool = False
    """Admitted because it had waited past the starvation threshold: not preempted for priority."""
    num_pending: int = 0
    """Tokens sampled by a step still in flight (--enable_schedule_overlap), not yet appended."""
    grammar: Any = None
    """Structured output: the sequence's GrammarState (sampling/structured.py); the scheduler holds
    the request back until `grammar.ready` (its grammar has compiled)."""
    pooling: Any = None
    """An embedding or scoring request's PoolingParams (heterollm.pooling): it runs its prompt and ends
    with `pooled` instead of a token; None for a generation request."""
    pooled: Any = None
    """The pooled output (a CPU tensor) once the runner has produced it."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Speculative decoding: drafts for the request's next decode step (set between steps)."""
    spec_parents: list[int] | None = None
    """Tree speculation: each draft's parent among the drafts (-1: the last known token); None: a path."""
    num_draft_tokens: int = 0
    """Drafts the request's steps verified."""
    num_accepted_tokens: int = 0
    """Of those, accepted."""
    mm_items: list[Any] | None = None
    """Multimodal input: the prompt's images (heterollm.multimodal.MultiModalItem), handed to the
    runner with every step that computes prompt tokens; None for a text-only request."""
    kv_hold: bool = False
    """PD, on a PREFILL instance: keep the request's blocks when it finishes, for a DECODE instance to
    pull (`Scheduler.release_held`)."""
    held_blocks: list[int] | None = None
    """The blocks kept for it once it finished (kv_hold)."""
    kv_pull: Any = None
    """PD, on a DECODE instance: (the prefill instance's ranks, its block ids, when its hold on them
    ends: time.time()) to pull the prompt's K/V from when admitted; its first output token came with
    them. None once the pull started."""
    kv_push: Any = None
    """PD PUSH, on a PREFILL instance: (the decode instance's ranks, its reserved block ids, how many
    leading blocks it already had) to write the prompt's K/V into right after the forward that
    completes the prompt. None once scheduled."""
    pd_reservation: str | None = None
    """PD PUSH, on a PREFILL instance: the decode instance's reservation its K/V goes to."""
    kv_reserved: bool = False
    """PD PUSH, on a DECODE instance: the request took over a reservation's blocks, which the prefill
    instance filled with the prompt's K/V; admitted without computing the prompt."""
    pd_first_token: bool = False
    """The first output token came from the prefill instance and is not yet reported."""
    kv_abandoned: bool = False
    """PD: nobody waits for this request's K/V move any more (aborted, or answered with an error once
    the peer's hold ran out); its blocks come back when the move ends, and the engine need not step
    for it."""
    error: str | None = None
    """Why the request ended with finish_reason "error" (a KV pull that failed)."""

    @functools.cached_property
    def sampling_info(self) -> SamplingInfo:
        """What the executor's workers need to sample (sent with every step instead of the request)."""
        return SamplingInfo(self.params, self.seed_offset)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def cache_token_ids(self) -> list[int]:
        """What the prefix cache hashes: all_token_ids, with each image's placeholders named by the
        image's content (heterollm.multimodal.cache_token_ids)."""
        if not self.mm_items:
            return self.all_token_ids
        return self._cache_prompt_ids + self.output_token_ids

    @functools.cached_property
    def _cache_prompt_ids(self) -> list[int]:
        from heterollm.multimodal import cache_token_ids
        return cache_token_ids(self.prompt_token_ids, self.mm_items or ())

    @property
    def num_total_tokens(self) -> int:
        """Tokens known plus those a step in flight will sample (the scheduler's view)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_uncomputed(self) -> int:
        return self.num_total_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        return bool(self.output_token_ids or self.num_pending) and self.num_uncomputed == 1

    @property
    def deadline(self) -> float | None:
        """Monotonic time by which the first token is due (arrival + ttft_slo_ms)."""
        return None if self.ttft_slo_ms is None else self.arrival_time + self.ttft_slo_ms / 1000

    @property
    def needs_every_position(self) -> bool:
        """Whether every prompt position must be computed here (no prefix-cache hits): prompt logprobs,
        or pooling over positions before the last (MEAN, CLS)."""
        return self.params.prompt_logprobs is not None or (self.pooling is not None
                                                           and self.pooling.needs_every_position)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
