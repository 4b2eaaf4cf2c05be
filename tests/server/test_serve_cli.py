"""`heterollm serve` as a user runs it: a subprocess on free ports, SIGTERM drains in-flight
requests and exits 0, --metrics_port, HETEROLLM_API_KEY, and launch errors as one line + exit 2."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from conftest import free_port, spawned_children
from helpers import build_tiny_model


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("serve-llama"), "llama", max_position_embeddings=4096)


def _wait_health(proc: subprocess.Popen, url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited early ({proc.returncode}): {proc.stderr.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("serve did not become healthy")


@pytest.mark.slow  # a real serve process and a long stream: ~13 s, in CI's slow step
def test_sigterm_drains_in_flight_then_exits_0(long_model):
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, "HETEROLLM_API_KEY": "k1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "heterollm.entrypoints.cli", "serve", "--model", str(long_model), "--host=127.0.0.1",
         f"--port={port}", f"--metrics_port={metrics_port}", "--dtype=float32", "--max_model_len=4096",
         "--served_model_name=tiny", "--timeout_graceful_shutdown=60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_health(proc, url)
        auth = {"Authorization": "Bearer k1"}
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"] == "tiny"
        assert "heterollm_kv_cache_usage_perc" in httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text

        body = {"model": "tiny", "prompt": "keep going", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.Client(timeout=60) as client, \
                client.stream("POST", url + "/v1/completions", json=body, headers=auth) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.ConnectError):  # no new connections once draining
                httpx.get(url + "/health", timeout=2)
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["usage"]["completion_tokens"] == 400  # the request ran to its end
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _nice(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[16])  # field 19: nice


@pytest.mark.parametrize("setting, lowered", [(None, 10), ("0", 0), ("3", 3)])
def test_the_api_server_yields_the_cpu_to_its_engine_core(long_model, setting, lowered):
    """Once the core runs, the API server lowers its own priority (HETEROLLM_API_SERVER_NICE, default
    10); the engine core keeps the launch's."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "HETEROLLM_API_SERVER_NICE"}
    if setting is not None:
        env["HETEROLLM_API_SERVER_NICE"] = setting
    proc = subprocess.Popen(
        [sys.executable, "-m", "heterollm.entrypoints.cli", "serve", "--model", str(long_model), "--host=127.0.0.1",
         f"--port={port}", "--dtype=float32", "--max_model_len=512"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait_health(proc, f"http://127.0.0.1:{port}")
        cores = spawned_children(proc.pid)
        assert len(cores) == 1
        base = os.nice(0)  # the launch's: this test's own
        assert _nice(cores[0]) == base
        assert _nice(proc.pid) == min(19, base + lowered)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": str(long_model), "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200, r.text
    finally:
        proc.terminate()
        proc.wait(60)


def test_a_bad_api_server_nice_is_a_launch_error(long_model):
    env = {**os.environ, "HETEROLLM_API_SERVER_NICE": "high"}
    proc = subprocess.run([sys.executable, "-m", "heterollm.entrypoints.cli", "serve", "--model", str(long_model),
                           "--host=127.0.0.1", f"--port={free_port()}"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 2 and "HETEROLLM_API_SERVER_NICE='high'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_port_in_use_is_a_one_line_error(cli, long_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = cli("serve", "--model", str(long_model), "--host=127.0.0.1", f"--port={port}")
    assert r.rc == 2 and f"--port: cannot listen on 127.0.0.1:{port}" in r.err and "Traceback" not in r.err


@pytest.mark.parametrize("flag", ["--num_threads=4", "--num_response_handling_threads=8", "--enable_disagg_pd=true"])
def test_flags_without_an_equivalent_fail_fast(cli, long_model, flag):
    r = cli("serve", "--model", str(long_model), flag)
    assert r.rc == 2 and flag in r.err and "Traceback" not in r.err


def test_the_cpu_platform_leaves_a_core_for_the_http_loop(monkeypatch):
    """The CPU thread policy is the CPU backend's (Platform.configure_threads), not the server's."""
    import torch
    from heterollm_cpu.platform import CpuPlatform

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        CpuPlatform().configure_threads(1, keep_for_server=1)
        assert torch.get_num_threads() == 2  # the user's choice stands
        monkeypatch.delenv("OMP_NUM_THREADS")
        CpuPlatform().configure_threads(1, keep_for_server=1)
        assert torch.get_num_threads() == 1
        CpuPlatform().configure_threads(1, keep_for_server=1)
        assert torch.get_num_threads() == 1  # never below one
        torch.set_num_threads(4)
        CpuPlatform().configure_threads(2)  # two tensor-parallel ranks on 4 cores, no server
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def _serve(model, *flags):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "heterollm.entrypoints.cli", "serve", "--model", str(model), "--host=127.0.0.1",
         f"--port={port}", "--dtype=float32", "--max_model_len=512", "--served_model_name=tiny", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, f"http://127.0.0.1:{port}"


@pytest.mark.slow  # a serve process with two cores (11 s); test_data_parallel.py checks two replicas in process
def test_dp_size_2_serves_from_two_replicas(long_model):
    from concurrent.futures import ThreadPoolExecutor

    proc, url = _serve(long_model, "--dp_size=2")
    try:
        _wait_health(proc, url)

        def one(i):
            body = {"model": "tiny", "prompt": list(range(10, 20 + i)), "max_tokens": 24, "temperature": 0,
                    "ignore_eos": True}
            return httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        with ThreadPoolExecutor(6) as pool:
            texts = list(pool.map(one, range(6)))
        assert texts == [one(i) for i in range(6)]  # one at a time: the same answers
        metrics = httpx.get(url + "/metrics").text
        assert 'heterollm_kv_cache_total_blocks{dp_rank="1",model_name="tiny"}' in metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 0


@pytest.mark.slow  # 16 s (test_engine_core's killed-core test covers the failure path in the default run)
def test_a_dead_worker_fails_the_stream_and_serve_exits_1(long_model):
    proc, url = _serve(long_model, "--tp_size=2", "--health_check_interval_ms=200")
    try:
        _wait_health(proc, url)
        cores = spawned_children(proc.pid)  # the engine-core process, whose children are the ranks
        assert len(cores) == 1
        pids = spawned_children(cores[0])
        assert len(pids) == 2
        body = {"model": "tiny", "prompt": "go on", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=60) as client, client.stream("POST", url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            os.kill(max(pids), signal.SIGKILL)
            rest = "\n".join(lines)
        assert "error" in rest and "died" in rest
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1


@pytest.mark.slow  # a real serve process and idle waits: ~9 s, in CI's slow step
def test_rpc_idle_timeout_closes_an_idle_keep_alive_connection(long_model):
    """--rpc_idle_timeout_s 1: a keep-alive connection serves several requests, then the server
    closes it about a second after the last one (uvicorn's own default would wait 5 s)."""
    proc, url = _serve(long_model, "--rpc_idle_timeout_s=1")
    try:
        _wait_health(proc, url)
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            for _ in range(2):  # the same connection answers twice
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
                assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            t0 = time.monotonic()
            assert sock.recv(4096) == b"", "the server closes the idle connection"
            idle = time.monotonic() - t0
        assert 0.7 < idle < 4, idle
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
