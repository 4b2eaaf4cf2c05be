"""`heterollm route`: the router in front of `heterollm serve` instances (service/router.py), under
uvicorn on --host / --port. Instances come from etcd (--etcd_addr, --etcd_namespace), from HTTP
registrations (instances started with --xservice_address pointing here), and from --instances,
--prefill_instances and --decode_instances (prefill/decode disaggregation, service/disagg.py)."""
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
    prefill_instances: str = flag("", "Static PREFILL instances (started with --instance_role PREFILL), "
                                      "comma-separated http://host:port URLs: with DECODE ones, each request is "
                                      "prefilled on one and decoded on the other.")
    decode_instances: str = flag("", "Static DECODE instances (started with --instance_role DECODE), "
                                     "comma-separated http://host:port URLs.")
    connect_timeout: float = flag(2.0, "Seconds to connect to an instance before trying another.", gt=0)
    request_timeout: float = flag(600.0, "Seconds to wait for an instance's next byte (for a non-streamed request, "
                                         "its whole answer) before answering 504.", gt=0)


def router_settings(loaded: LoadedConfig):
    from heterollm.service.router import RouterSettings, static_info

    dist, extra = loaded.config.distributed, loaded.extra
    lists = {}
    for name in ("instances", "prefill_instances", "decode_instances"):
        lists[name] = tuple(u.strip() for u in extra[name].split(",") if u.strip())
        for url in lists[name]:
            try:
                static_info(url)
            except ValueError as exc:
                raise ConfigError(f"--{name}: {exc}") from None
    if loaded.config.pd.kv_push_dst_rotate:
        raise ConfigError("--kv_push_dst_rotate: it orders a PREFILL instance's PUSH writes over the decode ranks; "
                          "the router moves no KV: give it to heterollm serve --instance_role PREFILL")
    if dist.xservice_address:
        raise ConfigError("--xservice_address: the router is the xservice endpoint itself (instances point their "
                          "--xservice_address at its --host:--port)")
    return RouterSettings(etcd_addr=dist.etcd_addr, etcd_namespace=dist.etcd_namespace,
                          heart_beat_interval=dist.heart_beat_interval, etcd_ttl=float(dist.etcd_ttl),
                          instances=lists["instances"],
                          prefill_instances=lists["prefill_instances"], decode_instances=lists["decode_instances"],
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
    for urls, what in ((settings.instances, ""), (settings.prefill_instances, " PREFILL"),
                       (settings.decode_instances, " DECODE")):
        sources += [f"{len(urls)} static{what} instance(s)"] if urls else []
    sources.append(f"HTTP registrations at /XllmRpcService (instances' --xservice_address={host}:{port})")
    logger.info("routing on http://%s:%d; instances from %s", host, port, ", ".join(sources))
    uvicorn.run(router.app, host=host, port=port, log_level="info", timeout_graceful_shutdown=10)
    return 0
