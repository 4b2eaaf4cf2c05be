"""Request fields of OpenAI's and vLLM's schemas that work, on both routes (issue 20's rule; the
refused ones are in test_request_schema_rule.py): each sampling field reaches the engine's
SamplingParams with its value, and vLLM's request_id, return_tokens_as_token_ids,
return_token_ids, add_special_tokens, the template variables reasoning_effort and documents,
OpenAI's prompt_cache_key (a replica per key), and the opaque ids user and safety_identifier."""
from __future__ import annotations

import json
import logging
import re
import threading
import time
import zlib

import httpx
import pytest

from conftest import MODEL, make_engine, serving
from heterollm.entrypoints.openai.protocol import BadRequest

MSG = [{"role": "user", "content": "hi"}]
ROUTES = {"completions": ("/v1/completions", {"prompt": "Once upon a time"}),
          "chat": ("/v1/chat/completions", {"messages": MSG})}


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def post(http, route: str, **body) -> httpx.Response:
    path, base = ROUTES[route]
    return http.post(path, json={"model": MODEL, "max_tokens": 4, **base, **body})


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def sse(http, route: str, **body) -> list[dict]:
    path, base = ROUTES[route]
    with http.stream("POST", path, json={"model": MODEL, "max_tokens": 4, **base, **body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


class Captured(Exception):
    pass


@pytest.fixture
def capture(srv, monkeypatch):
    """What the server hands the engine (SamplingParams and scheduling kwargs); the request then stops
    with a 400 before it runs, so the test stays fast."""
    seen: dict = {}

    async def add(prompt, params, request_id, **kwargs):
        seen.update(params=params, request_id=request_id, **kwargs)
        raise BadRequest("captured")

    monkeypatch.setattr(srv.server.replicas[0], "add", add)
    return seen


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("field, value, attr", [
    ("temperature", 0.5, "temperature"), ("top_p", 0.5, "top_p"), ("top_k", 7, "top_k"), ("min_p", 0.25, "min_p"),
    ("presence_penalty", 0.5, "presence_penalty"), ("frequency_penalty", 0.75, "frequency_penalty"),
    ("repetition_penalty", 1.25, "repetition_penalty"), ("seed", 1234, "seed"), ("stop", ["zz"], "stop"),
    ("stop_token_ids", [5], "stop_token_ids"), ("include_stop_str_in_output", True, "include_stop_str_in_output"),
    ("ignore_eos", True, "ignore_eos"), ("skip_special_tokens", False, "skip_special_tokens"), ("n", 2, "n"),
    ("max_tokens", 3, "max_tokens"), ("max_completion_tokens", 3, "max_tokens"),
])
def test_sampling_fields_reach_the_engine(http, capture, route, field, value, attr):
    if field == "max_completion_tokens" and route == "completions":
        pytest.skip("a chat field")
    post(http, route, temperature=0.9, max_tokens=None)
    default = getattr(capture["params"], attr)
    assert default != value
    r = post(http, route, **{"temperature": 0.9, "max_tokens": None, field: value})
    assert r.json()["error"]["message"] == "captured"
    assert getattr(capture["params"], attr) == value


@pytest.mark.parametrize("route", ROUTES)
def test_priority_reaches_the_scheduler(http, capture, route):
    post(http, route, priority=-3)
    assert capture["priority"] == -3


@pytest.mark.parametrize("route", ROUTES)
def test_model_is_the_served_name_or_404(http, route):
    assert ok(post(http, route, model=MODEL))["model"] == MODEL
    r = post(http, route, model="some-other-model")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


@pytest.mark.parametrize("route, prefix", [("completions", "cmpl-"), ("chat", "chatcmpl-")])
def test_request_id_names_the_response_and_the_request(srv, http, route, prefix):
    assert ok(post(http, route, request_id="my-id-1"))["id"] == prefix + "my-id-1"
    assert {c["id"] for c in sse(http, route, request_id="my-id-2")} == {prefix + "my-id-2"}
    assert re.fullmatch(prefix + "[0-9a-f]{32}", ok(post(http, route))["id"])
    # two in flight with the same id: the second is a 400 naming request_id. The engine thread is held
    # (between steps) until both wait for admission, so neither can finish before the other comes in.
    engine, gate, got = srv.server.async_engine, threading.Event(), []
    hold = threading.Thread(target=engine.call, args=(lambda _: gate.wait(30),))
    hold.start()
    with httpx.Client(base_url=srv.url, timeout=60) as a, httpx.Client(base_url=srv.url, timeout=60) as b:
        both = [threading.Thread(target=lambda c=c: got.append(post(c, route, request_id="twice"))) for c in (a, b)]
        for t in both:
            t.start()
        deadline = time.monotonic() + 30
        while engine._commands.qsize() < 2 and time.monotonic() < deadline:  # both admissions queued
            time.sleep(0.01)
        gate.set()
        for t in (*both, hold):
            t.join(30)
    assert sorted(r.status_code for r in got) == [200, 400]
    err = next(r for r in got if r.status_code == 400).json()["error"]
    assert err["param"] == "request_id" and "already in use" in err["message"]


def test_return_tokens_as_token_ids_completions(srv, http):
    plain = ok(post(http, "completions", temperature=0, logprobs=2))["choices"][0]
    out = ok(post(http, "completions", temperature=0, logprobs=2, return_tokens_as_token_ids=True))["choices"][0]
    lp = out["logprobs"]
    ids = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
    assert all(re.fullmatch(r"token_id:\d+", t) for t in lp["tokens"])
    assert srv.engine.tokenizer.decode(ids) == out["text"] == plain["text"]
    assert lp["text_offset"] == plain["logprobs"]["text_offset"]  # offsets into the text, not into the names
    assert lp["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    assert all(all(k.startswith("token_id:") for k in top) for top in lp["top_logprobs"])


def test_return_tokens_as_token_ids_chat(srv, http):
    out = ok(post(http, "chat", temperature=0, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True))
    content = out["choices"][0]["logprobs"]["content"]
    ids = [int(e["token"].removeprefix("token_id:")) for e in content]
    assert srv.engine.tokenizer.decode(ids) == out["choices"][0]["message"]["content"]
    assert all(re.fullmatch(r"token_id:\d+", t["token"]) for e in content for t in e["top_logprobs"])


def test_return_token_ids_completions(srv, http):
    ids = srv.engine.tokenizer.encode("Once upon a time")
    out = ok(post(http, "completions", temperature=0, max_tokens=6, return_token_ids=True))
    choice = out["choices"][0]
    assert choice["prompt_token_ids"] == ids
    assert len(choice["token_ids"]) == out["usage"]["completion_tokens"] == 6
    assert srv.engine.tokenizer.decode(choice["token_ids"]) == choice["text"]
    chunks = sse(http, "completions", temperature=0, max_tokens=6, return_token_ids=True)
    assert chunks[0]["choices"][0]["prompt_token_ids"] == ids
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == choice["token_ids"]
    assert "token_ids" not in ok(post(http, "completions"))["choices"][0]


def test_return_token_ids_chat(srv, http):
    out = ok(post(http, "chat", temperature=0, max_tokens=6, return_token_ids=True))
    assert len(out["prompt_token_ids"]) == out["usage"]["prompt_tokens"]
    token_ids = out["choices"][0]["token_ids"]
    assert srv.engine.tokenizer.decode(token_ids) == out["choices"][0]["message"]["content"]
    chunks = sse(http, "chat", temperature=0, max_tokens=6, return_token_ids=True)
    assert chunks[0]["prompt_token_ids"] == out["prompt_token_ids"]
    assert sum((c["choices"][0].get("token_ids", []) for c in chunks), []) == token_ids


@pytest.mark.parametrize("route, default", [("completions", True), ("chat", False)])
def test_add_special_tokens_reaches_the_tokenizer(srv, http, monkeypatch, route, default):
    tok = srv.engine.tokenizer
    calls = []
    real = tok.encode

    def encode(text, add_special_tokens=True):
        calls.append(add_special_tokens)
        return real(text, add_special_tokens)

    monkeypatch.setattr(tok, "encode", encode)
    ok(post(http, route))
    ok(post(http, route, add_special_tokens=not default))
    assert calls == [default, not default]


TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
            "{% if reasoning_effort %} effort={{ reasoning_effort }}{% endif %}"
            "{% for d in documents or [] %} doc={{ d['title'] }}{% endfor %}")


@pytest.mark.parametrize("field, value, text", [
    ("reasoning_effort", "high", "hi effort=high"),
    ("documents", [{"title": "A", "text": "x"}, {"title": "B", "text": "y"}], "hi doc=A doc=B"),
])
def test_template_variables_reach_the_template(srv, http, field, value, text):
    out = ok(post(http, "chat", chat_template=TEMPLATE, return_token_ids=True, **{field: value}))
    assert out["prompt_token_ids"] == srv.engine.tokenizer.encode(text, add_special_tokens=False)
    # a template that does not read it: refused, since it would change nothing
    r = post(http, "chat", chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}", **{field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert "does not read" in r.json()["error"]["message"]


@pytest.mark.parametrize("route, field", [("completions", "user"), ("chat", "user"), ("chat", "safety_identifier")])
def test_end_user_ids_are_accepted_and_change_nothing(http, caplog, route, field):
    want = ok(post(http, route, temperature=0))["choices"][0]
    with caplog.at_level(logging.WARNING, logger="heterollm.server"):
        got = ok(post(http, route, temperature=0, **{field: "end-user-42"}))["choices"][0]
    assert got == want
    assert not [r for r in caplog.records if field in r.getMessage()]


def test_prompt_cache_key_pins_a_replica(tiny_llama):
    keys = {zlib.crc32(k.encode()) % 2: k for k in (f"conversation-{i}" for i in range(20))}
    with serving([make_engine(tiny_llama), make_engine(tiny_llama)]) as two, httpx.Client(timeout=60) as http:
        r0, r1 = two.server.replicas
        for replica, other in ((r1, r0), (r0, r1), (r1, r0)):
            key = keys[two.server.replicas.index(replica)]
            before = (replica.steps, other.steps)
            r = http.post(two.url + "/v1/chat/completions",
                          json={"model": MODEL, "messages": MSG, "max_tokens": 2, "prompt_cache_key": key})
            assert r.status_code == 200, r.text
            assert replica.steps > before[0] and other.steps == before[1]
