"""Scheduling over HTTP: the request fields `priority` and `ttft_slo_ms` (accepted under the matching strategy,
missed deadlines counted on /metrics) and a server with --enable_schedule_overlap."""
from __future__ import annotations

import httpx

from conftest import MODEL, make_engine, serving


def test_priority_and_deadline_fields(tiny_llama):
    with serving(make_engine(tiny_llama, priority_strategy="priority")) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as http:
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}
        plain = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        urgent = http.post("/v1/completions", json={**body, "priority": -5}).json()["choices"][0]["text"]
        assert urgent == plain
        # a target no request can meet: answered all the same, and counted
        r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "ttft_slo_ms": 1,
                                                    "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
        metrics = http.get("/metrics").text
        assert f'heterollm_ttft_slo_missed_total{{model_name="{MODEL}"}} 1.0' in metrics


def test_overlapped_server_answers_like_the_plain_one(tiny_llama):
    from concurrent.futures import ThreadPoolExecutor

    def answers(**flags):
        with serving(make_engine(tiny_llama, **flags)) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
            def one(i):
                body = {"model": MODEL, "prompt": list(range(5, 9 + i)), "max_tokens": 4 + i, "temperature": 0,
                        "ignore_eos": True}
                return http.post("/v1/completions", json=body).json()["choices"][0]["text"]
            with ThreadPoolExecutor(8) as pool:
                return list(pool.map(one, range(8)))

    assert answers(enable_schedule_overlap=True) == answers()


def test_a_failed_step_fails_its_requests_only_and_drops_the_prefix_cache(tiny_llama):
    engine = make_engine(tiny_llama, enable_in_batch_prefix_cache=True)
    with serving(engine) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        body = {"model": MODEL, "prompt": list(range(5, 40)), "max_tokens": 4, "temperature": 0}
        want = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        assert engine.kv.pool.num_cached > 0
        execute = engine.executor.execute

        def fail_once(so):
            engine.executor.execute = execute
            raise RuntimeError("injected device fault")
        engine.executor.execute = fail_once
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 500 and "injected device fault" in r.json()["error"]["message"]
        assert engine.kv.pool.num_cached == 0  # nothing registered by the failed step survives
        assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == want
        assert srv.server.async_engine.alive


def test_an_admission_that_fails_unexpectedly_is_a_500_logged_with_its_request(tiny_llama, caplog):
    """Not a refusal (RequestRejected is a 400): an error raised while admitting is logged with the
    request's id and traceback, answered 500, and the engine serves on."""
    import logging

    engine = make_engine(tiny_llama)
    add = engine.add_request

    def fail_once(*args, **kwargs):
        engine.add_request = add
        raise ValueError("injected admission fault")
    with serving(engine) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        engine.add_request = fail_once
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "request_id": "doomed"}
        with caplog.at_level(logging.ERROR, logger="heterollm"):
            r = http.post("/v1/completions", json=body)
        assert r.status_code == 500, r.text
        assert r.json()["error"]["message"] == "admitting the request failed: injected admission fault"
        [rec] = [rec for rec in caplog.records if rec.getMessage().startswith("admitting request")]
        assert rec.getMessage() == "admitting request cmpl-doomed failed" and rec.exc_info[0] is ValueError
        assert http.post("/v1/completions", json={**body, "request_id": "fine"}).status_code == 200
        assert srv.server.async_engine.alive
