"""Prefill/decode disaggregation end to end: the router in front of a PREFILL and a DECODE instance of
the same tiny llama (the KV cache moves over Mooncake's transfer engine, TCP) answers with a single
instance's greedy text, streamed and not; a PREFILL instance killed after its answer and before the
pull is a clear error, or a retry on another PREFILL instance through the router; KV blocks come back
on both sides (/metrics). The first test runs the instances in this process; the others run real
`heterollm serve` processes registered in etcd and a `heterollm route` process that finds them there
(slow)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from heterollm.service.router import Router, RouterSettings

from .conftest import free_port, running_app, stop_process, wait_for

COMPLETION = {"model": "tiny", "prompt": "The quick brown fox jumps over", "max_tokens": 6, "temperature": 0,
              "ignore_eos": True}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 6, "temperature": 0,
        "ignore_eos": True}
FLAGS = {"dtype": "float32", "block_size": 8, "num_gpu_blocks_override": 96, "max_model_len": 256}


def _text(client: httpx.Client, url: str, path: str, body: dict, stream: bool) -> str:
    chat = path.endswith("/chat/completions")
    if not stream:
        r = client.post(url + path, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]
    with client.stream("POST", url + path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [c for e in events[:-1] for c in json.loads(e)["choices"]]
    return "".join((c["delta"].get("content") or "") if chat else c["text"] for c in chunks)


def _answers(client: httpx.Client, url: str) -> list[str]:
    return [_text(client, url, path, body, stream) for path, body in (("/v1/completions", COMPLETION),
                                                                      ("/v1/chat/completions", CHAT))
            for stream in (False, True)]


@pytest.mark.parametrize("mode", ["PULL", "PUSH"])
def test_router_over_in_process_prefill_and_decode_instances(tiny_llama, mode):
    from heterollm.config import load_config
    from heterollm.engine.llm_engine import LLMEngine
    from heterollm.entrypoints.openai.server import OpenAIServer, ServerSettings

    def server(**flags) -> FastAPI:
        engine = LLMEngine(load_config([], overrides={"model": str(tiny_llama), **FLAGS, **flags}).config)
        return OpenAIServer(engine, ServerSettings(served_model_names=["tiny"])).app

    pd = {"kv_cache_transfer_mode": mode}
    with ExitStack() as stack, httpx.Client(timeout=60) as client:
        p = stack.enter_context(running_app(server(instance_role="PREFILL", transfer_listen_port=free_port(), **pd)))
        d = stack.enter_context(running_app(server(instance_role="DECODE", transfer_listen_port=free_port(), **pd)))
        plain = stack.enter_context(running_app(server()))
        router = stack.enter_context(running_app(Router(RouterSettings(prefill_instances=(p,), decode_instances=(d,),
                                                                       request_timeout=60)).app))
        start = {p: free_blocks(p), d: free_blocks(d)}
        assert _answers(client, router) == _answers(client, plain)
        moved = {"PULL": (d, "heterollm_kv_pull_blocks"), "PUSH": (p, "heterollm_kv_push_blocks")}[mode]
        assert _metric(*moved) > 0, f"the KV cache did not move by {mode}"
        for url, blocks in start.items():  # P's release (PULL) comes after D's answer
            wait_for(lambda: free_blocks(url) == blocks, 10, f"{url} did not free its blocks ({start})", step=0.1)


# -- real processes ----------------------------------------------------------------------------------
def _start(log: Path, *args: str) -> subprocess.Popen:
    with open(log, "w") as err:  # a file, not a pipe: a chatty process never blocks on a full pipe
        return subprocess.Popen([sys.executable, "-m", "heterollm.entrypoints.cli", *args], stdout=subprocess.DEVNULL,
                                stderr=err, text=True, env=dict(os.environ))


def _serve(model: Path, log: Path, port: int, *flags: str) -> subprocess.Popen:
    return _start(log, "serve", "--model", str(model), "--host=127.0.0.1", f"--port={port}", "--served_model_name=tiny",
                  *(f"--{k}={v}" for k, v in FLAGS.items()), *flags)


def _pd_flags(role: str) -> list[str]:
    return [f"--instance_role={role}", "--kv_cache_transfer_mode=PULL", f"--transfer_listen_port={free_port()}"]


def _healthy(proc: subprocess.Popen, url: str, log: Path) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"exited early ({proc.returncode}): {log.read_text()[-3000:]}")
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def _stop(proc: subprocess.Popen) -> None:
    stop_process(proc)


def free_blocks(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return float(re.search(r"^heterollm_kv_cache_free_blocks\{[^}]*\} (\S+)$", text, re.M).group(1))


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:_total)?(?:{{[^}}]*}})? (\S+)$", text, re.M))


def finished(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(r"^heterollm_requests_total\{[^}]*\} (\S+)$", text, re.M))


class Cluster:
    def __init__(self, model: Path, folder: Path) -> None:
        self.model, self.folder = model, folder
        self.procs: dict[str, tuple[subprocess.Popen, str, Path]] = {}

    def serve(self, name: str, *flags: str) -> str:
        port, log = free_port(), self.folder / f"{name}.log"
        self.procs[name] = (_serve(self.model, log, port, *flags), f"http://127.0.0.1:{port}", log)
        return self.procs[name][1]

    def route(self, name: str, *flags: str) -> str:
        port, log = free_port(), self.folder / f"{name}.log"
        self.procs[name] = (_start(log, "route", "--host=127.0.0.1", f"--port={port}", *flags),
                            f"http://127.0.0.1:{port}", log)
        return self.procs[name][1]

    def wait(self) -> None:
        for proc, url, log in self.procs.values():
            wait_for(lambda: _healthy(proc, url, log), 240, f"{log.stem} did not become healthy", step=0.3)

    def url(self, name: str) -> str:
        return self.procs[name][1]

    def proc(self, name: str) -> subprocess.Popen:
        return self.procs[name][0]

    def stop(self) -> None:
        for proc, _, _ in self.procs.values():
            _stop(proc)


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory, etcd) -> Iterator[Cluster]:
    """PREFILL, DECODE and MIX instances registered in etcd, and a router that finds them there (with a
    PREFILL and DECODE pair present it disaggregates, MIX or not)."""
    c = Cluster(tiny_llama, tmp_path_factory.mktemp("pd-serve"))
    discovery = [f"--etcd_addr={etcd.address}", "--etcd_namespace=pd-serve", "--heart_beat_interval=0.3"]
    try:
        c.serve("prefill", *_pd_flags("PREFILL"), *discovery)
        c.serve("decode", *_pd_flags("DECODE"), *discovery)
        c.serve("mix", "--instance_role=MIX", *discovery)
        c.route("router", *discovery, "--request_timeout=60")
        c.wait()
        wait_for(lambda: len(httpx.get(c.url("router") + "/instances", timeout=5).json()["instances"]) == 3, 30,
                 "the router did not find the three instances in etcd", step=0.3)
        yield c
    finally:
        c.stop()


@pytest.mark.slow
def test_routed_answers_are_a_single_instances_and_blocks_come_back(cluster):
    p, d = cluster.url("prefill"), cluster.url("decode")
    start = {p: free_blocks(p), d: free_blocks(d)}
    with httpx.Client(timeout=120) as client:
        assert _answers(client, cluster.url("router")) == _answers(client, cluster.url("mix"))
    assert finished(cluster.url("mix")) == 4 and finished(p) == 4  # the routed four went through P and D
    for url, blocks in start.items():
        wait_for(lambda: free_blocks(url) == blocks, 10, f"{url} did not free its blocks ({start})", step=0.2)


def _kill_after(target: str, proc: subprocess.Popen, when=lambda body: True) -> FastAPI:
    """An instance's front: passes each completion request on to `target`, and kills the instance once
    it has answered one that `when` (of the request's JSON body) picks."""
    app = FastAPI()

    async def forward(request: Request) -> Response:
        body = await request.body()
        async with httpx.AsyncClient(timeout=60) as client:
            r = await client.post(target + request.url.path, content=body,
                                  headers={"content-type": "application/json"})
        if when(json.loads(body)):
            _stop_hard(proc)
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    for path in ("/v1/completions", "/v1/chat/completions"):
        app.add_api_route(path, forward, methods=["POST"])
    return app


@pytest.mark.slow
def test_a_prefill_instance_killed_before_the_pull(cluster):
    d = cluster.url("decode")
    doomed = [cluster.serve(f"doomed{i}", *_pd_flags("PREFILL")) for i in range(2)]
    cluster.wait()
    start = free_blocks(d)
    failed = {"type": "kv_transfer_failed", "param": "kv_transfer_params", "code": 502}
    with httpx.Client(timeout=60) as client:
        # by hand: P answers, dies; D's pull fails with a clear error, streamed or not, and no hang
        one = {**COMPLETION, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        params = client.post(doomed[0] + "/v1/completions", json=one).json()["kv_transfer_params"]
        _stop_hard(cluster.proc("doomed0"))
        began = time.monotonic()
        r = client.post(d + "/v1/completions", json={**COMPLETION, "kv_transfer_params": params})
        assert r.status_code == 502 and {k: r.json()["error"][k] for k in failed} == failed, r.text
        assert "pulling the prompt's KV failed" in r.json()["error"]["message"]
        with client.stream("POST", d + "/v1/completions",
                           json={**COMPLETION, "stream": True, "kv_transfer_params": params}) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert json.loads(events[0])["error"]["type"] == "kv_transfer_failed" and events[1:] == ["[DONE]"]
        assert time.monotonic() - began < 30
        # through the router: the first P dies after answering, the flow runs again on the live one
        with running_app(_kill_after(doomed[1], cluster.proc("doomed1"))) as front, \
                running_app(Router(RouterSettings(prefill_instances=(front, cluster.url("prefill")),
                                                  decode_instances=(d,), request_timeout=60)).app) as router:
            assert _text(client, router, "/v1/completions", COMPLETION, False) == \
                _text(client, cluster.url("mix"), "/v1/completions", COMPLETION, False)
        assert cluster.proc("doomed1").poll() is not None  # the flow went through it first
    wait_for(lambda: free_blocks(d) == start, 10, "the decode instance kept blocks of failed pulls", step=0.2)


def _stop_hard(proc: subprocess.Popen) -> None:
    """SIGKILL the instance and its engine core at once (a core whose API server is gone would serve
    pulls until it notices, up to half a second later)."""
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True,
                              text=True).stdout.split()
    for pid in children:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.kill()
    proc.wait(30)


@pytest.mark.slow
def test_push_from_tp1_into_tp2_and_a_decode_instance_killed_after_its_reservation(tiny_llama, tmp_path):
    """PUSH (both instances' default mode) as real `heterollm serve` processes behind the router: a
    TP 1 PREFILL instance writes into a TP 2 DECODE instance's reservations, and the routed answers
    are a single instance's; a DECODE instance that dies after reserving makes the push fail with a
    clear 502 (no hang, no block kept on P), and through the router the flow runs again on the other
    DECODE instance."""
    def reserving(body: dict) -> bool:  # a DECODE instance dies right after its reservation
        return bool((body.get("kv_transfer_params") or {}).get("reserve"))

    c = Cluster(tiny_llama, tmp_path)
    pd = lambda role: [f"--instance_role={role}", f"--transfer_listen_port={free_port()}"]  # noqa: E731
    try:
        p = c.serve("prefill", *pd("PREFILL"))
        d = c.serve("decode", *pd("DECODE"), "--tp_size=2")
        doomed = [c.serve(f"doomed{i}", *pd("DECODE")) for i in range(2)]
        mix = c.serve("mix")
        c.wait()
        start = {p: free_blocks(p), d: free_blocks(d)}
        with httpx.Client(timeout=120) as client:
            with running_app(Router(RouterSettings(prefill_instances=(p,), decode_instances=(d,),
                                                   request_timeout=60)).app) as router:
                assert _answers(client, router) == _answers(client, mix)
            assert _metric(p, "heterollm_kv_push_blocks") > 0 and _metric(d, "heterollm_kv_pull_blocks") == 0
            # by hand: D reserves and dies; P's push fails with a clear error, and P keeps nothing
            reserve = {**COMPLETION, "kv_transfer_params": {"do_remote_prefill": True, "reserve": True}}
            res = client.post(doomed[0] + "/v1/completions", json=reserve).json()["kv_transfer_params"]
            assert res["kv_cache_transfer_mode"] == "PUSH" and res["reservation_id"].startswith("kvres-")
            _stop_hard(c.proc("doomed0"))
            began = time.monotonic()
            r = client.post(p + "/v1/completions", json={**COMPLETION, "max_tokens": 1, "kv_transfer_params": res})
            assert r.status_code == 502 and r.json()["error"]["type"] == "kv_transfer_failed", r.text
            assert "pushing the prompt's KV failed" in r.json()["error"]["message"]
            assert time.monotonic() - began < 30
            # through the router: the first D dies after reserving, the flow runs again on the live one
            with running_app(_kill_after(doomed[1], c.proc("doomed1"), reserving)) as front, \
                    running_app(Router(RouterSettings(prefill_instances=(p,), decode_instances=(front, d),
                                                      request_timeout=60)).app) as router:
                assert _text(client, router, "/v1/completions", COMPLETION, False) == \
                    _text(client, mix, "/v1/completions", COMPLETION, False)
            assert c.proc("doomed1").poll() is not None  # the flow went through it first
        for url, blocks in start.items():
            wait_for(lambda: free_blocks(url) == blocks, 10, f"{url} did not free its blocks ({start})", step=0.2)
    finally:
        c.stop()
