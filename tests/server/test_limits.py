"""Concurrency, limits and lifecycle: 32 concurrent streams, 429s, the API key, client disconnects."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from conftest import MODEL, make_engine, serving
from helpers import build_tiny_model
from test_openai_api import metric

LONG = 3000
"""Tokens a request asks for when it must still be running while the test acts on it."""


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("long-llama"), "llama", max_position_embeddings=4096)


def _prompts() -> list[str]:
    words = "river stone cloud amber forest quiet lantern copper meadow signal harbor velvet".split()
    return [" ".join(words[i % 12: i % 12 + 1 + i % 5]) + f" {i}" for i in range(32)]


def test_32_concurrent_streams_equal_non_streamed_greedy(srv):
    prompts = _prompts()
    kw = dict(model=MODEL, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    sync = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
    expected = [sync.completions.create(prompt=p, **kw).choices[0].text for p in prompts]

    async def stream_all() -> list[str]:
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)

        async def one(p: str) -> str:
            text = ""
            async for chunk in await client.completions.create(prompt=p, stream=True, **kw):
                text += "".join(c.text for c in chunk.choices)
            return text

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    got = asyncio.run(stream_all())
    assert got == expected
    assert len(set(expected)) > 1


def _open_stream(client: httpx.Client, max_tokens: int = LONG) -> httpx.Response:
    """A streaming completion that is still producing when this returns (its first chunk read)."""
    req = client.build_request("POST", "/v1/completions", json={
        "model": MODEL, "prompt": "go on", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True})
    resp = client.send(req, stream=True)
    assert resp.status_code == 200
    lines = resp.iter_lines()
    assert next(line for line in lines if line.startswith("data:"))
    resp.lines = lines
    return resp


def _wait_idle(url: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(url + "/metrics").text
        if (metric(text, "heterollm_num_requests_running") == 0 and metric(text, "heterollm_kv_cache_usage_perc") == 0
                and metric(text, "heterollm_http_requests_in_flight") == 0):
            return text
        if time.monotonic() > deadline:
            raise AssertionError("the server did not free the aborted request:\n" + text)
        time.sleep(0.1)


def test_429_beyond_max_concurrent_requests(long_model):
    with serving(make_engine(long_model, max_model_len=4096), max_concurrent_requests=2) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c1, httpx.Client(base_url=srv.url, timeout=60) as c2:
        streams = [_open_stream(c1), _open_stream(c2)]
        t0 = time.monotonic()
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "one more", "max_tokens": 2})
        assert time.monotonic() - t0 < 2.0  # refused at once, not queued
        assert r.status_code == 429
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and "max_concurrent_requests=2" in err["message"]
        for s in streams:
            s.close()
        _wait_idle(srv.url)
        ok = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "now", "max_tokens": 2})
        assert ok.status_code == 200


def test_429_when_the_request_queue_is_full(tiny_llama):
    with serving(make_engine(tiny_llama, request_queue_size=2)) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 3})
        assert r.status_code == 429
        assert "request_queue_size=2" in r.json()["error"]["message"]
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 2}).status_code == 200


def test_api_key(tiny_llama, monkeypatch):
    with serving(make_engine(tiny_llama), api_key="sekret") as srv:
        body = {"prompt": "x", "max_tokens": 2}
        assert httpx.post(srv.url + "/v1/completions", json=body).status_code == 401
        wrong = httpx.post(srv.url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json() == {"error": {
            "message": "missing or wrong API key: send 'Authorization: Bearer <key>'", "type": "authentication_error",
            "param": None, "code": 401}}
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert httpx.get(srv.url + "/health").status_code == 200
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)
        assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="bad", max_retries=0).models.list()


def test_disconnect_mid_stream_frees_blocks(long_model):
    with serving(make_engine(long_model, max_model_len=4096)) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as client:
        stream = _open_stream(client)
        for _ in range(3):
            next(stream.lines)
        busy = httpx.get(srv.url + "/metrics").text
        assert metric(busy, "heterollm_kv_cache_usage_perc") > 0
        stream.close()  # the client goes away
        idle = _wait_idle(srv.url)
        assert metric(idle, "heterollm_request_aborts_total") == 1
        assert metric(idle, "heterollm_generation_tokens_total") == 0  # it never ran to its end


def test_disconnect_while_waiting_for_a_full_answer(long_model):
    with serving(make_engine(long_model, max_model_len=4096)) as srv:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", timeout=1.0, json={
                "prompt": "go on", "max_tokens": LONG, "temperature": 0, "ignore_eos": True})
        idle = _wait_idle(srv.url)
        assert metric(idle, "heterollm_request_aborts_total") == 1
