"""Bad input: an OpenAI error body naming the field, never a traceback or a 5xx, and everyone else
keeps being served (a good request streamed across all the bad ones still gets its exact answer)."""
from __future__ import annotations

import json
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import MODEL, make_engine, serving

MSG = [{"role": "user", "content": "hi"}]

CASES = [
    # (path, raw body, status, param, words in the message)
    ("/v1/completions", b'{"prompt": "x", ', 400, None, "not valid JSON"),
    ("/v1/completions", b"\xff\xfe\x00garbage", 400, None, "UTF-8"),
    ("/v1/completions", b"[1, 2]", 400, None, "JSON object"),
    ("/v1/completions", b"{}", 400, "prompt", "required"),
    ("/v1/completions", b'{"prompt": 5}', 400, "prompt", "must be a string"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "10"}', 400, "max_tokens", "integer"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": -3}', 400, "max_tokens", ">= 1"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 100000}', 400, "max_tokens", "max_model_len"),
    ("/v1/completions", b'{"prompt": "x", "temperature": -0.5}', 400, "temperature", ">= 0"),
    ("/v1/completions", b'{"prompt": "x", "top_p": 0}', 400, "top_p", "(0, 1]"),
    ("/v1/completions", b'{"prompt": "x", "top_p": 1.01}', 400, "top_p", "(0, 1]"),
    ("/v1/completions", b'{"prompt": "x", "n": 100000}', 400, "n", "128"),
    ("/v1/completions", b'{"prompt": "x", "n": 0}', 400, "n", "between 1"),
    ("/v1/completions", b'{"prompt": "x", "seed": 1180591620717411303424}', 400, "seed", "64 bits"),
    ("/v1/completions", b'{"prompt": "x", "temperature": 1e400}', 400, "temperature", "finite"),
    ("/v1/completions", b'{"prompt": "x", "logprobs": 50}', 400, "logprobs", "[0, 20]"),
    ("/v1/completions", b'{"prompt": [99999999]}', 400, "prompt", "vocabulary"),
    ("/v1/completions", b'{"prompt": ""}', 400, "prompt", "empty"),
    ("/v1/completions", b'{"prompt": "x", "stop": 3}', 400, "stop", "string"),
    ("/v1/completions", b'{"prompt": "x", "stream": "yes"}', 400, "stream", "boolean"),
    ("/v1/completions", b'{"prompt": "x", "model": "gpt-4"}', 404, "model", "does not exist"),
    ("/v1/completions", b'{"prompt": "x", "logit_bias": {"99999999": 1}}', 400, "logit_bias", "vocabulary"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages", "non-empty"),
    ("/v1/chat/completions", b'{"messages": "hi"}', 400, "messages", "array"),
    ("/v1/chat/completions", b'{"messages": [{"content": "hi"}]}', 400, "messages.0.role", "required"),
    ("/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "hi"}]}', 400, "messages.0.role", "robot"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 7}]}', 400, "messages.0.content", "string"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}]}', 400, "messages.0.content", "required"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400,
     "messages.0.content.0.image_url", "required"),
    ("/v1/chat/completions", json.dumps({"messages": MSG, "top_logprobs": 3}).encode(), 400, "top_logprobs",
     "logprobs=true"),
    # the sampling params' logprobs limit, named by chat's own field
    ("/v1/chat/completions", json.dumps({"messages": MSG, "logprobs": True, "top_logprobs": 21}).encode(), 400,
     "top_logprobs", "20"),
    ("/v1/chat/completions", json.dumps({"messages": MSG, "max_completion_tokens": 0}).encode(), 400,
     "max_completion_tokens", ">= 1"),
    ("/v1/chat/completions", json.dumps({"messages": MSG, "model": "nope"}).encode(), 404, "model", "nope"),
    ("/v1/chat/completions", json.dumps({"messages": MSG, "tools": [{"type": "function"}]}).encode(), 400,
     "tools.0.function", "is required"),
    ("/v1/chat/completions", json.dumps({"messages": MSG + [{"role": "assistant", "content": None, "tool_calls": {}}]}).encode(),
     400, "messages.1.tool_calls", "messages.1.tool_calls must be a list"),
    ("/v1/chat/completions", json.dumps({"messages": MSG + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"arguments": "{}"}}]}]}).encode(),
     400, "messages.1.tool_calls.0.function", "with a string name and arguments"),
    ("/v1/chat/completions", json.dumps({"messages": MSG + [{"role": "assistant", "content": None,
                                                            "tool_calls": ["get_weather()"]}]}).encode(),
     400, "messages.1.tool_calls.0.function", "with a string name and arguments"),
    ("/v1/chat/completions", json.dumps({"messages": MSG, "chat_template": "{% for %}"}).encode(), 400, "messages",
     "chat template"),
    ("/v1/chat/completions", json.dumps({"messages": MSG, "stream_options": {"include_usage": True}}).encode(), 400,
     "stream_options", "stream=true"),
    ("/v1/completions", b'{"prompt": "x", "priority": 3}', 400, "priority", "--priority_strategy=priority"),
    ("/v1/completions", b'{"prompt": "x", "priority": "high"}', 400, "priority", "integer"),
    ("/v1/completions", b'{"prompt": "x", "ttft_slo_ms": -5}', 400, "ttft_slo_ms", "positive"),
    ("/v1/chat/completions", json.dumps({"messages": MSG, "ttft_slo_ms": 1.5}).encode(), 400, "ttft_slo_ms",
     "integer"),
    ("/tokenize", b'{"prompt": "a", "messages": []}', 400, "prompt", "exactly one"),
    ("/detokenize", b'{"tokens": [-1]}', 400, "tokens", "vocabulary"),
]


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def check_error(r: httpx.Response, status: int, param: str | None, words: str) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["code"] == status
    assert words in err["message"], err["message"]
    assert "Traceback" not in r.text


@pytest.mark.parametrize("path,raw,status,param,words", CASES, ids=[f"{c[0]}:{c[1][:40]!r}" for c in CASES])
def test_bad_request(http, path, raw, status, param, words):
    check_error(http.post(path, content=raw, headers={"content-type": "application/json"}), status, param, words)


def test_bad_input_never_hurts_the_batch(srv, http):
    good = {"model": MODEL, "prompt": "A long and steady answer", "max_tokens": 120, "temperature": 0,
            "ignore_eos": True}
    expected = http.post("/v1/completions", json=good).json()["choices"][0]["text"]
    streamed: list[str] = []

    def stream() -> None:
        with httpx.Client(base_url=srv.url, timeout=60) as c, \
                c.stream("POST", "/v1/completions", json={**good, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    streamed.extend(ch["text"] for ch in json.loads(line[6:])["choices"])

    t = threading.Thread(target=stream)
    t.start()
    for path, raw, status, param, words in CASES:
        check_error(http.post(path, content=raw), status, param, words)
    t.join(60)
    assert "".join(streamed) == expected
    assert srv.server.async_engine.step_errors == 0 and srv.server.async_engine.alive
    assert http.get("/health").status_code == 200


def test_unknown_route_and_method(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = http.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


# -- fuzz ----------------------------------------------------------------------------------------

_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                               max_size=3), max_leaves=6)
_small = st.integers(min_value=-2, max_value=4)
_fields = {
    "model": st.sampled_from([MODEL, "other"]) | _json,
    "max_tokens": _small | _json, "max_completion_tokens": _small | _json,
    "temperature": st.floats(-1, 3) | _json, "top_p": st.floats(-0.5, 1.5) | _json, "top_k": _small | _json,
    "min_p": st.floats(-0.5, 1.5) | _json, "n": _small | _json, "seed": st.integers() | _json,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=2) | _json,
    "presence_penalty": st.floats(-3, 3) | _json, "frequency_penalty": st.floats(-3, 3) | _json,
    "repetition_penalty": st.floats(-1, 3) | _json, "logprobs": _small | st.booleans() | _json,
    "top_logprobs": _small | _json, "echo": st.booleans() | _json, "stream": st.booleans() | _json,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | _json}) | _json,
    "ignore_eos": st.booleans() | _json, "user": st.text(max_size=5) | _json,
    "stop_token_ids": st.lists(st.integers(-2, 60000), max_size=2) | _json,
}
_message = st.fixed_dictionaries({}, optional={"role": st.sampled_from(["user", "assistant", "system", "x"]) | _json,
                                               "content": st.text(max_size=10) | _json})
_completion = st.fixed_dictionaries({}, optional={"prompt": st.text(max_size=12) | st.lists(
    st.integers(-5, 60000), max_size=4) | _json, **_fields})
_chat = st.fixed_dictionaries({}, optional={"messages": st.lists(_message, max_size=3) | _json, **_fields})


@pytest.fixture(scope="module")
def fuzz_srv(tiny_llama):
    with serving(make_engine(tiny_llama, max_model_len=48)) as running:
        yield running


@pytest.mark.slow  # ~10 s: 150 examples
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), completion=_completion, chat=_chat)
def test_fuzz_no_5xx(fuzz_srv, path, completion, chat):
    body = completion if path == "/v1/completions" else chat
    r = httpx.post(fuzz_srv.url + path, content=json.dumps(body), timeout=60)
    assert r.status_code in (200, 400, 404), (body, r.status_code, r.text)
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert fuzz_srv.server.async_engine.step_errors == 0
