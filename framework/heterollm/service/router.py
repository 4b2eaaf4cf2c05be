"""`heterollm route`: an OpenAI-compatible proxy in front of registered instances.

Instances come from etcd (polled every --heart_beat_interval under --etcd_namespace), from HTTP
registrations (the router is the xservice endpoint that `serve --xservice_address` points at:
POST /XllmRpcService/{Hello,RegisterInstance,Heartbeat,UnregisterInstance}), or from a static
--instances / --prefill_instances / --decode_instances lists. Each request goes where RoutingPolicy
says: to a DEFAULT or MIX instance whole, or, when the model has PREFILL and DECODE instances, through
both (service/disagg.py). A connection that fails before any byte came back is tried on the next
instance; with none left the answer is 503 with an OpenAI error body. Every outbound call has a timeout.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from heterollm.service.disagg import PDFlow
from heterollm.service.etcd import EtcdClient, EtcdUnavailable
from heterollm.service.instance import InstanceInfo, instances_prefix, is_instance_key, parse_load
from heterollm.service.pool import ALL_ROLES, PLAIN_ROLES, InstancePool, Route, RoutingPolicy
from heterollm.service.proxy import Proxied, error_response, passed_headers
from heterollm.service.registrar import XSERVICE_PATH

logger = logging.getLogger("heterollm.router")

@dataclass
class RouterSettings:
    etcd_addr: str = ""
    etcd_namespace: str = ""
    heart_beat_interval: float = 0.5
    """How often etcd is polled."""
    etcd_ttl: float = 3.0
    """An HTTP-registered instance is dropped this long after its last heartbeat."""
    instances: tuple[str, ...] = ()
    """Static instance URLs (http://host:port) serving whole requests."""
    prefill_instances: tuple[str, ...] = ()
    """Static PREFILL instance URLs."""
    decode_instances: tuple[str, ...] = ()
    """Static DECODE instance URLs."""
    connect_timeout: float = 2.0
    request_timeout: float = 600.0
    """Longest wait for an instance's next byte (a non-streamed answer's whole generation)."""


def static_info(url: str, role: str = "DEFAULT") -> InstanceInfo:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if not parts.hostname or not parts.port:
        raise ValueError(f"{url!r} is not http://host:port")
    return InstanceInfo(name=f"{parts.hostname}:{parts.port}", role=role)


class EtcdPoller:
    """Reads every instance key under the namespace each interval, on a thread, and hands the set to
    the pool on the router's loop. While etcd is away the last set stays (those instances still serve;
    a dead one is skipped when its connection fails)."""

    def __init__(self, settings: RouterSettings, pool: InstancePool, loop: asyncio.AbstractEventLoop) -> None:
        self.etcd = EtcdClient(settings.etcd_addr, timeout=min(2.0, max(0.5, settings.heart_beat_interval * 2)))
        self.settings, self.pool, self.loop = settings, pool, loop
        self._stop = threading.Event()
        self._outage = False
        self._thread = threading.Thread(target=self._run, name="heterollm-etcd-poller", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.etcd.close()

    def poll(self) -> list[InstanceInfo]:
        namespace = self.settings.etcd_namespace
        infos = []
        for key, value in self.etcd.get_prefix(instances_prefix(namespace)).items():
            if not is_instance_key(key, namespace):
                continue
            try:
                infos.append(InstanceInfo.from_json(value))
            except (ValueError, TypeError) as exc:
                logger.warning("etcd key %s is not an instance record (%s); skipped", key, exc)
        return infos

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                infos = self.poll()
            except EtcdUnavailable as exc:
                if not self._outage:
                    logger.warning("%s; keeping the last known instances, retrying", exc)
                self._outage = True
            else:
                if self._outage:
                    logger.info("etcd at %s answers again", self.etcd.address)
                self._outage = False
                self.loop.call_soon_threadsafe(self.pool.sync, "etcd", infos)
            self._stop.wait(self.settings.heart_beat_interval)


class Router:
    def __init__(self, settings: RouterSettings, policy: RoutingPolicy | None = None) -> None:
        self.settings = settings
        self.pool = InstancePool()
        self.policy = policy or RoutingPolicy()
        for urls, role in ((settings.instances, "DEFAULT"), (settings.prefill_instances, "PREFILL"),
                           (settings.decode_instances, "DECODE")):
            for url in urls:
                self.pool.add(static_info(url, role), "static")
        self.pd = PDFlow(self)
        self.poller: EtcdPoller | None = None
        self.client: httpx.AsyncClient | None = None
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_: FastAPI):
            s = self.settings
            self.client = httpx.AsyncClient(timeout=httpx.Timeout(s.request_timeout, connect=s.connect_timeout),
                                            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
            if s.etcd_addr:
                self.poller = EtcdPoller(s, self.pool, asyncio.get_running_loop())
                self.poller.start()
            yield
            if self.poller is not None:
                self.poller.stop()
            await self.client.aclose()

        app = FastAPI(title="heterollm router", lifespan=lifespan)
        for path in ("/v1/completions", "/v1/chat/completions"):
            app.add_api_route(path, self._post_route(path), methods=["POST"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/instances", self.list_instances, methods=["GET"])
        for method in ("Hello", "RegisterInstance", "Heartbeat", "UnregisterInstance"):
            app.add_api_route(f"{XSERVICE_PATH}/{method}", getattr(self, f"_xservice_{method.lower()}"),
                              methods=["POST"])
        return app

    # -- proxying ----------------------------------------------------------------------------
    def _post_route(self, path: str):
        async def handler(request: Request) -> Response:
            body = await request.body()
            try:
                fields = json.loads(body) if body else None
            except (json.JSONDecodeError, UnicodeDecodeError):
                fields = None  # the instance answers the malformed body with its own 400
            model = fields.get("model") if isinstance(fields, dict) else None
            model = model if isinstance(model, str) else None
            if self.policy.disaggregates(self.pool, model):
                if not isinstance(fields, dict):
                    return error_response(400, "the request body must be a JSON object")
                return await self.pd.run(path, fields, passed_headers(request.headers), model)
            return await self.forward(request, "POST", path, body, model)
        return handler

    async def forward(self, request: Request, method: str, path: str, body: bytes = b"",
                      model: str | None = None, roles: tuple[str, ...] | None = None) -> Response:
        """To the least loaded instance serving whole requests (or of `roles`), the next on a failed connection."""
        headers = passed_headers(request.headers)
        tried: set[str] = set()
        while True:
            route = self.policy.route(self.pool, model, tried, roles or PLAIN_ROLES)
            if route is None:
                return self._none_left(model, tried)
            tried.add(route.target.name)
            upstream = await self._send(route, method, path, body, headers)
            if upstream is not None:
                return upstream

    async def _send(self, route: Route, method: str, path: str, body: bytes, headers: dict) -> Response | None:
        """The instance's answer, or None when it could not be reached (nothing was sent back yet)."""
        target = route.target
        target.in_flight += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                target.in_flight -= 1
                released = True

        request = self.client.build_request(method, target.url + path, content=body, headers=headers)
        try:
            upstream = await self.client.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            release()
            target.down_until = time.monotonic() + max(1.0, 2 * self.settings.heart_beat_interval)
            logger.warning("instance %s unreachable (%s); trying another", target.name, type(exc).__name__)
            return None
        except httpx.TimeoutException:
            release()  # it may be computing the request: not retried elsewhere
            return error_response(504, f"instance {target.name} did not answer within {self.settings.request_timeout}s")
        except httpx.HTTPError as exc:
            release()
            return error_response(502, f"instance {target.name} failed: {type(exc).__name__}: {exc}")
        return Proxied(upstream, release)

    def _none_left(self, model: str | None, tried: set[str]) -> JSONResponse:
        if tried:
            why = f"every instance that could serve it failed to connect ({', '.join(sorted(tried))})"
        elif self.policy.registered(self.pool, ("PREFILL", "DECODE"), model):
            have = "PREFILL" if self.policy.registered(self.pool, ("PREFILL",), model) else "DECODE"
            why = (f"only {have} instances are registered" + (f" for model {model!r}" if model else "") +
                   f": disaggregated serving needs a {'DECODE' if have == 'PREFILL' else 'PREFILL'} one too, and "
                   f"no DEFAULT or MIX instance serves whole requests")
        else:
            why = "no instance is registered" + (f" for model {model!r}" if model else "")
        return error_response(503, f"no instance available: {why}")

    # -- small routes --------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        return await self.forward(request, "GET", "/v1/models", roles=ALL_ROLES)

    async def health(self) -> Response:
        if self.policy.route(self.pool, None, set()) is None and not self.policy.disaggregates(self.pool, None):
            return error_response(503, "no instance available")
        return Response(status_code=200)

    async def list_instances(self) -> dict:
        return {"instances": [i.describe() for i in self.pool.live()]}

    # -- the xservice HTTP endpoint (xllm-service's XllmRpcService methods, JSON bodies) ----------
    def _expiry(self) -> float:
        return time.monotonic() + self.settings.etcd_ttl

    async def _xservice_hello(self) -> dict:
        return {"ok": True}

    async def _xservice_registerinstance(self, request: Request) -> Response:
        try:
            info = InstanceInfo.from_json(await request.body())
        except (ValueError, TypeError) as exc:
            return error_response(400, f"not an instance record: {exc}")
        self.pool.add(info, "xservice", self._expiry())
        return JSONResponse({"status_code": 0})

    async def _xservice_heartbeat(self, request: Request) -> Response:
        try:
            body = json.loads(await request.body())
            ok = self.pool.heartbeat(str(body["name"]), str(body.get("incarnation_id", "")),
                                     parse_load(body.get("load_metrics") or {}), self._expiry())
        except (ValueError, TypeError, KeyError) as exc:
            return error_response(400, f"not a heartbeat: {exc}")
        return JSONResponse({"ok": ok})

    async def _xservice_unregisterinstance(self, request: Request) -> Response:
        try:
            name = str(json.loads(await request.body())["name"])
        except (ValueError, TypeError, KeyError) as exc:
            return error_response(400, f"not an instance name: {exc}")
        self.pool.remove(name, "deregistered (graceful shutdown)")
        return JSONResponse({"ok": True})
