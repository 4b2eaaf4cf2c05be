"""Which waiting request goes next, and which running one yields (`--priority_strategy`).

- `fcfs`: arrival order; a preempted request goes back to the front of the queue.
- `priority`: the request's `priority`, lower first, ties by arrival (vLLM's convention). A waiting
  request preempts running requests of a strictly worse priority when it cannot get a slot or
  KV blocks otherwise.
- `deadline`: earliest deadline first, deadline = arrival + `ttft_slo_ms` (requests without one:
  + `--max_global_ttft_ms` when set, else after every request that has one).

Starvation prevention (`--enable_starve_prevent`, priority and deadline): while waiting, a
request's effective priority improves by `--aggressive_coeff` levels per reference time, and once it
has waited longer than `--starve_threshold` reference times it is *starving*: it goes ahead of
every request that is not, and once admitted it is never preempted for priority. The reference
time is the request's `ttft_slo_ms`, else `--max_global_ttft_ms`, else 10 s.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

from heterollm.config.base import INT32_MAX
from heterollm.config.scheduling import SchedulerConfig
from heterollm.scheduler.request import Request

DEFAULT_REFERENCE_S = 10.0
"""Starvation reference time of a request with no TTFT target and no --max_global_ttft_ms."""


class SchedulingPolicy:
    def __init__(self, config: SchedulerConfig, max_global_ttft_ms: int = INT32_MAX) -> None:
        self.name = config.priority_strategy
        self.starve_prevent = config.enable_starve_prevent and self.name != "fcfs"
        self.starve_threshold = config.starve_threshold
        self.aggressive_coeff = config.aggressive_coeff
        self.global_ttft_s = None if max_global_ttft_ms >= INT32_MAX else max_global_ttft_ms / 1000

    @property
    def fcfs(self) -> bool:
        return self.name == "fcfs"

    def reference_s(self, r: Request) -> float:
        if r.ttft_slo_ms is not None:
            return r.ttft_slo_ms / 1000
        return self.global_ttft_s or DEFAULT_REFERENCE_S

    def deadline(self, r: Request) -> float:
        if r.deadline is not None:
            return r.deadline
        return r.arrival_time + self.global_ttft_s if self.global_ttft_s is not None else math.inf

    def starving(self, r: Request, now: float) -> bool:
        return self.starve_prevent and now - r.arrival_time > self.starve_threshold * self.reference_s(r)

    def rank(self, r: Request) -> tuple:
        """The static order between two requests (lower first); decides priority preemption."""
        if self.name == "priority":
            return (r.priority, r.arrival_time)
        if self.name == "deadline":
            return (self.deadline(r), r.arrival_time)
        return ()  # fcfs: the running list's own (admission) order

    def waiting_key(self, r: Request, now: float) -> tuple:
        """The order of the waiting queue: starving requests first (by arrival), then by rank, with
        priorities aged by the time waited."""
        if self.starving(r, now):
            return (0, r.arrival_time, 0.0)
        if self.name == "priority" and self.starve_prevent:
            aged = r.priority - self.aggressive_coeff * (now - r.arrival_time) / self.reference_s(r)
            return (1, aged, r.arrival_time)
        return (1, *self.rank(r)) if not self.fcfs else (1, r.arrival_time)

    def sort_waiting(self, waiting: list[Request], now: float) -> None:
        if not self.fcfs:
            waiting.sort(key=lambda r: self.waiting_key(r, now))

    def victim(self, running: Iterable[Request], worse_than: Request | None = None) -> Request | None:
        """The running request to preempt: the last admitted under fcfs, else the worst ranked one
        (not starved ones while others remain). With `worse_than`, only a strictly worse one."""
        running = list(running)
        if not running:
            return None
        if self.fcfs:
            return running[-1] if worse_than is None else None
        pool = [r for r in running if not r.starved] or (running if worse_than is None else [])
        if not pool:
            return None
        worst = max(pool, key=self.rank)
        if worse_than is not None and not self.rank(worse_than) < self.rank(worst):
            return None
        return worst
