"""The engine core in its own process (`heterollm serve`, ARCHITECTURE.md "Data flow"): the same
answers as the in-process engine, refusals that cross the process boundary with their field, admin
calls, a core killed mid-stream (every request fails, /health 503, serve exits 1), a core that
stops when the API server is gone, --rpc_channel_timeout_ms and --engine_worker_queue_port."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import httpx
import msgspec
import pytest
import torch

from conftest import MODEL, free_port, make_engine, serving, serving_cores, spawned_children
from helpers import free_port_block
from test_openai_api import metric
from heterollm.config import ConfigError, load_config
from heterollm.engine import core_ipc as ipc
from heterollm.engine.core_client import EngineCoreClient, start_engine_cores
from heterollm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from heterollm.interfaces import TokenLogprobs
from heterollm.pooling import PoolingParams
from heterollm.pooling.params import PoolingType
from heterollm.sampling import SamplingParams
from heterollm.scheduler.request import RequestRejected

FLAGS = {"dtype": "float32", "block_size": 8, "num_gpu_blocks_override": 512, "max_model_len": 256}


def core_config(folder, **flags):
    return load_config([], overrides={"model": str(folder), **FLAGS, **flags}).config


@pytest.fixture(scope="module")
def core(tiny_llama, tmp_path_factory):
    # the traces go to a folder of the test's own, not the working directory (a failing test would
    # leave them there)
    config = core_config(tiny_llama, guided_decoding_backend="xgrammar", enable_online_profile=True,
                         profile_dir=str(tmp_path_factory.mktemp("traces")), dynamic_load_weight=1)
    with serving_cores(config) as running:
        yield running


@pytest.fixture(scope="module")
def local(tiny_llama):
    engine = make_engine(tiny_llama, guided_decoding_backend="xgrammar")
    with serving(engine) as running:
        yield running


def _post(url: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(url + path, json={"model": MODEL, **body}, timeout=120)


BODIES = [
    {"prompt": "the engine core", "max_tokens": 12, "temperature": 0, "logprobs": 3, "echo": True,
     "prompt_logprobs": 2},
    {"prompt": [5, 6, 7, 8, 9], "max_tokens": 10, "temperature": 0.8, "seed": 7, "n": 3},
    {"prompt": "stop early", "max_tokens": 30, "temperature": 0, "stop": [" the", "e"], "ignore_eos": True},
    {"prompt": "json please", "max_tokens": 24, "temperature": 0, "structured_outputs": {"choice": ["yes", "no"]}},
    # beam search runs in the API server over the core's one-token rounds, and stops beams at the EOS
    # the server side knows
    {"prompt": "beams", "max_tokens": 8, "temperature": 0, "use_beam_search": True, "n": 3},
]


@pytest.mark.parametrize("body", BODIES, ids=["logprobs", "seeded-n3", "stop-strings", "grammar", "beams"])
def test_the_core_process_answers_as_the_in_process_engine(core, local, body):
    def strip(answer):
        answer.pop("id"), answer.pop("created")
        return answer

    remote, here = _post(core.url, body), _post(local.url, body)
    assert remote.status_code == here.status_code == 200, remote.text
    assert strip(remote.json()) == strip(here.json())


def test_streaming_from_the_core_process(core, local):
    body = {"prompt": "stream it", "max_tokens": 9, "temperature": 0, "stream": True, "logprobs": 2,
            "stream_options": {"include_usage": True}}

    def chunks(url):
        with httpx.stream("POST", url + "/v1/completions", json={"model": MODEL, **body}, timeout=60) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return [(c["choices"][0]["text"], c["choices"][0]["logprobs"]) if c["choices"] else c["usage"]
                for c in map(json.loads, events[:-1])]

    assert chunks(core.url) == chunks(local.url)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": 4, "priority": 3}, "priority"),
    ({"prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"prompt": "x", "max_tokens": 4, "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "a", "schema": {"type": "nope"}}}},
     "response_format"),
])
def test_a_refusal_in_the_core_names_its_field_and_the_core_serves_on(core, local, body, param):
    r = _post(core.url, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    # the whole error, message included, as the in-process engine words it (a grammar's compile
    # error comes back from the core's compile pool, not from the admission call)
    assert r.json() == _post(local.url, body).json()
    ok = _post(core.url, {"prompt": "still here", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_admin_calls_reach_the_core(core, tmp_path):
    first = httpx.post(core.url + "/start_profile", timeout=60)
    assert first.status_code == 200
    again = httpx.post(core.url + "/start_profile", timeout=60)  # the core's RequestRejected, field and all
    assert again.status_code == 400 and again.json()["error"]["param"] == "profile"
    assert _post(core.url, {"prompt": "profiled", "max_tokens": 2}).status_code == 200
    stopped = httpx.post(core.url + "/stop_profile", timeout=120)
    assert stopped.status_code == 200
    traces = stopped.json()["traces"]
    assert traces and all(os.path.exists(t) for t in traces)


def test_an_admin_call_carries_its_arguments_to_the_core(core, tiny_llama):
    """/update_weights hands the core a WeightUpdate (as a dict): the same checkpoint reloads, and a
    path the core cannot read comes back as the core's refusal naming the field."""
    r = httpx.post(core.url + "/update_weights", json={"path": str(tiny_llama)}, timeout=120)
    assert r.status_code == 200 and r.json()["tensors"] > 0 and r.json()["replicas"] == 1, r.text
    r = httpx.post(core.url + "/update_weights", json={"path": "/no/such/checkpoint"}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "path", r.text
    assert "/no/such/checkpoint" in r.json()["error"]["message"]
    assert core.server.replicas[0]._calls == {}  # each call's slot is gone once answered


def test_metrics_come_from_the_core(core):
    _post(core.url, {"prompt": "count me", "max_tokens": 4})
    deadline = time.monotonic() + 10
    while True:  # the gauges at rest arrive once the core is idle
        text = httpx.get(core.url + "/metrics").text
        line = next(x for x in text.splitlines() if x.startswith("heterollm_kv_cache_total_blocks{"))
        running = next(x for x in text.splitlines() if x.startswith("heterollm_num_requests_running{"))
        if running.endswith(" 0.0") or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert line.endswith(" 512.0") and running.endswith(" 0.0")
    queries = next(x for x in text.splitlines() if x.startswith("heterollm_prefix_cache_queries_total{"))
    assert float(queries.split()[-1]) > 0


def test_a_client_gone_mid_stream_aborts_its_request_in_the_core(core):
    """The API server's abort crosses to the core, which aborts that request (its blocks free, the
    abort counted) while the core serves on."""
    text = httpx.get(core.url + "/metrics").text
    before, generated, cached = (metric(text, name) for name in (
        "heterollm_request_aborts_total", "heterollm_generation_tokens_total", "heterollm_prefix_cache_blocks"))
    body = {"model": MODEL, "prompt": "an abort through the core", "max_tokens": 240, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", core.url + "/v1/completions", json=body) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data:"))
        for _ in range(3):
            next(lines)
    deadline = time.monotonic() + 20
    while True:
        text = httpx.get(core.url + "/metrics").text
        if metric(text, "heterollm_num_requests_running") == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert metric(text, "heterollm_num_requests_running") == 0
    assert metric(text, "heterollm_request_aborts_total") == before + 1
    assert metric(text, "heterollm_generation_tokens_total") == generated  # it never ran to its end
    assert metric(text, "heterollm_kv_cache_usage_perc") == 0
    # the core stopped it: run to its 240 tokens it would have left ~30 full blocks of 8 in the prefix
    # cache; aborted a few tokens in, a handful (the bound leaves room for a slow machine)
    assert metric(text, "heterollm_prefix_cache_blocks") - cached < 20
    assert _post(core.url, {"prompt": "still here", "max_tokens": 3}).json()["usage"]["completion_tokens"] == 3


def test_outputs_cross_the_wire_intact():
    lp = TokenLogprobs(5, -0.25, 1, [(5, -0.25), (9, -1.5)])
    out = RequestOutput("r", None, [1, 2], [CompletionOutput(0, "ab", [5], [lp], "stop", "\n", -0.25, "b", [5])],
                        True, RequestMetrics(1.0, 2.0, 3.0, 2, 1, 0, 1, True, 4, 2), [None, lp],
                        torch.tensor([0.5, -1.0]))
    data = ipc.encoder().encode(ipc.Outputs([ipc.output_to_wire(out)]))
    back = ipc.output_from_wire(ipc.from_core_decoder().decode(data).outputs[0])
    assert torch.equal(back.pooled, out.pooled)
    back.pooled = out.pooled = None
    assert back == out
    params = SamplingParams(n=2, stop=["x"], logit_bias={7: -1.0}, structured_outputs={"json": {"type": "object"}},
                            seed=3, max_tokens=9)
    assert ipc.params_from_wire(ipc.to_core_decoder().decode(ipc.encoder().encode(
        ipc.Add("r", "p", None, ipc.params_to_wire(params)))).params) == params
    for pooling in (PoolingParams(task="embed", pooling_type=PoolingType.MEAN, normalize=False, dimensions=16),
                    PoolingParams(task="score", score_token_ids=(3, 7))):
        add = ipc.Add("r", "p", None, ipc.params_to_wire(SamplingParams(max_tokens=1)), pooling=msgspec.to_builtins(pooling))
        assert ipc.pooling_from_wire(ipc.to_core_decoder().decode(ipc.encoder().encode(add)).pooling) == pooling
    assert ipc.pooling_from_wire(None) is None


def test_a_refusal_crosses_as_its_field_message_and_status_and_a_failure_as_an_engine_error():
    assert ipc.Rejection.of(RequestRejected("max_tokens", "max_tokens must be >= 1")) == \
        ipc.Rejection("max_tokens", "max_tokens must be >= 1", 400, engine_error=False)
    assert ipc.Rejection.of(RequestRejected("kv_transfer_params", "no room now", status=503)) == \
        ipc.Rejection("kv_transfer_params", "no room now", 503, engine_error=False)
    assert ipc.Rejection.of(RuntimeError("the step raised")) == \
        ipc.Rejection(None, "the step raised", 500, engine_error=True)


def test_an_object_the_wire_cannot_carry_is_refused_naming_its_type():
    class Handle:
        pass

    with pytest.raises(NotImplementedError, match="cannot send Handle to or from the engine core"):
        ipc.encoder().encode(ipc.Outputs([{"pooled": Handle()}]))


def test_running_outputs_carry_only_their_new_logprobs():
    """A stream with logprobs: each running output sends the positions added since the last one and
    the prompt logprobs once; the API server's side rebuilds every output whole; a finished output
    is whole on the wire too. An output of a request forgotten (aborted) meanwhile is not rebuilt."""
    sender, receiver = ipc.OutputSender(), ipc.OutputReceiver()
    enc, dec = ipc.encoder(), ipc.from_core_decoder()
    prompt_lps = [None, TokenLogprobs(3, -1.0, 2, [(4, -0.5), (3, -1.0)])]
    lps = [TokenLogprobs(10 + i, -0.1 * i, 1, [(10 + i, -0.1 * i), (99, -5.0)]) for i in range(6)]

    def output(n: int, finished: bool = False) -> RequestOutput:
        return RequestOutput("r", "p", [1, 3], [CompletionOutput(0, "t" * n, [10 + i for i in range(n)], lps[:n],
                                                                 "length" if finished else None)],
                             finished, RequestMetrics(1.0), prompt_lps)

    sizes = []
    for n, finished in ((1, False), (3, False), (4, False), (6, True)):
        data = enc.encode(ipc.Outputs([sender.encode(output(n, finished))]))
        sizes.append(len(data))
        wire = dec.decode(data).outputs[0]
        if not finished:
            assert wire["outputs"][0]["logprobs_start"] == {1: 0, 3: 1, 4: 3}[n]
            assert len(wire["outputs"][0]["logprobs"]) == {1: 1, 3: 2, 4: 1}[n]
            assert (wire["prompt_logprobs"] is None) == (n != 1)
        assert receiver.decode(wire) == output(n, finished)
    assert sizes[2] < sizes[1] and sizes[3] > sizes[1]  # one new position vs two; the finished one whole
    assert not sender._sent and not receiver._logprobs and not receiver._prompt_logprobs
    sender.encode(output(2))
    late = dec.decode(enc.encode(ipc.Outputs([sender.encode(output(3))]))).outputs[0]
    receiver.forget("r")
    assert receiver.decode(late).outputs[0].logprobs == lps[2:3] and not receiver._logprobs
    sender.forget("r")  # the core's side of an abort: nothing kept for the request
    assert not sender._sent


def test_a_killed_core_fails_every_request_and_health_turns_503(tiny_llama):
    client = EngineCoreClient(core_config(tiny_llama, max_model_len=256), 0)
    client.wait_ready()
    try:
        with serving([client]) as running:
            body = {"model": MODEL, "prompt": "go on", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            with httpx.Client(timeout=60) as http, http.stream("POST", running.url + "/v1/completions",
                                                               json=body) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))
                os.kill(client.process.pid, signal.SIGKILL)
                rest = [line[6:] for line in lines if line.startswith("data: ")]
            error = json.loads(rest[-2])["error"]
            assert rest[-1] == "[DONE]" and error["code"] == 500 and "exited" in error["message"]
            health = httpx.get(running.url + "/health")
            # one replica: no dp rank named; then why it stopped
            assert health.status_code == 503 and health.json()["error"]["message"].startswith(
                "the engine is not running: "), health.text
            late = _post(running.url, {"prompt": "anyone?", "max_tokens": 2})
            assert late.status_code == 500 and "not running" in late.json()["error"]["message"]
    finally:
        client.shutdown()


def test_an_unanswering_core_times_out_with_rpc_channel_timeout_ms(tiny_llama):
    client = EngineCoreClient(core_config(tiny_llama, rpc_channel_timeout_ms=300, dynamic_load_weight=1), 0)
    client.wait_ready()
    try:
        # before any request, the idle core has sent its gauges once
        deadline = time.monotonic() + 10
        while client.stats().get("kv_total_blocks") != 512 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.stats()["kv_total_blocks"] == 512 and client.stats()["running"] == 0
        with serving([client]) as running:
            os.kill(client.process.pid, signal.SIGSTOP)
            try:
                r = _post(running.url, {"prompt": "hello?", "max_tokens": 2})
                start = time.monotonic()
                admin = httpx.post(running.url + "/update_weights", json={"path": str(tiny_llama)}, timeout=60)
                waited = time.monotonic() - start
            finally:
                os.kill(client.process.pid, signal.SIGCONT)
            assert r.status_code == 500 and "--rpc_channel_timeout_ms=300" in r.json()["error"]["message"]
            # an admin call waits as long (0.3 s; 5 s would mean another limit), then is a 503 naming
            # the call and the flag, and its slot is gone
            assert waited < 4 and client._calls == {}
            assert admin.status_code == 503 and admin.json()["error"]["message"] == \
                "the engine core did not answer update_weights within --rpc_channel_timeout_ms=300"
            assert _post(running.url, {"prompt": "hello again", "max_tokens": 2}).status_code == 200
    finally:
        client.shutdown()


def test_engine_worker_queue_port_puts_the_core_on_tcp(tiny_llama):
    port = free_port_block(2)  # the core takes P and P + 1
    cfg = core_config(tiny_llama, engine_worker_queue_port=port)
    client = EngineCoreClient(cfg, 0)
    try:
        assert client.addresses.to_core == f"tcp://127.0.0.1:{port}"
        with pytest.raises(ConfigError, match="--engine_worker_queue_port"):
            EngineCoreClient(cfg, 0)  # the same ports again: taken
        client.wait_ready()
        with serving([client]) as running:
            assert _post(running.url, {"prompt": "over tcp", "max_tokens": 3}).status_code == 200
    finally:
        client.shutdown()


def test_a_launch_error_in_the_core_is_a_config_error(tmp_path):
    cfg = core_config(tmp_path / "missing")
    with pytest.raises((ConfigError, RuntimeError)) as info:
        start_engine_cores(cfg)
    assert "missing" in str(info.value)


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    from helpers import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("core-long-llama"), "llama", max_position_embeddings=8192)


@pytest.mark.slow  # a serve process killed mid-stream (13 s)
def test_the_core_exits_when_serve_is_killed_mid_stream(long_llama):
    """kill -9 of `serve` while the core is busy with a long stream: the core does not run it to the end
    (its outputs would fill a socket nobody reads) but exits at its next step."""
    import threading

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "heterollm.entrypoints.cli", "serve", "--model", str(long_llama),
                             "--host=127.0.0.1", f"--port={port}", "--dtype=float32", "--max_model_len=8192"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        cores = spawned_children(proc.pid)
        assert len(cores) == 1
        started = threading.Event()

        def stream() -> None:
            body = {"prompt": "go", "max_tokens": 8000, "ignore_eos": True, "stream": True}
            try:
                with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
                    for _ in r.iter_lines():
                        started.set()
            except httpx.HTTPError:
                pass

        threading.Thread(target=stream, daemon=True).start()
        assert started.wait(60)
        proc.kill()
        proc.wait(30)
        deadline = time.monotonic() + 15
        while os.path.exists(f"/proc/{cores[0]}") and _state(cores[0]) != "Z" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{cores[0]}") or _state(cores[0]) == "Z"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.parametrize("flag", ["--engine_worker_queue_port=9100", "--rpc_channel_timeout_ms=50"])
def test_the_link_flags_are_refused_where_no_core_process_runs(cli, tiny_llama, flag):
    r = cli("generate", "--model", str(tiny_llama), flag, "--prompt", "x")
    assert r.rc == 2 and flag in r.err and "engine-core process" in r.err and "Traceback" not in r.err


def test_embeddings_through_the_core_process(tiny_llama):
    """A pooling launch: the pooled vectors cross the process boundary (as lists, rebuilt as fp32
    tensors) and equal the in-process engine's."""
    body = {"model": MODEL, "input": ["hello world", "a second, longer input"], "dimensions": 8}
    clients = start_engine_cores(core_config(tiny_llama, task="embed"))
    try:
        with serving(clients) as running:
            remote = httpx.post(running.url + "/v1/embeddings", json=body, timeout=60)
            refused = _post(running.url, {"prompt": "x", "max_tokens": 2})
    finally:
        for c in clients:
            c.shutdown()
    with serving(make_engine(tiny_llama, task="embed")) as running:
        here = httpx.post(running.url + "/v1/embeddings", json=body, timeout=60)
    assert remote.status_code == here.status_code == 200, remote.text
    assert [d["embedding"] for d in remote.json()["data"]] == [d["embedding"] for d in here.json()["data"]]
    assert len(remote.json()["data"][0]["embedding"]) == 8
    assert refused.status_code == 400 and "--task" in refused.json()["error"]["message"]


def test_a_failed_step_fails_its_requests_and_the_core_goes_on(tiny_llama, caplog):
    """The core's loop in this process over inproc sockets: a step that raises fails the requests the
    engine holds (StepFailed naming each), and the next request is served."""
    import threading

    import zmq

    from heterollm.engine.core_process import EngineCore

    caplog.set_level(logging.ERROR, logger="heterollm.engine")
    engine = make_engine(tiny_llama)
    ctx = zmq.Context()
    to_core, inbox, from_core, outbox = (ctx.socket(k) for k in (zmq.PUSH, zmq.PULL, zmq.PULL, zmq.PUSH))
    to_core.bind("inproc://core-in"), inbox.connect("inproc://core-in")
    from_core.bind("inproc://core-out"), outbox.connect("inproc://core-out")
    real, failed_once = engine.executor.execute, []

    def execute(so):
        if not failed_once:
            failed_once.append(True)
            raise RuntimeError("planted failure")
        return real(so)

    engine.executor.execute = execute
    core = EngineCore(engine, inbox, outbox, os.getppid())
    status = []
    thread = threading.Thread(target=lambda: status.append(core.run()))
    enc, dec = ipc.encoder(), ipc.from_core_decoder()
    params = ipc.params_to_wire(SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))

    def until(kind):
        while True:
            assert from_core.poll(30_000), f"no {kind.__name__} from the core"
            msg = dec.decode(from_core.recv())
            if isinstance(msg, kind):
                return msg

    try:
        for rid in ("a", "b"):
            to_core.send(enc.encode(ipc.Add(rid, [5, 6, 7], None, params)))
        thread.start()  # both are queued before the loop runs: the failing first step holds both
        failed = until(ipc.StepFailed)
        assert sorted(failed.request_ids) == ["a", "b"] and "planted failure" in failed.message
        assert "engine step failed; failing the requests in flight" in caplog.messages
        assert engine.unfinished_ids() == []
        to_core.send(enc.encode(ipc.Add("c", [5, 6, 7], None, params)))
        seen = []
        while True:
            seen.append(until(ipc.Outputs))
            done = [o for o in seen[-1].outputs if o["finished"]]
            if done:
                break
        first = next(m for m in seen if m.outputs)  # the gauges ride with a busy core's outputs too
        assert first.stats is not None and first.stats["running"] == 1
        assert done[0]["request_id"] == "c" and len(done[0]["outputs"][0]["token_ids"]) == 3
        rest = until(ipc.Outputs)  # at rest: the gauges once more, nothing running, every block back
        assert rest.outputs == [] and rest.stats["running"] == rest.stats["waiting"] == 0
        assert rest.stats["kv_free_blocks"] == rest.stats["kv_total_blocks"]
        to_core.send(enc.encode(ipc.Shutdown()))
        thread.join(30)
        assert status == [0]  # Shutdown: a clean exit
        # a core whose API server is gone (its parent is not this process's parent) exits with 1, saying so
        assert EngineCore(engine, inbox, outbox, parent_pid=-1).run() == 1
        assert "the API server process is gone; the engine core exits" in caplog.messages
        # workers gone: the core says why (Dead) and exits with 1
        from heterollm.interfaces import ExecutorDead

        def dead(so):
            raise ExecutorDead("rank 1 exited with -9")

        engine.executor.execute = dead
        to_core.send(enc.encode(ipc.Add("d", [5, 6, 7], None, params)))
        assert EngineCore(engine, inbox, outbox, os.getppid()).run() == 1
        assert until(ipc.Dead).why == "rank 1 exited with -9"
        assert "the engine cannot go on (rank 1 exited with -9)" in caplog.messages
    finally:
        if thread.is_alive():
            to_core.send(enc.encode(ipc.Shutdown()))
            thread.join(30)
        for sock in (to_core, inbox, from_core, outbox):
            sock.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("dp_size, graph", [(1, False), (2, False), (1, True), (2, True)])
def test_a_core_sizes_its_threads_for_the_replicas_alone(tiny_llama, monkeypatch, dp_size, graph):
    """The API server is a process of its own, so a core keeps no core for it: its torch pool is the
    host's cores over --dp_size (measured on 2 cores at C=16: 2 threads serve 1.55x the output tok/s
    of 1). With --enable_graph the pool is sized before the compile, which specializes on it."""
    from heterollm.engine import core_process
    from heterollm.engine.llm_engine import LLMEngine
    from heterollm_cpu.platform import CpuPlatform

    events = []
    monkeypatch.setattr(CpuPlatform, "configure_threads",
                        lambda self, workers, keep_for_server=0: events.append(("threads", workers, keep_for_server)))
    monkeypatch.setattr(LLMEngine, "__init__", lambda self, config, dp_rank=0: events.append(("load", config, dp_rank)))
    config = core_config(tiny_llama, dp_size=dp_size, enable_graph=graph)
    core_process.build_engine(config, dp_size - 1)  # the last replica: its rank reaches the engine
    sized, loaded = ("threads", dp_size, 0), ("load", config, dp_size - 1)
    assert events == ([sized, loaded] if graph else [loaded, sized])
