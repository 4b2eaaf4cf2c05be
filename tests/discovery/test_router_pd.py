"""`heterollm route`'s prefill/decode flow (service/disagg.py) against fake PREFILL and DECODE apps
that record what they are sent: the two requests' bodies, the stream passed through, the release on
P, another P or D when one cannot be reached, a failed KV pull retried once on another P then passed
on, 503 at once without a P or a D, and whole requests still served by MIX instances."""
from __future__ import annotations

import pytest

import json
import time
from contextlib import ExitStack

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from heterollm.service.instance import InstanceInfo
from heterollm.service.pool import InstancePool, RoutingPolicy
from heterollm.service.router import Router, RouterSettings

from .conftest import free_port, running_app, wait_for

COMPLETION = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}}
FAILED = {"error": {"message": "pulling the prompt's KV failed: P is gone", "type": "kv_transfer_failed",
                    "param": "kv_transfer_params", "code": 502}}
PUSH_FAILED = {"error": {"message": "pushing the prompt's KV failed: D is gone", "type": "kv_transfer_failed",
                         "param": "kv_transfer_params", "code": 502}}


class FakePrefill:
    """Answers one token and the kv_transfer_params of the protocol; records bodies and releases."""

    def __init__(self, name: str, push_failures: int = 0, answer: tuple[int, dict] | None = None) -> None:
        self.name, self.bodies, self.released, self.auth = name, [], [], []
        self.push_failures = push_failures
        self.answer = answer
        """(status, body) every prefill gets instead (an error of P's own)."""
        self.app = FastAPI()
        for path in ("/v1/completions", "/v1/chat/completions"):
            self.app.add_api_route(path, self.prefill, methods=["POST"])
        self.app.add_api_route("/v1/kv_transfer/release", self.release, methods=["POST"])
        self.app.add_api_route("/v1/models", lambda: {"object": "list", "data": [{"id": "tiny"}]}, methods=["GET"])

    async def prefill(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.answer is not None:
            return JSONResponse(self.answer[1], status_code=self.answer[0])
        reservation = body["kv_transfer_params"].get("reservation_id")
        if reservation is not None:  # PUSH: "writes" into D's reservation
            if len(self.bodies) <= self.push_failures:
                return JSONResponse(PUSH_FAILED, status_code=502)
            return JSONResponse({"choices": [{"index": 0, "text": "x"}], "kv_transfer_params": {
                "do_remote_prefill": True, "kv_cache_transfer_mode": "PUSH", "reservation_id": reservation,
                "remote_engine_id": self.name, "prompt_token_ids": [1, 2, 3], "first_token_id": 7, "block_size": 8}})
        params = {"do_remote_prefill": True, "remote_request_id": f"{self.name}-{len(self.bodies)}",
                  "remote_engine_id": self.name, "remote_ranks": [0], "remote_block_ids": [[1, 2]],
                  "prompt_token_ids": [1, 2, 3], "first_token_id": 7, "block_size": 8}
        return JSONResponse({"id": "cmpl-p", "object": "text_completion", "choices": [{"index": 0, "text": "x"}],
                             "kv_transfer_params": params})

    async def release(self, request: Request) -> JSONResponse:
        self.released.append((await request.json())["remote_request_id"])
        self.auth.append(request.headers.get("authorization"))
        return JSONResponse({"released": True})


class FakeDecode:
    """The whole answer (streamed when asked); `failures` first answers are a failed KV pull. A
    reservation request is answered with its `mode`: PULL (no reservation) or a PUSH reservation."""

    def __init__(self, failures: int = 0, mode: str = "PULL", name: str = "d") -> None:
        self.bodies, self.failures, self.mode, self.name = [], failures, mode, name
        self.reserves, self.released = [], []
        self.app = FastAPI()
        for path in ("/v1/completions", "/v1/chat/completions"):
            self.app.add_api_route(path, self.decode, methods=["POST"])
        self.app.add_api_route("/v1/kv_transfer/release", self.release, methods=["POST"])

    async def release(self, request: Request) -> JSONResponse:
        self.released.append((await request.json())["remote_request_id"])
        return JSONResponse({"released": True})

    def reserve(self, body: dict) -> JSONResponse:
        self.reserves.append(body)
        if self.mode == "PULL":
            return JSONResponse({"kv_transfer_params": {"kv_cache_transfer_mode": "PULL"}})
        return JSONResponse({"kv_transfer_params": {
            "do_remote_decode": True, "kv_cache_transfer_mode": "PUSH", "reservation_id": f"{self.name}-r{len(self.reserves)}",
            "reservation_replica": 0, "remote_engine_id": self.name, "remote_ranks": [0], "remote_block_ids": [4, 5],
            "cached_blocks": 0, "num_prompt_tokens": 3, "block_size": 8}})

    @staticmethod
    def events(body: dict) -> list[str]:
        source = body["kv_transfer_params"]["remote_engine_id"]
        return [json.dumps({"choices": [{"index": 0, "delta": {"content": f"from {source} {i}"}}]}) for i in range(3)]

    async def decode(self, request: Request):
        body = await request.json()
        if (body.get("kv_transfer_params") or {}).get("reserve"):
            return self.reserve(body)
        self.bodies.append(body)
        failed = len(self.bodies) <= self.failures
        if body.get("stream"):
            events = [json.dumps(FAILED)] if failed else self.events(body)

            async def sse():
                for event in events + ["[DONE]"]:
                    yield f"data: {event}\n\n"
            return StreamingResponse(sse(), media_type="text/event-stream")
        if failed:
            return JSONResponse(FAILED, status_code=502)
        return JSONResponse({"id": "cmpl-d", "choices": [{"index": 0, "text": "decoded"}],
                             "usage": {"completion_tokens": 8}})


def _dead() -> str:
    return f"http://127.0.0.1:{free_port()}"


def _router(stack: ExitStack, prefill=(), decode=(), plain=()) -> str:
    settings = RouterSettings(prefill_instances=tuple(prefill), decode_instances=tuple(decode),
                              instances=tuple(plain), request_timeout=20)
    return stack.enter_context(running_app(Router(settings).app))


def _serve(stack: ExitStack, *fakes) -> list[str]:
    return [stack.enter_context(running_app(f.app)) for f in fakes]


def _events(r: httpx.Response) -> list[str]:
    return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_prefill_then_decode_bodies_and_release():
    p, d = FakePrefill("p"), FakeDecode()
    with ExitStack() as stack:
        p_url, d_url = _serve(stack, p, d)
        router = _router(stack, [p_url], [d_url])
        r = httpx.post(router + "/v1/completions", json={**COMPLETION, "n": 1, "stream": False}, timeout=20,
                       headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
        assert p.bodies == [{**COMPLETION, "n": 1, "stream": False, "max_tokens": 1,
                             "kv_transfer_params": {"do_remote_decode": True}}]
        assert "max_completion_tokens" not in p.bodies[0]
        p_params = {"do_remote_prefill": True, "remote_request_id": "p-1", "remote_engine_id": "p",
                    "remote_ranks": [0], "remote_block_ids": [[1, 2]], "prompt_token_ids": [1, 2, 3],
                    "first_token_id": 7, "block_size": 8}
        assert d.bodies == [{**COMPLETION, "n": 1, "stream": False, "kv_transfer_params": p_params}]
        assert d.reserves == [{**COMPLETION, "n": 1, "stream": False,
                               "kv_transfer_params": {"do_remote_prefill": True, "reserve": True}}]
        wait_for(lambda: p.released == ["p-1"], 5, "P was not told to release the blocks")
        assert p.auth == ["Bearer k"]  # the client's key reaches the release too
        r = httpx.post(router + "/v1/completions", json=COMPLETION, timeout=20)
        assert r.status_code == 200 and len(d.bodies) == 2
        assert len(d.reserves) == 1, "a PULL decode instance is asked for a reservation once"
        assert httpx.get(router + "/health").status_code == 200  # a PREFILL and DECODE pair serves
        assert httpx.get(router + "/v1/models").json()["data"][0]["id"] == "tiny"


def test_stream_passes_through_and_chat_prefill_asks_one_token():
    p, d = FakePrefill("p"), FakeDecode()
    with ExitStack() as stack:
        p_url, d_url = _serve(stack, p, d)
        router = _router(stack, [p_url], [d_url])
        with httpx.stream("POST", router + "/v1/chat/completions", json=CHAT, timeout=20) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = _events(r)
        assert events == FakeDecode.events(d.bodies[0]) + ["[DONE]"]
        sent = p.bodies[0]
        assert sent["stream"] is False and sent["max_tokens"] == 1 and sent["max_completion_tokens"] == 1
        assert "stream_options" not in sent and sent["n"] == 1
        assert d.bodies[0]["stream"] is True and d.bodies[0]["stream_options"] == {"include_usage": True}
        wait_for(lambda: p.released == ["p-1"], 5, "no release after the stream")


def test_a_dead_prefill_or_decode_instance_is_skipped():
    p, d = FakePrefill("p"), FakeDecode()
    with ExitStack() as stack:
        p_url, d_url = _serve(stack, p, d)
        router = _router(stack, [_dead(), p_url], [_dead(), d_url])
        start = time.monotonic()
        r = httpx.post(router + "/v1/completions", json=COMPLETION, timeout=20)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
        assert time.monotonic() - start < 10
        assert len(p.bodies) == 1 and len(d.bodies) == 1
        listed = {i["name"]: i["in_flight"] for i in httpx.get(router + "/instances").json()["instances"]}
        assert set(listed.values()) == {0}  # every in-flight count went back


def test_failed_pull_runs_again_on_another_prefill_instance():
    p1, p2, d = FakePrefill("p1"), FakePrefill("p2"), FakeDecode(failures=1)
    with ExitStack() as stack:
        p1_url, p2_url, d_url = _serve(stack, p1, p2, d)
        router = _router(stack, [p1_url, p2_url], [d_url])
        r = httpx.post(router + "/v1/completions", json=COMPLETION, timeout=20)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
        assert [b["kv_transfer_params"]["remote_engine_id"] for b in d.bodies] == ["p1", "p2"]
        wait_for(lambda: p1.released == ["p1-1"] and p2.released == ["p2-1"], 5, "not both released")


def test_failed_pull_twice_is_the_answer_streamed_or_not():
    p1, p2, d = FakePrefill("p1"), FakePrefill("p2"), FakeDecode(failures=100)
    with ExitStack() as stack:
        p1_url, p2_url, d_url = _serve(stack, p1, p2, d)
        router = _router(stack, [p1_url, p2_url], [d_url])
        r = httpx.post(router + "/v1/completions", json=COMPLETION, timeout=20)
        assert r.status_code == 502 and r.json() == FAILED
        assert len(d.bodies) == 2  # the flow ran once more, on the other P, and no more
        with httpx.stream("POST", router + "/v1/chat/completions", json=CHAT, timeout=20) as r:
            assert r.status_code == 200
            events = _events(r)
        assert [json.loads(events[0]), events[1:]] == [FAILED, ["[DONE]"]]
        assert len(d.bodies) == 4
        wait_for(lambda: len(p1.released) == 2 and len(p2.released) == 2, 5, "not every prefill released")


def test_failed_pull_with_one_prefill_instance_is_passed_on():
    p, d = FakePrefill("p"), FakeDecode(failures=100)
    with ExitStack() as stack:
        p_url, d_url = _serve(stack, p, d)
        router = _router(stack, [p_url], [d_url])
        r = httpx.post(router + "/v1/completions", json=COMPLETION, timeout=20)
        assert r.status_code == 502 and r.json()["error"]["type"] == "kv_transfer_failed"
        assert len(p.bodies) == 1 and len(d.bodies) == 1


def test_no_prefill_or_no_decode_is_503_at_once():
    p, d = FakePrefill("p"), FakeDecode()
    with ExitStack() as stack:
        p_url, d_url = _serve(stack, p, d)
        for prefill, decode, words in (([], [d_url], "only DECODE instances"), ([p_url], [], "only PREFILL instances"),
                                       ([_dead()], [d_url], "no PREFILL instance left"),
                                       ([p_url], [_dead()], "no DECODE instance left")):
            router = _router(stack, prefill, decode)
            start = time.monotonic()
            r = httpx.post(router + "/v1/completions", json=COMPLETION, timeout=10)
            assert time.monotonic() - start < 5
            assert r.status_code == 503, r.text
            assert r.json()["error"]["type"] == "service_unavailable" and words in r.json()["error"]["message"]
        assert d.bodies == [] and p.bodies == []  # no prompt was prefilled for nothing


def test_push_reserves_on_decode_then_prefills_into_it_then_decodes():
    p, d = FakePrefill("p"), FakeDecode(mode="PUSH")
    with ExitStack() as stack:
        p_url, d_url = _serve(stack, p, d)
        router = _router(stack, [p_url], [d_url])
        r = httpx.post(router + "/v1/completions", json=COMPLETION, timeout=20)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
        assert d.reserves == [{**COMPLETION, "stream": False,
                               "kv_transfer_params": {"do_remote_prefill": True, "reserve": True}}]
        reservation = json.loads(d.reserve(d.reserves[0]).body)["kv_transfer_params"]
        d.reserves.pop()
        reservation = {k: v for k, v in reservation.items() if k != "reservation_replica"}  # D's own business
        assert p.bodies == [{**COMPLETION, "stream": False, "n": 1, "max_tokens": 1,
                             "kv_transfer_params": {**reservation, "reservation_id": "d-r1"}}]
        assert d.bodies == [{**COMPLETION, "kv_transfer_params": {
            "do_remote_prefill": True, "kv_cache_transfer_mode": "PUSH", "reservation_id": "d-r1",
            "remote_engine_id": "p", "prompt_token_ids": [1, 2, 3], "first_token_id": 7, "block_size": 8,
            "reservation_replica": 0}}]
        with httpx.stream("POST", router + "/v1/chat/completions", json=CHAT, timeout=20) as r:
            assert r.status_code == 200
            assert _events(r) == FakeDecode.events(d.bodies[1]) + ["[DONE]"]
        assert len(d.reserves) == 2 and d.reserves[1]["stream"] is False and "stream_options" not in d.reserves[1]
        assert p.bodies[1]["kv_transfer_params"]["reservation_id"] == "d-r2" and p.bodies[1]["max_completion_tokens"] == 1
        time.sleep(0.3)
        assert p.released == [] and d.released == []  # nothing is held after a push that worked


def test_a_failed_push_cancels_the_reservation_and_runs_again_on_another_decode_instance():
    p, d1, d2 = FakePrefill("p", push_failures=1), FakeDecode(mode="PUSH", name="d1"), FakeDecode(mode="PUSH", name="d2")
    with ExitStack() as stack:
        p_url, d1_url, d2_url = _serve(stack, p, d1, d2)
        router = _router(stack, [p_url], [d1_url, d2_url])
        r = httpx.post(router + "/v1/completions", json=COMPLETION, timeout=20)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
        assert len(p.bodies) == 2
        first, second = (d1, d2) if p.bodies[0]["kv_transfer_params"]["reservation_id"] == "d1-r1" else (d2, d1)
        assert len(first.reserves) == 1 and first.bodies == [] and len(second.bodies) == 1
        assert second.bodies[0]["kv_transfer_params"]["reservation_id"] == f"{second.name}-r1"
        wait_for(lambda: first.released == [f"{first.name}-r1"], 5, "the failed push's reservation was not cancelled")
        # one DECODE instance: the failure is the answer, and its reservation is cancelled
        p.push_failures = 100
        router = _router(stack, [p_url], [d1_url])
        r = httpx.post(router + "/v1/completions", json=COMPLETION, timeout=20)
        assert r.status_code == 502 and r.json() == PUSH_FAILED
        wait_for(lambda: d1.released[-1] == f"d1-r{len(d1.reserves)}", 5, "the reservation was not cancelled")


@pytest.mark.parametrize("status,released", [(400, True), (503, True), (500, False)])
def test_a_reservation_is_freed_at_once_only_when_p_surely_writes_nothing_more(status, released):
    """P refused the request (400, 503): nothing was written, D's reservation is cancelled now. P's engine
    failed (500): a push of P's may still be writing, so the reservation is left to expire."""
    error = {"error": {"message": "no", "type": "BadRequestError" if status == 400 else "ServerError",
                       "param": None, "code": status}}
    p, d = FakePrefill("p", answer=(status, error)), FakeDecode(mode="PUSH")
    with ExitStack() as stack:
        p_url, d_url = _serve(stack, p, d)
        r = httpx.post(_router(stack, [p_url], [d_url]) + "/v1/completions", json=COMPLETION, timeout=20)
        assert r.status_code == status and r.json() == error and d.bodies == []
        if released:
            wait_for(lambda: d.released == ["d-r1"], 5, "the reservation was not cancelled")
        else:
            time.sleep(0.5)
            assert d.released == []


def test_mix_instances_serve_whole_requests_without_a_pair():
    mix, p = FakeDecode(), FakePrefill("p")  # FakeDecode as a whole-request instance: it answers "decoded"
    with ExitStack() as stack:
        mix_url, p_url = _serve(stack, mix, p)
        router = _router(stack, [p_url], [], [mix_url])
        body = {**COMPLETION, "kv_transfer_params": {"remote_engine_id": "client"}}
        r = httpx.post(router + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 200 and mix.bodies == [body] and p.bodies == []


def test_policy_disaggregates_only_with_both_roles():
    pool, policy = InstancePool(), RoutingPolicy()
    pool.add(InstanceInfo(name="p:1", role="PREFILL", model="m"), "etcd")
    assert not policy.disaggregates(pool, "m")
    pool.add(InstanceInfo(name="d:1", role="DECODE", model="other"), "etcd")
    assert not policy.disaggregates(pool, "m") and not policy.disaggregates(pool, "other")
    pool.add(InstanceInfo(name="d:2", role="DECODE", model="m"), "etcd")
    assert policy.disaggregates(pool, "m") and policy.disaggregates(pool, None)
    pool.add(InstanceInfo(name="p:2", role="PREFILL", model="m"), "etcd")
    pool.instances["p:1"].in_flight = 2
    assert policy.pick(pool, ("PREFILL",), "m", set()).name == "p:2"
    assert policy.route(pool, "m", set()) is None  # no DEFAULT or MIX instance


@pytest.mark.slow  # a CLI process (~5-12 s); the in-process launch check stays in the default run
def test_route_refuses_kv_push_dst_rotate(cli):
    r = cli("route", "--kv_push_dst_rotate=true", f"--port={free_port()}", timeout=60)
    assert r.rc == 2 and "Traceback" not in r.err
    assert r.err.strip().splitlines()[-1].startswith("heterollm: error: --kv_push_dst_rotate: ")
    r = cli("route", "--prefill_instances=localhost", timeout=60)
    assert r.rc == 2 and r.err.strip().endswith("--prefill_instances: 'localhost' is not http://host:port")


def test_serve_registers_the_pd_role_either_spelling():
    from heterollm.config import load_config
    from heterollm.entrypoints.serve import make_registrar

    for flags, role in ((["--instance_role", "DECODE"], "DECODE"), (["--splitwise_role", "prefill"], "PREFILL"),
                        (["--splitwise_role", "mixed"], "DEFAULT")):
        cfg = load_config([*flags, "--xservice_address", "127.0.0.1:1", "--xservice_rpc_protocol", "http"]).config
        assert make_registrar(cfg, "tiny", "127.0.0.1", 8000).info.role == role
