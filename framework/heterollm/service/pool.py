"""The router's view of the instances (who is registered, their load, which are down) and the one
class that decides where a request goes.

A request is served whole by a DEFAULT or MIX instance, or, when the model has both PREFILL and
DECODE instances, disaggregated (service/disagg.py): prefilled on the PREFILL instance the policy
picks, then decoded and streamed from the DECODE one it picks."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from heterollm.service.instance import InstanceInfo, Load

logger = logging.getLogger("heterollm.router")

PLAIN_ROLES = ("DEFAULT", "MIX")
"""Roles that serve a whole request (prefill and decode) on their own."""
ALL_ROLES = ("DEFAULT", "MIX", "PREFILL", "DECODE")


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
    kv_mode: str | None = None
    """A DECODE instance's --kv_cache_transfer_mode, once its first reservation answer said it."""

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


class InstancePool:
    """Instances by name. Everything runs on the router's event loop, except `sync`, which the etcd
    poller calls through the loop too (one writer at a time)."""

    def __init__(self) -> None:
        self.instances: dict[str, Instance] = {}

    def add(self, info: InstanceInfo, source: str, expires_at: float | None = None) -> None:
        known = self.instances.get(info.name)
        if known is None or known.info.incarnation_id != info.incarnation_id:
            logger.info("instance %s (%s, model %r) from %s", info.name, info.role, info.model, source)
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
    """Least loaded first: the instance of the wanted roles with the lowest score, among those serving
    `model` (or not saying which model they serve) and not down or already tried."""

    def route(self, pool: InstancePool, model: str | None, exclude: set[str],
              roles: tuple[str, ...] = PLAIN_ROLES) -> Route | None:
        """Where a whole request goes (a DEFAULT or MIX instance unless `roles` says otherwise)."""
        target = self.pick(pool, roles, model, exclude)
        return None if target is None else Route(target)

    def pick(self, pool: InstancePool, roles: tuple[str, ...], model: str | None, exclude: set[str]) -> Instance | None:
        now = time.monotonic()
        candidates = [i for i in self.registered(pool, roles, model) if i.name not in exclude and i.down_until <= now]
        return min(candidates, key=Instance.score) if candidates else None

    def disaggregates(self, pool: InstancePool, model: str | None) -> bool:
        """Requests for `model` run prefill and decode apart: it has PREFILL and DECODE instances."""
        return bool(self.registered(pool, ("PREFILL",), model)) and bool(self.registered(pool, ("DECODE",), model))

    @staticmethod
    def registered(pool: InstancePool, roles: tuple[str, ...], model: str | None) -> list[Instance]:
        """The live instances of `roles` serving `model`, down or not."""
        return [i for i in pool.live() if i.info.role in roles
                and (not model or not i.info.model or i.info.model == model)]
