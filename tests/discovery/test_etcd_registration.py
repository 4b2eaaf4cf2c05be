"""An instance's registration in a real etcd (scripts/etcd.sh): the key and the recorded fields, the
lease renewed with the load and revoked at a graceful stop, expiry when the heartbeats stop, and
registering again after etcd restarts or the lease is lost."""
from __future__ import annotations

import json
import time

import pytest

from heterollm.config import ConfigError, load_config
from heterollm.config.checks import discovery_problems
from heterollm.service.instance import InstanceInfo, Load, instance_key
from heterollm.service.registrar import EtcdRegistrar

from .conftest import free_port, wait_for


def _registrar(etcd, namespace, role="DEFAULT", ttl=2, interval=0.2, load=None):
    info = InstanceInfo(name="127.0.0.1:18123", role=role, model="tiny", block_size=8)
    return EtcdRegistrar(etcd.address, namespace, ttl, info, load or (lambda: Load(2, 3, 0.25)), interval)


def test_registration_records_role_address_model_and_load(etcd, namespace):
    client = etcd.client()
    loads = iter([Load(2, 3, 0.25)] + [Load(1, 0, 0.5)] * 1000)
    reg = _registrar(etcd, namespace, role="MIX", load=lambda: next(loads))
    key = instance_key(namespace, "MIX", "127.0.0.1:18123")
    assert key == f"{namespace}/XLLM:MIX:127.0.0.1:18123"
    reg.start()
    try:
        value = json.loads(wait_for(lambda: client.get(key), 5, "no registration in etcd"))
        assert value["name"] == "127.0.0.1:18123" and value["http_address"] == "http://127.0.0.1:18123"
        assert (value["role"], value["type"], value["model"], value["block_size"]) == ("MIX", 3, "tiny", 8)
        assert value["incarnation_id"] and value["dp_size"] == 1
        # the load is rewritten at each heartbeat
        wait_for(lambda: json.loads(client.get(key))["load_metrics"] == {
            "running_requests_num": 1, "waiting_requests_num": 0, "gpu_cache_usage_perc": 0.5}, 5, "load not updated")
    finally:
        reg.stop(deregister=True)
    assert client.get(key) is None  # the lease was revoked: gone at once, not after the TTL


@pytest.mark.slow  # real etcd / Mooncake timing (3-14 s): run in the slow CI step
def test_stopped_heartbeats_expire_within_ttl_plus_interval(etcd, namespace):
    client = etcd.client()
    reg = _registrar(etcd, namespace, ttl=1, interval=0.2)
    reg.start()
    key = reg.key
    wait_for(lambda: client.get(key), 5, "no registration")
    time.sleep(1.5)  # more than the TTL: the keepalives hold it
    assert client.get(key) is not None
    reg.stop(deregister=False)  # as a crash would: no more keepalives, no revoke
    stopped = time.monotonic()
    wait_for(lambda: client.get(key) is None, 1 + 0.2 + 2.0, "the key outlived its lease")
    # etcd checks lease expiry every 500 ms and may extend by the election timeout on a restart
    assert time.monotonic() - stopped < 1 + 0.2 + 2.0


@pytest.mark.slow  # real etcd / Mooncake timing (3-14 s): run in the slow CI step
def test_registers_again_after_etcd_restart_and_a_lost_lease(etcd, namespace):
    client = etcd.client()
    loads = {"running": 0}
    reg = _registrar(etcd, namespace, ttl=2, interval=0.2, load=lambda: Load(loads["running"], 0, 0.0))
    reg.start()
    try:
        wait_for(lambda: client.get(reg.key), 5, "no registration")
        etcd.stop()
        loads["running"] = 7
        time.sleep(1.0)  # the registrar's heartbeats fail meanwhile; it keeps trying
        assert reg._outage is not None
        etcd.start()  # same port and data dir
        wait_for(lambda: (v := client.get(reg.key)) and json.loads(v)["load_metrics"]["running_requests_num"] == 7,
                 10, "not re-registered after the restart")
        wait_for(lambda: reg._outage is None, 5, "the registrar did not notice etcd came back")
        # a lease lost while the instance could not renew it (revoked here): a new lease, the key back
        client.revoke(reg.lease)
        assert client.get(reg.key) is None
        wait_for(lambda: client.get(reg.key), 5, "not re-registered after losing the lease")
    finally:
        if not etcd.running:
            etcd.start()
        reg.stop()


def test_unreachable_etcd_is_a_launch_error_naming_the_flag():
    info = InstanceInfo(name="127.0.0.1:1")
    reg = EtcdRegistrar(f"127.0.0.1:{free_port()}", "", 3, info, Load, 0.5)
    start = time.monotonic()
    with pytest.raises(ConfigError, match="^--etcd_addr: cannot register this instance: etcd at 127.0.0.1:"):
        reg.check()
    assert time.monotonic() - start < 5


@pytest.mark.slow  # a CLI process (~5-12 s); the in-process launch check stays in the default run
def test_unreachable_etcd_exits_2_in_one_line(cli, tiny_llama):
    port = free_port()
    r = cli("serve", "--model", str(tiny_llama), "--host=127.0.0.1", f"--port={free_port()}",
            f"--etcd_addr=127.0.0.1:{port}", timeout=60)
    assert r.rc == 2
    lines = r.err.strip().splitlines()
    assert lines[-1].startswith(f"heterollm: error: --etcd_addr: cannot register this instance: etcd at 127.0.0.1:{port}")
    assert "Traceback" not in r.err


@pytest.mark.parametrize("flags, message", [
    (["--etcd_addr=a:1", "--xservice_address=b:2", "--xservice_rpc_protocol=http"],
     "--etcd_addr and --xservice_address: give one"),
    (["--xservice_address=b:2"], "--xservice_address with --xservice_rpc_protocol=baidu_std: brpc's baidu_std "
                                 "protocol is not built"),
    (["--xservice_rpc_protocol=http"], "--xservice_rpc_protocol=http: it is the protocol of --xservice_address"),
    (["--enable_service_routing=true"], "--enable_service_routing=true: service discovery is off"),
    (["--etcd_ttl=5"], "--etcd_ttl=5: service discovery is off"),
    (["--etcd_addr=nope"], "--etcd_addr=nope: expected host:port"),
    (["--etcd_addr=a:1", "--etcd_ttl=1", "--heart_beat_interval=1"], "--etcd_ttl=1: must exceed"),
])
def test_flag_combinations_refused(flags, message):
    problems = discovery_problems(load_config(["--model", "m", *flags]).config)
    assert any(p.startswith(message) for p in problems), problems


def test_flag_combinations_accepted():
    for flags in (["--etcd_addr=127.0.0.1:2379", "--enable_service_routing=true", "--etcd_namespace=prod-a"],
                  ["--xservice_address=127.0.0.1:9000", "--xservice_rpc_protocol=http", "--etcd_ttl=5"]):
        assert discovery_problems(load_config(["--model", "m", *flags]).config) == []
