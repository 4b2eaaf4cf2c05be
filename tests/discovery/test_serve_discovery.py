"""End to end with real processes: `heterollm serve --etcd_addr` registers in etcd, `heterollm route`
finds it there and answers as the instance does, and SIGTERM revokes the lease at once (slow: two
processes and a model load on the test host)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from heterollm.service.instance import instance_key

from .conftest import free_port, stop_process, wait_for

pytestmark = pytest.mark.slow


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "heterollm.entrypoints.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ))


def _healthy(proc: subprocess.Popen, url: str) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"exited early ({proc.returncode}): {proc.stderr.read()[-2000:]}")
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_serve_registers_route_finds_it_sigterm_revokes(etcd, namespace, tiny_llama):
    port, router_port = free_port(), free_port()
    url, router = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{router_port}"
    serve = _start("serve", "--model", str(tiny_llama), "--host=127.0.0.1", f"--port={port}", "--dtype=float32",
                   "--max_model_len=256", "--served_model_name=tiny", "--instance_role=MIX",
                   f"--etcd_addr={etcd.address}", f"--etcd_namespace={namespace}", "--etcd_ttl=3",
                   "--heart_beat_interval=0.3")
    route = _start("route", "--host=127.0.0.1", f"--port={router_port}", f"--etcd_addr={etcd.address}",
                   f"--etcd_namespace={namespace}", "--heart_beat_interval=0.3")
    key = instance_key(namespace, "MIX", f"127.0.0.1:{port}")
    client = etcd.client()
    try:
        wait_for(lambda: _healthy(serve, url), 180, "serve did not become healthy", step=0.3)
        value = json.loads(wait_for(lambda: client.get(key), 10, "serve did not register"))
        assert (value["role"], value["model"], value["http_address"]) == ("MIX", "tiny", url)
        assert set(value["load_metrics"]) == {"running_requests_num", "waiting_requests_num", "gpu_cache_usage_perc"}
        wait_for(lambda: _healthy(route, router), 60, "the router found no instance", step=0.3)
        body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 6, "temperature": 0}
        direct = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        routed = httpx.post(router + "/v1/completions", json=body, timeout=60)
        assert routed.status_code == 200 and routed.json()["choices"][0]["text"] == direct
        serve.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        wait_for(lambda: client.get(key) is None, 2.5, "the lease was not revoked at shutdown")
        assert time.monotonic() - stopped < 3  # revoked, not left to expire
        assert serve.wait(60) == 0, serve.stderr.read()[-3000:]
        wait_for(lambda: httpx.post(router + "/v1/completions", json=body, timeout=10).status_code == 503, 5,
                 "the router kept the instance")
    finally:
        for proc in (serve, route):
            stop_process(proc)
