"""Keeps a serving instance registered with the service layer: in etcd (--etcd_addr) under a lease
renewed every --heart_beat_interval, or over HTTP with an xservice endpoint (--xservice_address with
--xservice_rpc_protocol=http), the way xLLM's XServiceClient does over brpc.

Registration runs on a daemon thread beside the HTTP server and never stops the instance from
serving: when etcd or the endpoint goes away the thread logs once, keeps trying each interval, and
registers again (a new lease when the old one expired) as soon as it answers. A graceful shutdown
deregisters at once (revokes the lease); a crash leaves the key to expire after --etcd_ttl.
"""
from __future__ import annotations

import json
import logging
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict

import httpx

from heterollm.config import ConfigError
from heterollm.service.etcd import EtcdClient, EtcdUnavailable, LeaseNotFound
from heterollm.service.instance import InstanceInfo, Load, instance_key

logger = logging.getLogger("heterollm.service")

XSERVICE_PATH = "/XllmRpcService"
"""brpc serves a protobuf service over HTTP at /<Service>/<Method> with JSON bodies; xllm-service's
service is XllmRpcService (Hello, RegisterInstance, Heartbeat, ...)."""


class Unreachable(Exception):
    """The service layer did not answer."""


class Registrar(ABC):
    """Registers `info` and heartbeats every `interval` seconds on a thread, once `ready()` is true
    (the HTTP server listens). `load()` is read at each heartbeat."""

    flag = ""
    """The flag that names the service layer (for messages)."""

    def __init__(self, info: InstanceInfo, load: Callable[[], Load], interval: float,
                 ready: Callable[[], bool] = lambda: True) -> None:
        self.info, self.load, self.interval, self.ready = info, load, interval, ready
        self.info.incarnation_id = self.info.incarnation_id or uuid.uuid4().hex
        self.registered = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._outage: str | None = None

    # -- the contract of a service layer ---------------------------------------------------
    @abstractmethod
    def probe(self) -> None:
        """Raise Unreachable unless the service layer answers now (a launch check)."""

    @abstractmethod
    def register(self) -> None:
        """Register `self.info` (raise Unreachable when the service layer does not answer)."""

    @abstractmethod
    def heartbeat(self) -> None:
        """Renew the registration with the current load; register again when it was lost."""

    @abstractmethod
    def deregister(self) -> None:
        """Take the instance out now (best effort)."""

    # -- the loop --------------------------------------------------------------------------
    def check(self) -> None:
        """A ConfigError naming the flag when the service layer cannot be reached at launch."""
        try:
            self.probe()
        except Unreachable as exc:
            raise ConfigError(f"--{self.flag}: cannot register this instance: {exc}") from None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="heterollm-registrar", daemon=True)
        self._thread.start()

    def stop(self, deregister: bool = True) -> None:
        """End the heartbeats; `deregister` (a graceful shutdown) takes the instance out at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if deregister and self.registered:
            self.deregister()
            self.registered = False
            logger.info("deregistered %s from %s", self.info.name, self.where)

    @property
    def where(self) -> str:
        return f"--{self.flag}"

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.ready():
                self._beat_once()
            self._stop.wait(self.interval)

    def _beat_once(self) -> None:
        self.info.load_metrics = self.load()
        try:
            if self.registered:
                self.heartbeat()
            else:
                self.register()
                self.registered = True
                logger.info("registered %s (%s, model %r) with %s", self.info.name, self.info.role,
                            self.info.model, self.where)
        except Unreachable as exc:
            if self._outage is None:
                logger.warning("service discovery: %s; still serving, retrying every %gs", exc, self.interval)
            self._outage = str(exc)
            return
        if self._outage is not None:
            logger.info("service discovery: %s answers again", self.where)
            self._outage = None


class EtcdRegistrar(Registrar):
    """The instance is the key `instance_key(namespace, role, name)` under a lease of `ttl` s."""

    flag = "etcd_addr"

    def __init__(self, address: str, namespace: str, ttl: int, info: InstanceInfo, load: Callable[[], Load],
                 interval: float, ready: Callable[[], bool] = lambda: True) -> None:
        super().__init__(info, load, interval, ready)
        self.etcd = EtcdClient(address, timeout=min(2.0, max(0.5, ttl / 2)))
        self.ttl = ttl
        self.key = instance_key(namespace, info.role, info.name)
        self.lease: str | None = None

    @property
    def where(self) -> str:
        return f"etcd at {self.etcd.address}"

    def probe(self) -> None:
        try:
            self.etcd.health()
        except EtcdUnavailable as exc:
            raise Unreachable(str(exc)) from None

    def register(self) -> None:
        try:
            self.lease = self.etcd.grant(self.ttl)
            self.etcd.put(self.key, self.info.to_json(), lease=self.lease)
        except EtcdUnavailable as exc:
            raise Unreachable(str(exc)) from None

    def heartbeat(self) -> None:
        try:
            self.etcd.keepalive(self.lease)
            self.etcd.put(self.key, self.info.to_json(), lease=self.lease)  # the new load
        except LeaseNotFound:
            logger.warning("service discovery: the lease of %s expired; registering again", self.key)
            self.registered = False
            self.register()
            self.registered = True
        except EtcdUnavailable as exc:
            raise Unreachable(str(exc)) from None

    def deregister(self) -> None:
        try:
            self.etcd.revoke(self.lease)
        except EtcdUnavailable as exc:
            logger.warning("service discovery: could not revoke the lease of %s (%s); it expires in %ds",
                           self.key, exc, self.ttl)


class XServiceRegistrar(Registrar):
    """Registration and heartbeats over HTTP to an xservice endpoint (`heterollm route` is one)."""

    flag = "xservice_address"

    def __init__(self, address: str, info: InstanceInfo, load: Callable[[], Load], interval: float,
                 ready: Callable[[], bool] = lambda: True) -> None:
        super().__init__(info, load, interval, ready)
        self.address = address
        base = address if "://" in address else f"http://{address}"
        self._http = httpx.Client(base_url=base.rstrip("/") + XSERVICE_PATH, timeout=2.0)

    @property
    def where(self) -> str:
        return f"the xservice at {self.address}"

    def _call(self, method: str, body: dict) -> dict:
        try:
            response = self._http.post(f"/{method}", json=body)
            response.raise_for_status()
            return response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise Unreachable(f"xservice at {self.address}: {method}: {type(exc).__name__}: {exc}") from None

    def probe(self) -> None:
        self._call("Hello", {})

    def register(self) -> None:
        self._call("RegisterInstance", json.loads(self.info.to_json()))

    def heartbeat(self) -> None:
        body = {"name": self.info.name, "incarnation_id": self.info.incarnation_id,
                "load_metrics": asdict(self.info.load_metrics)}
        if not self._call("Heartbeat", body).get("ok", False):  # it forgot us (it restarted): register again
            logger.warning("service discovery: %s does not know %s; registering again", self.where, self.info.name)
            self.register()

    def deregister(self) -> None:
        try:
            self._call("UnregisterInstance", {"name": self.info.name, "incarnation_id": self.info.incarnation_id})
        except Unreachable as exc:
            logger.warning("service discovery: %s; the instance drops out when its heartbeats stop", exc)
