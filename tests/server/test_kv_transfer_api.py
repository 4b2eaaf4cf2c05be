"""The API server's side of prefill/decode disaggregation (entrypoints/openai/disagg.py) on real
engines in this process (a PREFILL, a DECODE and a DEFAULT one on the same tiny llama; the KV moves
over Mooncake's transfer engine): kv_transfer_params reaches the engine, P's answer carries the
params for D, D's answer is the DEFAULT instance's (streamed or not), POST /v1/kv_transfer/release,
a failed pull is a 502 kv_transfer_failed or a stream's first event, refusals name the field; and
the engine-core messages carry the params and the outputs' kv_transfer_params and error."""
from __future__ import annotations

import json
import zlib
from collections.abc import Iterator

import httpx
import pytest

from conftest import MODEL, free_port, make_engine, serving
from heterollm.engine import core_ipc as ipc
from heterollm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

PD = {"kv_cache_transfer_mode": "PULL", "num_gpu_blocks_override": 64}
COMPLETION = {"model": MODEL, "prompt": "The quick brown fox jumps over", "max_tokens": 6, "temperature": 0,
              "ignore_eos": True}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 6, "temperature": 0,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def servers(tiny_llama) -> Iterator[dict[str, str]]:
    with serving(make_engine(tiny_llama, instance_role="PREFILL", transfer_listen_port=free_port(), **PD)) as p, \
            serving(make_engine(tiny_llama, instance_role="DECODE", transfer_listen_port=free_port(), **PD)) as d, \
            serving(make_engine(tiny_llama, num_gpu_blocks_override=64)) as plain:
        yield {"p": p.url, "d": d.url, "plain": plain.url, "p_engine": p.engine, "d_engine": d.engine}


def _prefill(client: httpx.Client, url: str, path: str, body: dict) -> dict:
    one = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    r = client.post(url + path, json=one)
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def _events(client: httpx.Client, url: str, path: str, body: dict) -> list:
    with client.stream("POST", url + path, json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def _text(events: list, chat: bool) -> str:
    pick = (lambda c: c["delta"].get("content") or "") if chat else (lambda c: c["text"])
    return "".join(pick(c) for e in events for c in e["choices"])


def test_kv_transfer_params_prefill_then_decode_streamed_or_not(servers):
    with httpx.Client(timeout=60) as client:
        for path, body, chat in (("/v1/completions", COMPLETION, False), ("/v1/chat/completions", CHAT, True)):
            want = client.post(servers["plain"] + path, json=body).json()
            want_text = want["choices"][0]["message"]["content"] if chat else want["choices"][0]["text"]
            params = _prefill(client, servers["p"], path, body)
            assert params["do_remote_prefill"] is True and isinstance(params["remote_request_id"], str)
            got = client.post(servers["d"] + path, json={**body, "kv_transfer_params": params})
            assert got.status_code == 200, got.text
            choice = got.json()["choices"][0]
            assert (choice["message"]["content"] if chat else choice["text"]) == want_text
            assert got.json()["usage"] == want["usage"] and "kv_transfer_params" not in got.json()
            assert client.post(servers["p"] + "/v1/kv_transfer/release",
                               json={"remote_request_id": params["remote_request_id"]}).json() == {"released": True}
            params = _prefill(client, servers["p"], path, body)
            events = _events(client, servers["d"], path, {**body, "kv_transfer_params": params})
            assert _text(events, chat) == want_text
            release = {"remote_request_id": params["remote_request_id"]}
            assert client.post(servers["p"] + "/v1/kv_transfer/release", json=release).json() == {"released": True}
            assert client.post(servers["p"] + "/v1/kv_transfer/release", json=release).json() == {"released": False}


def test_a_failed_pull_is_a_502_or_the_first_event(servers):
    failed = {"type": "kv_transfer_failed", "param": "kv_transfer_params", "code": 502}
    with httpx.Client(timeout=60) as client:
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            params = _prefill(client, servers["p"], path, body)
            dead = {**params, "remote_ranks": [{**params["remote_ranks"][0], "addr": f"127.0.0.1:{free_port()}"}]}
            r = client.post(servers["d"] + path, json={**body, "kv_transfer_params": dead})
            assert r.status_code == 502, r.text
            error = r.json()["error"]
            assert {k: error[k] for k in failed} == failed and "pulling the prompt's KV failed" in error["message"]
            events = _events(client, servers["d"], path, {**body, "kv_transfer_params": dead})
            assert len(events) == 1 and {k: events[0]["error"][k] for k in failed} == failed
            release = {"remote_request_id": params["remote_request_id"]}
            client.post(servers["p"] + "/v1/kv_transfer/release", json=release)


def test_refusals_name_the_field(servers):
    with httpx.Client(timeout=60) as client:
        cases = [
            (servers["plain"], {**COMPLETION, "kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
            (servers["p"], {**COMPLETION, "prompt": ["a", "b"], "kv_transfer_params": {"do_remote_decode": True}},
             "kv_transfer_params"),
            (servers["p"], {**COMPLETION, "use_beam_search": True, "n": 2,
                            "kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
            (servers["p"], {**COMPLETION, "kv_transfer_params": "yes"}, "kv_transfer_params"),
            (servers["d"], {**COMPLETION, "kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
        ]
        for url, body, param in cases:
            r = client.post(url + "/v1/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert client.post(servers["plain"] + "/v1/completions", json={**COMPLETION, "kv_transfer_params": {}}
                           ).status_code == 200  # asks for nothing
        r = client.post(servers["p"] + "/v1/kv_transfer/release", json={"remote_request_id": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "remote_request_id"
        assert r.json()["error"]["message"] == ("remote_request_id must be a non-empty string (kv_transfer_params."
                                                "remote_request_id of the prefill answer)")
        r = client.post(servers["p"] + "/v1/kv_transfer/release", content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("the request body is not JSON: ")
        r = client.post(servers["plain"] + "/v1/kv_transfer/release", json={"remote_request_id": "nobody"})
        assert r.json() == {"released": False}


def test_core_messages_carry_the_params_and_the_outcome():
    params = {"do_remote_prefill": True, "remote_request_id": "r", "remote_block_ids": [[1, 2]]}
    add = ipc.Add("r", [1, 2], [1, 2], {}, kv_transfer_params=params)
    assert ipc.to_core_decoder().decode(ipc.encoder().encode(add)).kv_transfer_params == params
    out = RequestOutput("r", None, [1, 2], [CompletionOutput(0, "", [], finish_reason="error")], True,
                        RequestMetrics(0.0), kv_transfer_params=params, error="pulling the prompt's KV failed: x")
    wire = ipc.encoder().encode(ipc.Outputs([ipc.OutputSender().encode(out)]))
    back = ipc.output_from_wire(ipc.from_core_decoder().decode(wire).outputs[0])
    assert back.kv_transfer_params == params and back.error == out.error
    assert back.outputs[0].finish_reason == "error"


def test_release_asks_every_replica(tiny_llama):
    engines = [make_engine(tiny_llama, instance_role="PREFILL", transfer_listen_port=free_port(), **PD)
               for _ in range(2)]
    with serving(engines) as p, httpx.Client(timeout=60) as client:
        keys = ["a", "b", "c", "d"]  # prompt_cache_key pins a replica: these reach both
        assert {zlib.crc32(k.encode()) % 2 for k in keys} == {0, 1}
        held = [_prefill(client, p.url, "/v1/chat/completions", {**CHAT, "prompt_cache_key": k}) for k in keys]
        assert all(e.kv.num_free_blocks < PD["num_gpu_blocks_override"] for e in engines)
        for params in held:
            release = {"remote_request_id": params["remote_request_id"]}
            assert client.post(p.url + "/v1/kv_transfer/release", json=release).json() == {"released": True}
            assert client.post(p.url + "/v1/kv_transfer/release", json=release).json() == {"released": False}
        assert sum(e.kv.num_free_blocks for e in engines) == 2 * PD["num_gpu_blocks_override"]


def test_a_reserve_request_is_answered_at_once_or_refused_naming_the_field(servers):
    """PD PUSH's first call ("reserve": true on a DECODE instance) answers with the reservation; under
    PULL with only the mode. What D would refuse later is refused now: n or best_of above 1, logprobs
    (the first token comes from P, which sends none). A DEFAULT instance reserves nothing."""
    reserve = {"kv_transfer_params": {"reserve": True}}
    with httpx.Client(timeout=60) as client:
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            r = client.post(servers["d"] + path, json={**body, **reserve})
            assert r.status_code == 200 and r.json() == {"kv_transfer_params": {"kv_cache_transfer_mode": "PULL"}}, r.text
        one = "a disaggregated request generates one sequence (n = 1, best_of = 1)"
        no_lp = ("a disaggregated request's first token is sampled by the prefill instance, which sends no "
                 "logprobs: logprobs are not served with kv_transfer_params")
        cases = [
            ("/v1/completions", {**COMPLETION, "n": 2}, "n", one),
            ("/v1/completions", {**COMPLETION, "best_of": 2}, "n", one),
            # D refuses n = 0 too (n must be between 1 and 128): no reservation for it
            ("/v1/completions", {**COMPLETION, "n": 0}, "n", one),
            ("/v1/completions", {**COMPLETION, "logprobs": 0}, "logprobs", no_lp),
            ("/v1/completions", {**COMPLETION, "prompt_logprobs": 1}, "logprobs", no_lp),
            ("/v1/chat/completions", {**CHAT, "logprobs": True}, "logprobs", no_lp),
            ("/v1/chat/completions", {**CHAT, "n": 2}, "n", one),
        ]
        for path, body, param, message in cases:
            r = client.post(servers["d"] + path, json={**body, **reserve})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
            assert r.json()["error"]["message"] == message
        # chat's logprobs=false with top_logprobs unset is no logprobs at all
        r = client.post(servers["d"] + "/v1/chat/completions", json={**CHAT, "logprobs": False, **reserve})
        assert r.status_code == 200, r.text
        r = client.post(servers["plain"] + "/v1/completions", json={**COMPLETION, **reserve})
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
        assert "a DECODE instance (--instance_role DECODE) reserves blocks" in r.json()["error"]["message"]
