"""`heterollm route`: the router in front of `heterollm serve` instances (service/router.py), under
uvicorn on --host / --port. Instances come from etcd (--etcd_addr, --etcd_namespace), from HTTP
registrations (instances started with --xservice_address pointing here), and from --instances."""
from __future__ import annotations

import logging

from heterollm.config import ConfigError, LoadedConfig
from heterollm.config.base import FlagGroup, flag

logger = logging.getLogger("heterollm.router")


class RouteFlags(FlagGroup):
    """Flags of `heterollm route` (with --host, --port, --etcd_addr, --etcd_namespace,
    --heart_beat_interval and --etcd_ttl of the launch flags)."""

    instances: str = flag("", "Static instances, comma-separated http://host:port URLs, routed to besides those "
                              "registered in etcd or over HTTP.")
    connect_timeout: float = flag(2.0, "Seconds to connect to an instance before trying another.", gt=0)
    request_timeout: float = flag(600.0, "Seconds to wait for an instance's next byte (for a non-streamed request, "
                                         "its whole answer) before answering 504.", gt=0)


def router_settings(loaded: LoadedConfig):
    from heterollm.service.router import RouterSettings, static_info

    dist, extra = loaded.config.distributed, loaded.extra
    urls = tuple(u.strip() for u in extra["instances"].split(",") if u.strip())
    for url in urls:
        try:
            static_info(url)
        except ValueError as exc:
            raise ConfigError(f"--instances: {exc}") from None
    if dist.xservice_address:
        raise ConfigError("--xservice_address: the router is the xservice endpoint itself (instances point their "
                          "--xservice_address at its --host:--port)")
    return RouterSettings(etcd_addr=dist.etcd_addr, etcd_namespace=dist.etcd_namespace,
                          heart_beat_interval=dist.heart_beat_interval, etcd_ttl=float(dist.etcd_ttl), instances=urls,
                          connect_timeout=extra["connect_timeout"], request_timeout=extra["request_timeout"])


def run_route(loaded: LoadedConfig) -> int:
    import uvicorn

    from heterollm.entrypoints.serve import _check_port
    from heterollm.service.etcd import EtcdClient, EtcdUnavailable
    from heterollm.service.router import Router

    settings = router_settings(loaded)
    cfg = loaded.config
    host, port = cfg.server.host or "0.0.0.0", cfg.server.port
    _check_port(host, port, "port")
    if settings.etcd_addr:
        etcd = EtcdClient(settings.etcd_addr)
        try:
            etcd.health()
        except EtcdUnavailable as exc:
            raise ConfigError(f"--etcd_addr: cannot discover instances: {exc}") from None
        finally:
            etcd.close()
    router = Router(settings)
    sources = [f"etcd at {settings.etcd_addr} (namespace {settings.etcd_namespace!r})"] if settings.etcd_addr else []
    sources += [f"{len(settings.instances)} static instance(s)"] if settings.instances else []
    sources.append(f"HTTP registrations at /XllmRpcService (instances' --xservice_address={host}:{port})")
    logger.info("routing on http://%s:%d; instances from %s", host, port, ", ".join(sources))
    logger.info("PREFILL and DECODE instances are recorded but not routed to: PD disaggregation is not built")
    uvicorn.run(router.app, host=host, port=port, log_level="info", timeout_graceful_shutdown=10)
    return 0
