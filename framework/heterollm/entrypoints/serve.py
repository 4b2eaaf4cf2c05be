"""`heterollm serve`: start the engine-core process of each --dp_size replica (it loads the model and
steps it), then run the OpenAI-compatible server under uvicorn in this process (HTTP, chat templates,
tokenization, streaming), talking to the cores over pyzmq (engine/core_client.py).

A core that dies fails every request in flight, turns /health to 503 and ends the server with status 1.

SIGTERM or Ctrl-C: stop accepting connections, let in-flight requests finish for up to
--timeout_graceful_shutdown seconds, stop the engine, exit 0.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from typing import Any

from heterollm import envs
from heterollm.config import ConfigError, LoadedConfig
from heterollm.config.checks import engine_replicas
from heterollm.config.base import FlagGroup, flag
from heterollm.service.instance import Load, advertised_host

logger = logging.getLogger("heterollm.server")


class ServeFlags(FlagGroup):
    """Flags of `heterollm serve` (besides every launch flag)."""

    api_key: str = flag("", "When set, every /v1 route needs 'Authorization: Bearer <key>' (401 otherwise); "
                            "/health and /metrics stay open. Default: the HETEROLLM_API_KEY environment variable.")
    timeout_graceful_shutdown: int = flag(30, "Seconds in-flight requests get to finish after SIGTERM before the "
                                              "server closes them and exits.", ge=0)
    uvicorn_log_level: str = flag("info", "uvicorn's log level (access log included at info).")


def _check_port(host: str, port: int, flag_name: str) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"--{flag_name}: cannot listen on {host}:{port} ({exc.strerror})") from None


def server_settings(loaded: LoadedConfig):
    from heterollm.entrypoints.openai.server import ServerSettings

    cfg = loaded.config
    name = cfg.fastdeploy.served_model_name or cfg.model.model_id or cfg.model.model
    api_key = loaded.extra.get("api_key") or envs.api_key()
    waiting = cfg.fastdeploy.max_waiting_time
    return ServerSettings(served_model_names=[name], model_root=cfg.model.model, api_key=api_key,
                          max_concurrent_requests=cfg.server.max_concurrent_requests,
                          max_waiting_time=float(waiting) if waiting >= 0 else None)


def make_registrar(cfg, model_name: str, host: str, port: int):
    """The instance's registration with --etcd_addr or --xservice_address, or None (not started)."""
    from heterollm.kv_cache.pd import pd_role
    from heterollm.service.instance import InstanceInfo
    from heterollm.service.registrar import EtcdRegistrar, XServiceRegistrar

    dist = cfg.distributed
    if not (dist.etcd_addr or dist.xservice_address):
        return None
    info = InstanceInfo(name=f"{advertised_host(host)}:{port}", role=pd_role(cfg),
                        model=model_name, dp_size=engine_replicas(cfg), block_size=cfg.kv_cache.block_size,
                        register_ts_ms=int(time.time() * 1000))
    idle = lambda: Load()  # noqa: E731  (replaced by the replicas' load once they run)
    if dist.etcd_addr:
        return EtcdRegistrar(dist.etcd_addr, dist.etcd_namespace, dist.etcd_ttl, info, idle, dist.heart_beat_interval)
    return XServiceRegistrar(dist.xservice_address, info, idle, dist.heart_beat_interval)


def replicas_load(replicas) -> Load:
    """Running and waiting sequences summed over the engine replicas; KV cache usage their mean."""
    stats = [replica.stats() for replica in replicas]
    return Load(running_requests_num=sum(int(s["running"]) for s in stats),
                waiting_requests_num=sum(int(s["waiting"]) for s in stats),
                gpu_cache_usage_perc=sum(float(s["kv_usage"]) for s in stats) / max(1, len(stats)))


def _graceful_server_class():
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises the signal that stopped it once shutdown is done, so the process would
        die by SIGTERM (exit -15). A graceful shutdown is a success: forget the captured signal and
        let `heterollm serve` return 0."""

        before_shutdown: Any = None
        """Called when shutdown begins, before in-flight requests drain (deregistration)."""

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                try:
                    yield
                finally:
                    self._captured_signals.clear()

        async def shutdown(self, sockets=None) -> None:
            if self.before_shutdown is not None:
                await asyncio.to_thread(self.before_shutdown)
            await super().shutdown(sockets=sockets)

    return GracefulServer


def api_server_nice() -> int:
    """HETEROLLM_API_SERVER_NICE, read before any process starts (a bad value is a launch error)."""
    try:
        return envs.api_server_nice()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def yield_to_engine_cores(increment: int) -> int:
    """Lower this process's CPU priority (nice + HETEROLLM_API_SERVER_NICE, default 10) once the engine
    cores run: they were started at the launch's priority and keep it. Where the API server and a core
    share the host's cores, a burst of HTTP work (tokenizing a wave of prompts, streaming each step's
    tokens) otherwise preempts one of the core's torch threads, and every op of the step waits for it;
    the server still gets its share of CPU time, only the core goes first. Measured on 2 Zen 4 vCPUs,
    `w8a8 --enable_graph`, vLLM's client at C=16 (bench/RESULTS.md, session 23): 312-327 out tok/s and
    1.2-1.3 s mean TTFT without, 376 and 0.88 s with. Returns the increment applied."""
    if increment <= 0:
        return 0
    try:
        os.nice(increment)
    except OSError as exc:  # a sandbox that forbids it: serve at the same priority
        logger.warning("could not lower the API server's priority (%s); serving at the engine's", exc)
        return 0
    logger.info("API server at nice +%d below its engine cores (HETEROLLM_API_SERVER_NICE=0 keeps them equal)",
                increment)
    return increment


def run_serve(loaded: LoadedConfig) -> int:
    import torch
    import uvicorn
    from prometheus_client import start_http_server

    from heterollm.engine.core_client import start_engine_cores
    from heterollm.entrypoints.openai.server import OpenAIServer
    from heterollm.plugins import resolve

    cfg = loaded.config
    host = cfg.server.host or "0.0.0.0"
    port = cfg.server.port
    _check_port(host, port, "port")
    metrics_port = cfg.fastdeploy.metrics_port
    if metrics_port is not None:
        if metrics_port == port:
            raise ConfigError(f"--metrics_port: {metrics_port} is also --port; /metrics is on the main port "
                              "anyway, leave --metrics_port unset")
        _check_port(host, metrics_port, "metrics_port")
    settings = server_settings(loaded)
    registrar = make_registrar(cfg, settings.served_model_names[0], host, port)
    if registrar is not None:
        registrar.check()  # an unreachable service layer is a launch error, before any process starts
    nice = api_server_nice()
    dp = engine_replicas(cfg)
    platform = resolve(cfg).platform  # the launch checks, before any process starts (each core runs them again)
    if dp > 1 and platform.device_type != "cpu":
        raise ConfigError(f"--dp_size={dp}: engine replicas on one host share its device; that is built for the "
                          f"CPU only (selected platform: {platform.name})")
    engines = start_engine_cores(cfg)  # one process per replica; this one keeps HTTP and tokenization
    torch.set_num_threads(1)  # the cores' torch threads get the host's cores (configure_threads)
    yield_to_engine_cores(nice)
    try:
        server = OpenAIServer(engines, settings)
    except BaseException:
        for engine in engines:
            engine.shutdown(timeout=10)
        raise
    if metrics_port is not None:
        start_http_server(metrics_port, addr=host, registry=server.metrics.registry)
        logger.info("metrics on http://%s:%d/metrics", host, metrics_port)
    idle = cfg.server.rpc_idle_timeout_s
    config = uvicorn.Config(server.app, host=host, port=port, log_level=loaded.extra["uvicorn_log_level"],
                            timeout_graceful_shutdown=loaded.extra["timeout_graceful_shutdown"],
                            timeout_keep_alive=idle if idle > 0 else 24 * 3600)
    logger.info("serving %s as %r on http://%s:%d (OpenAI API under /v1)", cfg.model.model,
                settings.served_model_names[0], host, port)
    http = _graceful_server_class()(config)

    def engine_died(why: str) -> None:
        logger.error("stopping the server: %s", why)
        http.should_exit = True

    server.on_engine_dead = engine_died
    if registrar is not None:
        registrar.load = lambda: replicas_load(server.replicas)
        registrar.ready = lambda: http.started and not http.should_exit
        http.before_shutdown = registrar.stop
        registrar.start()
    try:
        http.run()
    finally:  # normally the app's shutdown stopped them already
        if registrar is not None:
            registrar.stop(deregister=True)
        for engine in engines:
            engine.shutdown()
    dead = [r.dead for r in server.replicas if r.dead]
    if dead:
        logger.error("exiting with status 1: %s", dead[0])
        return 1
    return 0
