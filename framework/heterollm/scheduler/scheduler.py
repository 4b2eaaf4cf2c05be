"""Continuous batching: each step fills a token budget with running decodes first, then prefill
(chunks of) waiting requests; preempts by recompute when the KV cache runs out of blocks.

Every request carries `num_computed_tokens`; a step schedules `num_tokens - num_computed_tokens`
(or a chunk of it) and the request samples once it has caught up. A prefill chunk, a decode and
a resumed (preempted) request differ only in that count. `schedule` advances the count at once and
counts a token to be sampled as pending, so the next step can be scheduled while this one runs
(`--enable_schedule_overlap`); `resolve` fills the pending input tokens in before that step runs.

Which waiting request goes first and which running one yields is the policy's (policy.py).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from heterollm.config.scheduling import SchedulerConfig
from heterollm.scheduler.request import Request, RequestRejected, RequestStatus
from heterollm.interfaces import RunnerOutput, ScheduledRequest, SchedulerOutput
from heterollm.interfaces.kv_connector import KVPull, KVPush, KVTransfers
from heterollm.kv_cache.pd import HOLD_TIMEOUT_S
from heterollm.kv_cache import KVCacheManager
from heterollm.scheduler.latency import LatencyTargets
from heterollm.scheduler.policy import SchedulingPolicy
from heterollm.scheduler.prefill_limits import PrefillLimits

logger = logging.getLogger("heterollm.scheduler")


@dataclass
class _Step:
    """One scheduling decision in the making: what is left of the budgets, what is taken so far."""

    budget: int
    seqs: int
    now: float
    chunked: bool
    protect: bool = False
    """Decodes are running and latency-aware admission keeps their TPOT target."""
    scheduled: dict[str, int] = field(default_factory=dict)
    drafts: dict[str, list[int]] = field(default_factory=dict)
    """Speculative decoding: the drafts scheduled with a request's decode (the tail of its tokens)."""
    shape: list[tuple[int, int]] = field(default_factory=list)
    """(tokens, cached context) of each request taken, for the step-time model."""
    copy_budget: int | None = None
    """--enable_control_h2d_block_num: host-tier blocks the step may still copy back (None: any)."""
    pulling_charged: bool = False
    """PD: the sequence slots of the requests waiting for their pull are taken off `seqs` already."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 in_batch_prefix_cache: bool = False, policy: SchedulingPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic, latency: LatencyTargets | None = None,
                 lookahead: int = 0, limits: PrefillLimits | None = None) -> None:
        self.config = config
        self.limits = limits or PrefillLimits()
        """When new prefills may start (memory threshold, prefill share, partial prefills: prefill_limits.py)."""
        self.lookahead = lookahead
        """Speculative decoding with a draft model: KV slots past a sampling step's tokens that the
        worker writes while it drafts (allocated with the step when the cache has room)."""
        self.latency = latency
        """--enable_latency_aware_schedule: prefill chunks are held back to keep running decodes' TPOT."""
        self.policy = policy or SchedulingPolicy(config)
        self.clock = clock
        self.in_batch_prefix_cache = in_batch_prefix_cache
        """Register the full blocks a step computes when it is scheduled, not after it ran, so later
        requests of the same step share them (`--enable_in_batch_prefix_cache`)."""

        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.deferred: list[Request] = []
        """Admitted requests whose grammar (structured output) is still compiling; they join
        `waiting` at the first schedule after it is ready."""
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_last: list[str] = []
        self._unresolved: list[tuple[ScheduledRequest, Request, int]] = []
        chunk = config.max_tokens_per_chunk_for_prefill
        self.chunk_size = min(chunk, config.max_tokens_per_batch) if chunk > 0 else config.max_tokens_per_batch
        self.held: dict[str, float] = {}
        """PD, PREFILL: finished requests whose blocks are kept for a pull -> when they are freed anyway."""
        self._pulls: list[KVPull] = []
        """PD, DECODE: pulls of the requests admitted this step."""
        self.reserved: dict[str, tuple[float, list[int], int]] = {}
        """PD PUSH, DECODE: reservation id -> (when its blocks are freed anyway, its prompt, the tokens its
        prefix cache held). The blocks are `kv.tables[reservation id]` until a request claims them."""
        self._pushes: list[KVPush] = []
        """PD PUSH, PREFILL: pushes of the requests whose prompt this step completes."""
        self.transferring: dict[str, Request] = {}
        """PD: requests whose K/V is moving (pulled in by a DECODE instance, pushed out by a PREFILL
        one) -> the request. A pulling request waits here (WAITING_FOR_REMOTE_KV) and runs once its
        pull ended; a moving request's blocks are freed only after its move ended, even if the
        request ended (or was aborted) first."""
        self.num_preemptions = 0
        self.num_deadline_missed = 0
        """Requests that waited past their TTFT deadline before being admitted (reported once each)."""

    # -- admission -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        n = request.num_prompt_tokens
        if n == 0:
            raise RequestRejected("prompt", "the prompt is empty")
        if n >= self.max_model_len + (request.pooling is not None):  # pooling samples no token after it
            raise RequestRejected("prompt", f"the prompt has {n} tokens, but the model's context length "
                                            f"(max_model_len) is {self.max_model_len}; shorten it")
        if not self.config.enable_chunked_prefill and n > self.config.max_tokens_per_batch:
            raise RequestRejected("prompt", f"the prompt has {n} tokens, more than max_tokens_per_batch="
                                            f"{self.config.max_tokens_per_batch} with chunked prefill disabled")
        if len(self.waiting) + len(self.deferred) >= self.config.request_queue_size:
            raise RequestRejected("request", f"the request queue is full (request_queue_size="
                                             f"{self.config.request_queue_size}); retry later", status=429)
        if request.request_id in self.requests or request.request_id in self.transferring \
                or request.request_id in self.held:  # an ended request's blocks still named by its id
            raise RequestRejected("request_id", f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        if request.grammar is not None and not request.grammar.ready:
            self.deferred.append(request)
        else:
            self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.deferred or self.moving())

    def moving(self) -> bool:
        """PD: whether a move somebody waits for is under way (an abandoned one's blocks come back at
        whichever step sees it end)."""
        return any(not r.kv_abandoned for r in self.transferring.values())

    def _release_deferred(self) -> None:
        """Requests whose grammar has compiled join the waiting queue, in arrival order."""
        if self.deferred:
            ready = [r for r in self.deferred if r.grammar.ready]
            self.deferred = [r for r in self.deferred if not r.grammar.ready]
            self.waiting.extend(ready)

    def finish(self, request_id: str, reason: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request in self.deferred:
            self.deferred.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = request.finish_reason or reason
        if request.kv_hold and request.finish_reason in ("stop", "length") and self.kv.tables.get(request_id):
            request.held_blocks = list(self.kv.tables[request_id])  # freed by release_held, or at expiry
            self.held[request_id] = self.clock() + HOLD_TIMEOUT_S
        elif request_id not in self.transferring:  # else freed when its move ended (update)
            self.kv.free(request_id)
        self._finished_since_last.append(request_id)

    def release_held(self, request_id: str) -> bool:
        """Free the blocks a PREFILL instance kept for `request_id`; False when it keeps none."""
        if self.held.pop(request_id, None) is None:
            return False
        self.kv.free(request_id)
        return True

    def _expire_held(self, now: float) -> None:
        for request_id in [r for r, deadline in self.held.items() if deadline <= now]:
            logger.warning("PD: the blocks kept for %s were not released within %.0f s; freeing them", request_id,
                           HOLD_TIMEOUT_S)
            self.release_held(request_id)
        for rid in [r for r, (deadline, _, _) in self.reserved.items() if deadline <= now]:
            logger.warning("PD: reservation %s was not claimed within %.0f s; freeing its blocks", rid,
                           HOLD_TIMEOUT_S)
            self.cancel_reservation(rid)

    def schedule_expiry(self) -> None:
        """Free the holds and reservations whose time is up (schedule() does it too)."""
        self._expire_held(self.clock())

    # -- PD PUSH reservations (DECODE) ---------------------------------------------------------
    def reserve(self, reservation_id: str, tokens: list[int]) -> tuple[int, list[int]] | None:
        """Blocks for a prompt whose K/V a prefill instance will write, and for its first output token:
        the device prefix cache's blocks shared, the rest allocated (blocks of the host tier or the store
        are pushed like any other: a copy scheduled now could land after a cancelled reservation's
        blocks went to another). Returns (the leading blocks the prefix cache already held, the block
        table); None when the cache has no room now."""
        self._expire_held(self.clock())  # an idle engine schedules nothing: reservations expire here too
        n = len(tokens)
        cached = 0
        if self.kv.enable_prefix_cache:
            cached = self.kv.match_prefix(reservation_id, tokens, device_only=True)
        cached = min(cached, (n - 1) // self.kv.block_size * self.kv.block_size)
        if self.kv.allocate(reservation_id, n + 1) is None:
            self.kv.drop(reservation_id)
            return None
        self.reserved[reservation_id] = (self.clock() + HOLD_TIMEOUT_S, list(tokens), cached)
        return cached // self.kv.block_size, list(self.kv.tables[reservation_id])

    def cancel_reservation(self, reservation_id: str) -> bool:
        """Free a reservation's blocks; False when there is none (claimed, expired or unknown)."""
        if self.reserved.pop(reservation_id, None) is None:
            return False
        self.kv.free(reservation_id)
        return True

    def claim(self, reservation_id: str, request: Request) -> None:
        """Give a reservation's blocks (filled by the prefill instance) to `request` (which has been
        `add`ed); it is admitted without computing its prompt."""
        held = self.reserved.pop(reservation_id, None)
        if held is None:
            raise RequestRejected("kv_transfer_params", f"reservation {reservation_id!r} is unknown or expired "
                                  f"(held {HOLD_TIMEOUT_S:.0f} s): the prefill instance's K/V is gone", status=502)
        self.kv.rename(reservation_id, request.request_id)
        request.kv_reserved = True
        request.num_cached_tokens = held[2]

    # -- one step --------------------------------------------------------------------------
    def _preempt(self, victim: Request) -> None:
        """Free the victim's blocks; it goes back to waiting and recomputes when admitted again."""
        self.running.remove(victim)
        self.kv.free(victim.request_id)
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.spec_parents = None
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        logger.debug("preempted %s (recompute)", victim.request_id)

    def schedule(self) -> SchedulerOutput:
        step = _Step(self.config.max_tokens_per_batch, self.config.max_seqs_per_batch, self.clock(),
                     self.config.enable_chunked_prefill)
        self._release_deferred()
        if self.held or self.reserved:
            self._expire_held(step.now)
        self._order_waiting(step.now)
        step.protect = self.latency is not None and any(r.is_decoding for r in self.running)
        if self.latency is not None:
            step.copy_budget = self.latency.copy_budget()
        if not self.config.enable_mix_batch and self.waiting and self._waiting_fits():
            self._admit_waiting(step)  # a prefill-only step
            if step.scheduled:
                return self._build(step)
        self._schedule_running(step)
        if self.config.enable_mix_batch or not step.scheduled:
            self._admit_waiting(step)
        return self._build(step)

    def _fit(self, step: _Step, request: Request, num_new: int, ctx: int) -> int:
        """The prefill tokens the TPOT target leaves room for (all of them when not protecting)."""
        if not step.protect or self.latency.ttft_at_risk(step.now - request.arrival_time,
                                                         request.num_total_tokens - ctx, ctx, request.ttft_slo_ms):
            return num_new
        return self.latency.cap(step.shape, num_new, ctx, step.chunked)

    def _take(self, step: _Step, request: Request, num_new: int, ctx: int, drafts: list[int] | None = None) -> None:
        self._commit_now(request, num_new)
        step.scheduled[request.request_id] = num_new
        if drafts:
            step.drafts[request.request_id] = drafts
        step.shape.append((num_new, ctx))
        step.budget -= num_new
        step.seqs -= 1

    def _admit_waiting(self, step: _Step) -> None:
        """Admit waiting requests in queue order while the budgets, the cache, the TPOT target and the
        prefill limits allow (a request that would be one partial prefill too many is passed over)."""
        lim, bs = self.limits, self.kv.block_size
        footprint = sum(min(len(self.kv.tables.get(r.request_id, ())), lim.footprint(r.num_prompt_tokens, bs))
                        for r in self.running) if lim.splits_cache else 0
        partial, long_partial = self._partial_prefills(step)
        if not step.pulling_charged:  # pulling requests run once their K/V is in: their slots are taken
            step.seqs -= self.num_pulling()
            step.pulling_charged = True
        i = 0
        blocked = False
        while i < len(self.waiting) and step.budget > 0 and step.seqs > 0:
            request = self.waiting[i]
            if request.num_pending:  # preempted while its last step is in flight: wait for its token
                break
            busy = bool(self.running)
            if busy and lim.memory_usage_threshold < 1 and self.kv.usage >= lim.memory_usage_threshold:
                break
            need = lim.footprint(request.num_prompt_tokens, bs)
            if busy and lim.splits_cache and footprint + need > lim.prefill_block_ratio * self.kv.pool.num_blocks:
                break
            if request.kv_pull is not None or request.kv_reserved:
                if not self._admit_pulled(step, request):
                    break
                del self.waiting[i]
                continue
            if blocked:  # behind a request the cache cannot hold: only claimed reservations, which have blocks
                i += 1
                continue
            cached = self._match_prefix(request, step.copy_budget)
            copies = self.kv.pending_host_blocks(request.request_id)
            remaining = request.num_tokens - cached
            num_new = min(remaining, step.budget, self.chunk_size) if step.chunked else remaining
            if num_new > step.budget:  # only without chunking: the whole prompt must fit this step
                break
            num_new = self._fit(step, request, num_new, cached)
            if num_new == 0:
                break
            long = lim.is_long(request.num_prompt_tokens)
            if num_new < remaining and not lim.partial_allowed(partial, long_partial, long):
                i += 1  # it would stay part way: shorter requests behind it may go first
                continue
            if self.kv.allocate(request.request_id, cached + num_new + self._room(
                    request, num_new, cached)) is None:
                if not any(r.kv_reserved for r in self.waiting):
                    break
                blocked = True
                i += 1
                continue
            request.num_computed_tokens = cached
            if request.num_cached_tokens is None:
                request.num_cached_tokens = cached
            if step.copy_budget is not None:
                step.copy_budget -= copies
            del self.waiting[i]
            footprint += need
            if num_new < remaining:
                partial += 1
                long_partial += long
            request.starved = request.starved or self.policy.starving(request, step.now)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._take(step, request, num_new, cached)

    def _admit_pulled(self, step: _Step, request: Request) -> bool:
        """PD, DECODE: a request whose prompt K/V is on a prefill instance. Blocks for the prompt and
        its first token (already sampled there) are allocated. PUSH: they hold the prompt's K/V
        already, and this step decodes the first token. PULL: the prompt's blocks this cache does not
        hold are pulled, starting with this step; the request waits for them (`transferring`)."""
        prompt = request.num_prompt_tokens
        if request.kv_reserved:  # PUSH: the reservation's blocks hold the prompt's K/V already
            room = self._room(request, 1, prompt)
            if room and self.kv.allocate(request.request_id, prompt + 1 + room) is None:
                room = 0
            cached = 0
            request.kv_reserved = False
        else:
            peers, remote_blocks, expires_at = request.kv_pull
            cached = self._match_prefix(request) if request.num_computed_tokens == 0 else 0
            cached = min(cached, (prompt - 1) // self.kv.block_size * self.kv.block_size)
            if self.kv.allocate(request.request_id, prompt + 1 + self._room(request, 1, prompt)) is None:
                return False
            table = self.kv.tables[request.request_id]
            first, last = cached // self.kv.block_size, self.kv.blocks_for(prompt)
            self._pulls.append(KVPull(request.request_id, peers, tuple(remote_blocks[first:last]),
                                      tuple(table[first:last]), expires_at))
            request.kv_pull = None
            request.num_computed_tokens = prompt
            if request.num_cached_tokens is None:
                request.num_cached_tokens = cached
            request.status = RequestStatus.WAITING_FOR_REMOTE_KV
            self.transferring[request.request_id] = request
            step.seqs -= 1
            return True
        request.num_computed_tokens = prompt
        if request.num_cached_tokens is None:
            request.num_cached_tokens = cached
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._take(step, request, 1, prompt)
        return True

    def _partial_prefills(self, step: _Step) -> tuple[int, int]:
        """(requests part way through their prompt after this step's running work, of them long ones)."""
        partial = long_partial = 0
        for r in self.running:
            if r.is_decoding:
                continue
            if r.num_computed_tokens + step.scheduled.get(r.request_id, 0) < r.num_total_tokens:
                partial += 1
                long_partial += self.limits.is_long(r.num_prompt_tokens)
        return partial, long_partial

    def _schedule_running(self, step: _Step) -> None:
        """Running requests: decodes first, then those still prefilling in chunks (without mixed
        batches prefills first, as waiting ones go first: else a chunked prefill would wait for every
        decode to end); under priority and deadline by rank first, so a better request is scheduled
        (and can take blocks from worse ones) before them. A request that cannot get blocks preempts
        a worse one, or yields itself."""
        prefill_first = not self.config.enable_mix_batch
        order = sorted(self.running, key=lambda r: (r.is_decoding == prefill_first,) if self.policy.fcfs else
                       (self.policy.rank(r), r.is_decoding == prefill_first))
        for request in order:
            if request.request_id in step.scheduled or request.status is not RequestStatus.RUNNING:
                continue
            if request.num_pending and self._ends_with_pending(request):
                continue
            if step.budget <= 0 or step.seqs <= 0:
                break
            if (not self.config.enable_mix_batch and step.scheduled
                    and request.is_decoding != self._decoding(step.scheduled)):
                continue
            if not request.is_decoding:
                self._rematch(request, step)
            remaining = request.num_uncomputed
            num_new = min(remaining, step.budget, self.chunk_size if not request.is_decoding else remaining)
            if not step.chunked and num_new < remaining:
                continue
            if not request.is_decoding:
                num_new = self._fit(step, request, num_new, request.num_computed_tokens)
                if num_new == 0:
                    continue
            drafts = self._drafts(request, step)
            if drafts:
                if self.kv.allocate(request.request_id, request.num_computed_tokens + num_new + len(drafts)
                                    + self._room(request, num_new + len(drafts))) is not None:
                    self._take(step, request, num_new + len(drafts), request.num_computed_tokens, drafts)
                    continue
                drafts = []  # no room for them: decode one token
            while self.kv.allocate(request.request_id, request.num_computed_tokens + num_new
                                   + self._room(request, num_new)) is None:
                others = (r for r in self.running if r.request_id not in step.scheduled and r is not request
                          and r.request_id not in self.transferring
                          and self.kv.same_pool(request.request_id, r.request_id))
                victim = self.policy.victim(others, worse_than=None if self.policy.fcfs else request)
                if victim is None and request.request_id in self.transferring:
                    break  # its blocks are being pushed out: it waits for room, it is not preempted
                self._preempt(victim or request)
                if victim is None:
                    break
            else:
                self._take(step, request, num_new, request.num_computed_tokens, drafts)

    def _drafts(self, request: Request, step: _Step) -> list[int]:
        """The request's drafts that fit this step: a decode's, within the token budget, the context
        length and max_tokens (the step may emit every draft plus one token)."""
        if not request.spec_token_ids or not request.is_decoding:
            return []
        room = min(step.budget - 1, self.max_model_len - request.num_total_tokens - 1,
                   (request.params.max_tokens or 1 << 30) - len(request.output_token_ids) - 1)
        return request.spec_token_ids[:max(room, 0)]

    def _room(self, request: Request, num_new: int, start: int | None = None) -> int:
        """The lookahead slots to allocate with a step of `num_new` tokens: all of them when the step
        samples and the cache has room beyond the step's own need, else none."""
        start = request.num_computed_tokens if start is None else start
        end = start + num_new
        if not self.lookahead or end < request.num_total_tokens:
            return 0
        return self.lookahead if self.kv.can_allocate(request.request_id, end + self.lookahead) else 0

    def _order_waiting(self, now: float) -> None:
        """Sort the waiting queue by the policy, report requests past their TTFT deadline, and under
        `priority` preempt running requests of a worse priority that keep the head from running."""
        if self.policy.fcfs and not any(r.ttft_slo_ms is not None for r in self.waiting):
            return
        for r in self.waiting:
            if r.deadline is not None and now > r.deadline:
                self.note_deadline_missed(r, now, "still waiting")
        if self.policy.fcfs:
            return
        self._sort_waiting(now)
        if self.policy.name == "priority" and self.waiting and self._preempt_for(self.waiting[0]):
            self._sort_waiting(now)

    def _sort_waiting(self, now: float) -> None:
        ordered = list(self.waiting)
        self.policy.sort_waiting(ordered, now)
        self.waiting = deque(ordered)

    def _preempt_for(self, head: Request) -> bool:
        """Preempt running requests of a strictly worse priority until the head fits (slots, blocks)."""
        preempted = False
        while not head.num_pending:
            room = len(self.running) + self.num_pulling() < self.config.max_seqs_per_batch
            if room and self._waiting_fits(head):
                break
            victim = self.policy.victim([r for r in self.running if r.request_id not in self.transferring],
                                        worse_than=head)
            if victim is None:
                break
            logger.debug("preempting %s (priority %d) for %s (priority %d)", victim.request_id, victim.priority,
                         head.request_id, head.priority)
            self._preempt(victim)
            preempted = True
        return preempted

    def note_deadline_missed(self, r: Request, now: float, when: str) -> None:
        if not r.ttft_slo_missed:
            r.ttft_slo_missed = True
            self.num_deadline_missed += 1
            logger.warning("request %s misses its TTFT target of %d ms (%s after %.0f ms)", r.request_id,
                           r.ttft_slo_ms, when, (now - r.arrival_time) * 1000)

    def _ends_with_pending(self, r: Request) -> bool:
        """Whether the token in flight is the request's last one (max_tokens or the context length)."""
        max_tokens = r.params.max_tokens or 1 << 30
        return len(r.output_token_ids) + r.num_pending >= max_tokens or r.num_total_tokens >= self.max_model_len

    def _match_prefix(self, request: Request, host_limit: int | None = None) -> int:
        """Tokens of a waiting request already in the prefix cache (0 when it is off, the request
        needs every prompt position computed (prompt logprobs, MEAN or CLS pooling), or it is part way in);
        of the host tier's blocks at most `host_limit` (--enable_control_h2d_block_num)."""
        if not self.kv.enable_prefix_cache or request.num_computed_tokens or request.needs_every_position:
            return request.num_computed_tokens
        cached = self.kv.match_prefix(request.request_id, request.cache_token_ids, host_limit=host_limit)
        return cached

    def _rematch(self, request: Request, step: _Step) -> None:
        """`--chunked_match_frequency N`: before every Nth further chunk of a chunked prefill, adopt the
        blocks that other requests have put in the cache since this one was admitted (e.g. the same
        long prompt running ahead of it with a bigger share of the token budget)."""
        request.num_prefill_chunks += 1
        kv, done = self.kv, request.num_computed_tokens
        if (not kv.enable_prefix_cache or request.needs_every_position or done % kv.block_size
                or request.num_prefill_chunks % self.config.chunked_match_frequency):
            return
        extra = kv.match_prefix(request.request_id, request.cache_token_ids, start_block=done // kv.block_size,
                                host_limit=step.copy_budget)
        copies = kv.pending_host_blocks(request.request_id)
        if extra and kv.allocate(request.request_id, done + extra) is not None:
            if step.copy_budget is not None:
                step.copy_budget -= copies
            request.num_computed_tokens += extra
            request.num_cached_tokens = (request.num_cached_tokens or 0) + extra
            kv.hits += extra

    def _commit_now(self, request: Request, num_new: int) -> None:
        """With in-batch prefix caching, offer the full blocks this step computes to the cache at once: a
        step writes all its new K/V before any attention reads the cache, so later requests of the
        same step may already share them."""
        end = request.num_computed_tokens + num_new
        if self.in_batch_prefix_cache and end <= request.num_tokens and self.kv.commit_due(request.request_id, end):
            self.kv.commit(request.request_id, request.cache_token_ids, end)

    def _decoding(self, scheduled: dict[str, int]) -> bool:
        first = next(iter(scheduled))
        return self.requests[first].is_decoding

    def _waiting_fits(self, request: Request | None = None) -> bool:
        request = request or self.waiting[0]
        num = request.num_uncomputed
        if self.config.enable_chunked_prefill:
            num = min(num, self.chunk_size, self.config.max_tokens_per_batch)
        return self.kv.can_allocate(request.request_id, request.num_computed_tokens + num)

    def _build(self, step: _Step) -> SchedulerOutput:
        """The step's batch; each request's computed count advances now (as if every draft were
        accepted: `update` takes the rejected ones back), its sample becomes pending."""
        items = []
        for request_id, num_new in step.scheduled.items():
            r = self.requests[request_id]
            start = r.num_computed_tokens
            drafts = step.drafts.get(request_id, [])
            known = num_new - len(drafts)
            tokens = r.all_token_ids[start:start + known]
            sample = start + known == r.num_total_tokens
            item = ScheduledRequest(
                request_id=request_id, new_token_ids=tokens, num_computed_tokens=start,
                block_ids=list(self.kv.tables[request_id]), sample=sample, sampling=r.sampling_info,
                output_token_ids=r.output_token_ids, prompt_token_ids=r.prompt_token_ids, pooling=r.pooling,
                mm_items=r.mm_items if r.mm_items and start < r.num_prompt_tokens else None,
                want_prompt_logprobs=r.params.prompt_logprobs is not None
                and start < r.num_prompt_tokens - 1 and min(start + num_new, r.num_prompt_tokens - 1) >= self._have(r))
            items.append(item)
            if len(tokens) < known:  # the input is a token the step in flight samples
                self._unresolved.append((item, r, num_new))
            if drafts:
                item.new_token_ids = tokens + drafts
                item.num_spec_tokens = len(drafts)
                if r.spec_parents is not None:  # a depth-first prefix of a tree is a tree
                    item.spec_parents = r.spec_parents[:len(drafts)]
            r.spec_token_ids = []
            r.spec_parents = None
            if r.kv_push is not None and start + num_new >= r.num_prompt_tokens:
                self._push(r)
            r.num_computed_tokens = start + num_new
            r.num_pending += sample
        finished, self._finished_since_last = self._finished_since_last, []
        # the host tier's copies go with a step that runs (an empty one may be skipped): they come
        # from this step's allocations, and any earlier ones wait for it
        transfers = self.kv.take_transfers() if items or self._pulls else None  # saves before a pull overwrites
        if self._pulls or self._pushes:
            transfers = {**(transfers or {}), "mooncake_transfer": KVTransfers(pulls=self._pulls,
                                                                               pushes=self._pushes)}
            self._pulls, self._pushes = [], []
        return SchedulerOutput(items, finished, kv_transfers=transfers)

    def _push(self, r: Request) -> None:
        """PD PUSH, PREFILL: this step completes `r`'s prompt; right after its forward, the blocks the
        decode instance lacks go into the ones it reserved."""
        peers, remote_blocks, skip, expires_at = r.kv_push
        last = self.kv.blocks_for(r.num_prompt_tokens)
        table = self.kv.tables[r.request_id]
        self._pushes.append(KVPush(r.request_id, peers, tuple(table[skip:last]), tuple(remote_blocks[skip:last]),
                                   expires_at))
        self.transferring[r.request_id] = r
        r.kv_push = None

    def num_pulling(self) -> int:
        """PD: requests waiting for their pull (they run once their K/V is in: their slots are taken)."""
        return sum(r.status is RequestStatus.WAITING_FOR_REMOTE_KV for r in self.transferring.values())

    def unstarted(self, output: SchedulerOutput) -> list[str]:
        """A scheduled step that will not run (the step before it failed): its moves never start, so
        nothing touches their blocks; the requests are aborted next. Returns their ids."""
        moves = pd_moves(output)
        ids = [m.request_id for m in (moves.pulls + moves.pushes)] if moves is not None else []
        for request_id in ids:
            self.transferring.pop(request_id, None)
        return ids

    def _moved(self, done: dict[str, str | None]) -> None:
        """PD: moves that ended on every rank. A request that ended meanwhile (a PREFILL instance's,
        whose push was its last act, or an aborted one) gives its blocks back now; a pulled one runs
        (it decodes its first token next step). One whose pull failed is ended by the engine."""
        for request_id, why in done.items():
            r = self.transferring.pop(request_id, None)
            if r is None:
                continue
            if r.status is RequestStatus.FINISHED:
                self.kv.free(request_id)
            elif why is None and r.status is RequestStatus.WAITING_FOR_REMOTE_KV:
                r.status = RequestStatus.RUNNING
                self.running.append(r)

    @staticmethod
    def _have(r: Request) -> int:
        """The next prompt position whose logprob is still missing."""
        return len(r.prompt_logprobs) if r.prompt_logprobs else 1

    def resolve(self) -> None:
        """Fill in the input tokens that were pending when the step was scheduled (call after the
        update of the step that sampled them, before the step runs)."""
        for item, r, num_new in self._unresolved:
            start = item.num_computed_tokens
            item.new_token_ids = r.all_token_ids[start:start + num_new]
        self._unresolved = []

    def update(self, output: SchedulerOutput, result: RunnerOutput) -> list[tuple[Request, list[int]]]:
        """Append a step's sampled tokens and cache the blocks it completed; returns (request, new
        tokens) pairs, a pooling request that got its pooled output with no tokens."""
        sampled = dict(zip(result.request_ids, zip(result.sampled_token_ids, result.logprobs,
                                                    result.prompt_logprobs)))
        pooled = dict(zip(result.request_ids, result.pooled or ()))
        changed = []
        self._moved(result.kv_done or {})
        for item in output.requests:
            r = self.requests.get(item.request_id)
            if r is None:
                continue
            r.num_pending -= item.sample
            tokens, lps, plps = sampled.get(item.request_id, ([], None, None))
            end = item.num_computed_tokens + len(item.new_token_ids)
            if item.num_spec_tokens and r.status is RequestStatus.RUNNING:
                accepted = max(len(tokens) - 1, 0)
                # K/V in place: drafts are in slots by their order, so of a tree only the accepted
                # nodes that lead its list (the first path) are where their positions want them; the
                # rest of the accepted path is recomputed next step like a prefill chunk
                rejected = item.num_spec_tokens - in_place(item.spec_parents, tokens[:accepted],
                                                           item.new_token_ids[-item.num_spec_tokens:])
                r.num_draft_tokens += item.num_spec_tokens
                r.num_accepted_tokens += accepted
                r.num_computed_tokens -= rejected
                end -= rejected
            if plps is not None:  # after a preemption, the recomputed chunks repeat positions already had
                r.prompt_logprobs = (r.prompt_logprobs or [None]) + plps[self._have(r) - item.num_computed_tokens - 1:]
            if pooled.get(item.request_id) is not None:
                r.pooled = pooled[item.request_id]
                changed.append((r, []))
            lead = []
            if r.pd_first_token:  # the prefill instance's token: reported with the first step's
                r.pd_first_token = False
                lead = r.output_token_ids[:1]
            if tokens:
                r.output_token_ids.extend(tokens)
                if lps:
                    r.logprobs.extend(lps)
            if lead or tokens:
                changed.append((r, lead + list(tokens)))
            # accepted drafts are known tokens now: the blocks they complete can be cached
            if (r.status is RequestStatus.RUNNING and r.num_computed_tokens >= end
                    and self.kv.commit_due(r.request_id, end)):
                self.kv.commit(r.request_id, r.cache_token_ids, end)
            if item.num_spec_tokens and r.status is RequestStatus.RUNNING:
                self.kv.trim(r.request_id, r.num_tokens + self.lookahead)  # the rejected drafts' slots
        return changed


def pd_moves(output: SchedulerOutput) -> KVTransfers | None:
    """A step's PD pulls and pushes (the "mooncake_transfer" connector's moves), None when none."""
    return output.kv_transfers.get("mooncake_transfer") if output.kv_transfers is not None else None


def in_place(parents: list[int] | None, accepted: list[int], drafts: list[int]) -> int:
    """How many accepted drafts have their K/V in the right slots: all of a path's; of a tree's, the
    accepted nodes that are its first drafts in order (node j at depth j + 1)."""
    if parents is None:
        return len(accepted)
    node = -1
    for depth, token in enumerate(accepted):
        node = next(i for i in range(len(drafts)) if parents[i] == node and drafts[i] == token)
        if node != depth:
            return depth
    return len(accepted)
