"""The router's view of the instances (who is registered, their load, which are down) and the one
class that decides where a request goes.

PD disaggregation slots in at `RoutingPolicy.route`: a request will be prefilled on a PREFILL
instance and streamed from a DECODE one (`Route.prefill` set). Until that lands, instances
registered as PREFILL or DECODE are recorded and listed but never given a plain request."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from heterollm.service.instance import InstanceInfo, Load

logger = logging.getLogger("heterollm.router")

PLAIN_ROLES = ("DEFAULT", "MIX")
"""Roles that serve a whole request (prefill and decode) on their own."""


@dataclass
class Instance:
    info: InstanceInfo
    source: str
    """Where the router learnt of it: "etcd", "xservice" (an HTTP registration) or "static"."""
    expires_at: float | None = None
    """time.monotonic() after which it is dropped (no heartbeat since); None: it does not expire."""
    in_flight: int = 0
    """Requests this router has sent it that have not finished."""
    down_until: float = 0.0
    """After a failed connection, not picked before this time.monotonic()."""

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def url(self) -> str:
        return self.info.http_address

    def score(self) -> float:
        """Lower is less loaded: our in-flight requests plus its reported running and waiting ones,
        KV cache usage breaking ties."""
        load = self.info.load_metrics
        return self.in_flight + load.running_requests_num + load.waiting_requests_num + load.gpu_cache_usage_perc

    def describe(self) -> dict:
        load = self.info.load_metrics
        return {"name": self.name, "url": self.url, "role": self.info.role, "model": self.info.model,
                "source": self.source, "in_flight": self.in_flight, "running": load.running_requests_num,
                "waiting": load.waiting_requests_num, "kv_cache_usage": load.gpu_cache_usage_perc,
                "incarnation_id": self.info.incarnation_id}


@dataclass
class Route:
    target: Instance
    """Where the request is sent and streamed from."""
    prefill: Instance | None = None
    """PD disaggregation (not built): the PREFILL instance that computes the prompt first."""


class InstancePool:
    """Instances by name. Everything runs on the router's event loop, except `sync`, which the etcd
    poller calls through the loop too (one writer at a time)."""

    def __init__(self) -> None:
        self.instances: dict[str, Instance] = {}

    def add(self, info: InstanceInfo, source: str, expires_at: float | None = None) -> None:
        known = self.instances.get(info.name)
        if known is None or known.info.incarnation_id != info.incarnation_id:
            logger.info("instance %s (%s, model %r) from %s%s", info.name, info.role, info.model, source,
                        "" if info.role in PLAIN_ROLES else ": recorded, not routed to until PD disaggregation "
                        "is built (only DEFAULT and MIX instances serve plain requests)")
            self.instances[info.name] = Instance(info, source, expires_at)
            return
        known.info, known.source, known.expires_at = info, source, expires_at

    def heartbeat(self, name: str, incarnation_id: str, load: Load, expires_at: float) -> bool:
        """False when `name` (this incarnation of it) is not registered: it should register again."""
        known = self.instances.get(name)
        if known is None or (incarnation_id and known.info.incarnation_id != incarnation_id):
            return False
        known.info.load_metrics, known.expires_at = load, expires_at
        return True

    def remove(self, name: str, why: str) -> None:
        if self.instances.pop(name, None) is not None:
            logger.info("instance %s dropped: %s", name, why)

    def sync(self, source: str, infos: list[InstanceInfo]) -> None:
        """`infos` is everything `source` holds now: add or refresh them, drop the rest of its own."""
        names = {info.name for info in infos}
        for name in [n for n, i in self.instances.items() if i.source == source and n not in names]:
            self.remove(name, f"gone from {source} (lease expired or revoked)")
        for info in infos:
            self.add(info, source)

    def live(self) -> list[Instance]:
        """The registered instances, after dropping those whose heartbeats stopped."""
        now = time.monotonic()
        for name in [n for n, i in self.instances.items() if i.expires_at is not None and i.expires_at < now]:
            self.remove(name, "no heartbeat within --etcd_ttl")
        return list(self.instances.values())


class RoutingPolicy:
    """Least loaded first: the plain-role instance with the lowest score, among those serving
    `model` (or not saying which model they serve) and not down or already tried."""

    def route(self, pool: InstancePool, model: str | None, exclude: set[str]) -> Route | None:
        now = time.monotonic()
        candidates = [i for i in pool.live() if i.info.role in PLAIN_ROLES and i.name not in exclude
                      and i.down_until <= now and (not model or not i.info.model or i.info.model == model)]
        if not candidates:
            return None
        return Route(min(candidates, key=Instance.score))
