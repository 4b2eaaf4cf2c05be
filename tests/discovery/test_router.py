"""`heterollm route`'s router in front of a real OpenAI server (a tiny random llama, in this process):
the same greedy answer as a direct request, streamed and not; a dead instance retried on the live
one; 503 at once when none is left; instances found in etcd and through HTTP registrations (the
xservice endpoint), dropped when their lease or heartbeats stop; PREFILL or DECODE instances alone are
not routed to (test_router_pd.py: the two together)."""
from __future__ import annotations

import pytest

import json
import time

import httpx

from heterollm.service.instance import InstanceInfo, Load
from heterollm.service.pool import InstancePool, RoutingPolicy
from heterollm.service.registrar import EtcdRegistrar, XServiceRegistrar
from heterollm.service.router import Router, RouterSettings

from .conftest import free_port, running_app, wait_for

COMPLETION = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
        "stream": True}


def _name(url: str) -> str:
    return url.removeprefix("http://")


def _stream_text(client: httpx.Client, url: str, body: dict) -> str:
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])


def _live_names(router_url: str) -> list[str]:
    return [i["name"] for i in httpx.get(router_url + "/instances", timeout=5).json()["instances"]]


def test_router_answers_as_the_instance_does(instance):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: tried first, then skipped
    with running_app(Router(RouterSettings(instances=(dead, instance))).app) as router, \
            httpx.Client(timeout=60) as client:
        direct = client.post(instance + "/v1/completions", json=COMPLETION).json()
        for _ in range(3):  # the dead one fails to connect (retried on the live one), then waits out its backoff
            routed = client.post(router + "/v1/completions", json=COMPLETION)
            assert routed.status_code == 200
            assert routed.json()["choices"][0]["text"] == direct["choices"][0]["text"]
        assert _stream_text(client, router, CHAT) == _stream_text(client, instance, CHAT)
        assert client.get(router + "/v1/models").json()["data"][0]["id"] == "tiny"
        bad = client.post(router + "/v1/completions", json={**COMPLETION, "max_tokens": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"]  # the instance's own answer, passed on
        assert client.get(router + "/health").status_code == 200


def test_no_instance_is_503_at_once():
    dead = f"http://127.0.0.1:{free_port()}"
    for settings in (RouterSettings(), RouterSettings(instances=(dead,))):
        with running_app(Router(settings).app) as router:
            start = time.monotonic()
            r = httpx.post(router + "/v1/completions", json=COMPLETION, timeout=10)
            assert time.monotonic() - start < 3
            assert r.status_code == 503
            error = r.json()["error"]
            assert error["type"] == "service_unavailable" and error["message"].startswith("no instance available")
            assert httpx.get(router + "/health", timeout=5).status_code == 503


@pytest.mark.slow  # real etcd / Mooncake timing (3-14 s): run in the slow CI step
def test_instances_from_etcd_are_routed_and_dropped_when_their_lease_ends(etcd, namespace, instance):
    settings = RouterSettings(etcd_addr=etcd.address, etcd_namespace=namespace, heart_beat_interval=0.2)
    info = InstanceInfo(name=_name(instance), model="tiny")
    reg = EtcdRegistrar(etcd.address, namespace, 1, info, lambda: Load(0, 0, 0.0), 0.2)
    with running_app(Router(settings).app) as router:
        reg.start()
        try:
            wait_for(lambda: _live_names(router) == [info.name], 5, "the router did not find the instance")
            assert httpx.post(router + "/v1/completions", json=COMPLETION, timeout=60).status_code == 200
        finally:
            reg.stop(deregister=False)  # as a kill -9: the lease runs out
        stopped = time.monotonic()
        wait_for(lambda: _live_names(router) == [], 1 + 0.2 + 2.5, "the instance outlived its lease")
        assert time.monotonic() - stopped < 1 + 0.2 + 2.5
        assert httpx.post(router + "/v1/completions", json=COMPLETION, timeout=10).status_code == 503


def test_xservice_http_registration(instance):
    settings = RouterSettings(etcd_ttl=1.0)
    router_app = Router(settings)
    with running_app(router_app.app) as router:
        address = _name(router)
        reg = XServiceRegistrar(address, InstanceInfo(name=_name(instance), model="tiny"),
                                lambda: Load(3, 1, 0.5), 0.2)
        reg.check()
        reg.start()
        wait_for(lambda: _live_names(router) == [_name(instance)], 5, "no registration over HTTP")
        listed = httpx.get(router + "/instances").json()["instances"][0]
        wait_for(lambda: httpx.get(router + "/instances").json()["instances"][0]["running"] == 3, 5, "no load")
        assert listed["source"] == "xservice" and listed["model"] == "tiny"
        assert httpx.post(router + "/v1/completions", json=COMPLETION, timeout=60).status_code == 200
        router_app.pool.instances.clear()  # as if the router restarted: a heartbeat answers ok=false ...
        wait_for(lambda: _live_names(router) == [_name(instance)], 5, "not registered again")  # ... and it does
        reg.stop(deregister=True)  # a graceful shutdown: out at once
        assert _live_names(router) == []
        reg2 = XServiceRegistrar(address, InstanceInfo(name=_name(instance)), Load, 0.2)
        reg2.start()
        wait_for(lambda: _live_names(router), 5, "no second registration")
        reg2.stop(deregister=False)  # heartbeats stop: dropped after --etcd_ttl
        stopped = time.monotonic()
        wait_for(lambda: _live_names(router) == [], 1 + 0.2 + 1.0, "kept without heartbeats")
        assert time.monotonic() - stopped < 1 + 0.2 + 1.0


def test_unreachable_xservice_is_a_launch_error():
    reg = XServiceRegistrar(f"127.0.0.1:{free_port()}", InstanceInfo(name="127.0.0.1:1"), Load, 0.5)
    try:
        reg.check()
    except Exception as exc:  # noqa: BLE001 (asserting on the type below)
        assert type(exc).__name__ == "ConfigError" and str(exc).startswith("--xservice_address: cannot register")
    else:
        raise AssertionError("no error")


def test_a_prefill_or_decode_instance_alone_is_recorded_not_routed(instance):
    with running_app(Router(RouterSettings()).app) as router:
        for role in ("PREFILL", "DECODE"):
            info = InstanceInfo(name=_name(instance), role=role, model="tiny")
            r = httpx.post(router + "/XllmRpcService/RegisterInstance", content=info.to_json(), timeout=5)
            assert r.json() == {"status_code": 0}
            assert httpx.get(router + "/instances").json()["instances"][0]["role"] == role
            assert httpx.post(router + "/v1/completions", json=COMPLETION, timeout=10).status_code == 503


def test_policy_picks_the_least_loaded_serving_the_model():
    pool = InstancePool()
    for name, load, model, role in (("a:1", Load(4, 0, 0.1), "m", "DEFAULT"), ("b:1", Load(1, 1, 0.9), "m", "MIX"),
                                    ("c:1", Load(0, 0, 0.0), "other", "DEFAULT"),
                                    ("d:1", Load(0, 0, 0.0), "m", "PREFILL")):
        pool.add(InstanceInfo(name=name, role=role, model=model, load_metrics=load), "etcd")
    policy = RoutingPolicy()
    assert policy.route(pool, "m", set()).target.name == "b:1"
    pool.instances["b:1"].in_flight = 3  # our own in-flight requests count too
    assert policy.route(pool, "m", set()).target.name == "a:1"
    assert policy.route(pool, "m", {"a:1"}).target.name == "b:1"
    assert policy.route(pool, "other", set()).target.name == "c:1"
    assert policy.route(pool, "m", {"a:1", "b:1"}) is None  # d:1 is a PREFILL instance
    assert policy.route(pool, None, set()).target.name == "c:1"


@pytest.mark.slow  # a CLI process (~5-12 s); the in-process launch check stays in the default run
def test_route_launch_errors_are_one_line(cli):
    etcd_port = free_port()
    r = cli("route", "--host=127.0.0.1", f"--port={free_port()}", f"--etcd_addr=127.0.0.1:{etcd_port}", timeout=60)
    assert r.rc == 2 and "Traceback" not in r.err
    assert r.err.strip().splitlines()[-1].startswith(
        f"heterollm: error: --etcd_addr: cannot discover instances: etcd at 127.0.0.1:{etcd_port}")
    r = cli("route", "--instances=localhost", timeout=60)
    assert r.rc == 2 and r.err.strip().endswith("--instances: 'localhost' is not http://host:port")
