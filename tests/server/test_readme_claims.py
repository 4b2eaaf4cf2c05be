"""README claims about the server that greedy parity does not reach: choice indices over several
prompts with n > 1, chat echo / continue_final_message / chat_template_kwargs (prompts checked
against transformers' own chat templating), --max_waiting_time -> 503, /health 503 once a worker
died, and data-parallel routing to the replica with the fewest outstanding tokens."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time

import httpx
import pytest

from conftest import MODEL, make_engine, serving
from helpers import build_tiny_model

LONG = 3000
"""Tokens a request asks for when it must still be running while the test acts on it."""


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("claims-llama"), "llama", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_llama):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tiny_llama))


def post(http, path: str, **body) -> dict:
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


# -- choice index -------------------------------------------------------------------------------

def test_choice_index_is_prompt_times_n_plus_choice(http):
    prompts = [[5, 6, 7], [300, 301], [1000, 20, 4000, 50]]
    kw = dict(max_tokens=5, temperature=1.0, seed=7, n=2, ignore_eos=True)
    batch = post(http, "/v1/completions", prompt=prompts, **kw)["choices"]
    assert sorted(c["index"] for c in batch) == list(range(6))
    by_index = {c["index"]: c["text"] for c in batch}
    for p, prompt in enumerate(prompts):  # index p * n + i holds choice i of prompt p
        alone = post(http, "/v1/completions", prompt=prompt, **kw)["choices"]
        assert [by_index[p * 2 + c["index"]] for c in alone] == [c["text"] for c in alone]
    streamed: dict[int, str] = {}
    with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": prompts, "stream": True, **kw}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
    assert streamed == by_index


# -- chat prompts ---------------------------------------------------------------------------------

CONV = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]


def hf_ids(tok, conv, **kwargs) -> list[int]:
    text = tok.apply_chat_template(conv, tokenize=False, **kwargs)
    return tok.encode(text, add_special_tokens=False)


def test_continue_final_message_continues_the_assistant_turn(http, hf_tokenizer):
    want = hf_ids(hf_tokenizer, CONV, add_generation_prompt=False, continue_final_message=True)
    assert hf_tokenizer.decode(want).endswith("The colour is"), "the final turn is left open"
    got = post(http, "/tokenize", messages=CONV, add_generation_prompt=False, continue_final_message=True)["tokens"]
    assert got == want
    out = post(http, "/v1/chat/completions", messages=CONV, add_generation_prompt=False, continue_final_message=True,
               max_tokens=4, temperature=0)
    assert out["usage"]["prompt_tokens"] == len(want)
    closed = hf_ids(hf_tokenizer, CONV, add_generation_prompt=True)
    assert post(http, "/v1/chat/completions", messages=CONV, max_tokens=4,
                temperature=0)["usage"]["prompt_tokens"] == len(closed) != len(want)


def test_chat_echo_prepends_the_final_assistant_content(http):
    kw = dict(messages=CONV, add_generation_prompt=False, continue_final_message=True, max_tokens=6, temperature=0,
              ignore_eos=True)
    plain = post(http, "/v1/chat/completions", **kw)["choices"][0]["message"]["content"]
    echoed = post(http, "/v1/chat/completions", echo=True, **kw)["choices"][0]["message"]["content"]
    assert echoed == "The colour is" + plain
    user_last = post(http, "/v1/chat/completions", messages=CONV[:1], echo=True, max_tokens=3,
                     temperature=0)["choices"][0]["message"]["content"]
    assert not user_last.startswith("Name a colour"), "only a final assistant message is echoed"
    chunks = []
    with http.stream("POST", "/v1/chat/completions", json={"model": MODEL, "echo": True, "stream": True, **kw}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
    assert chunks[0] == "The colour is" and "".join(chunks) == echoed


TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
            "{% if shout %}!!!{% endif %}{% if suffix %}{{ suffix }}{% endif %}")


def test_chat_template_kwargs_reach_the_template(http, hf_tokenizer):
    conv = CONV[:1]
    for kwargs in ({}, {"shout": True}, {"shout": True, "suffix": " -- over"}):
        want = hf_ids(hf_tokenizer, conv, chat_template=TEMPLATE, add_generation_prompt=True, **kwargs)
        got = post(http, "/tokenize", messages=conv, chat_template=TEMPLATE, chat_template_kwargs=kwargs)["tokens"]
        assert got == want, kwargs
        out = post(http, "/v1/chat/completions", messages=conv, chat_template=TEMPLATE, chat_template_kwargs=kwargs,
                   max_tokens=2, temperature=0)
        assert out["usage"]["prompt_tokens"] == len(want)
    assert hf_tokenizer.decode(want) == "Name a colour.!!! -- over"


# -- limits and lifecycle -------------------------------------------------------------------------

class Stream:
    """A streamed completion read on its own thread; `started` is set at its first chunk."""

    def __init__(self, url: str, body: dict) -> None:
        self.started, self.lines = threading.Event(), []
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.client = httpx.Client(timeout=120)
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            with self.client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
                for line in r.iter_lines():
                    self.lines.append(line)
                    self.started.set()
        except httpx.HTTPError:
            pass
        finally:
            self.started.set()

    def close(self) -> None:
        self.client.close()
        self.thread.join(30)


def long_body(n: int = LONG) -> dict:
    return {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": n, "temperature": 0, "ignore_eos": True}


def test_max_waiting_time_flag_reaches_the_server(long_model):
    from heterollm.config import load_config
    from heterollm.entrypoints.serve import server_settings

    assert server_settings(load_config(["--model", str(long_model), "--max_waiting_time", "2"])).max_waiting_time == 2
    assert server_settings(load_config(["--model", str(long_model)])).max_waiting_time is None


def test_a_request_not_started_within_max_waiting_time_gets_503(long_model):
    engine = make_engine(long_model, max_model_len=4096, num_gpu_blocks_override=1024, max_seqs_per_batch=1)
    with serving(engine, max_waiting_time=1.0) as srv:
        quick = httpx.post(srv.url + "/v1/completions", json=long_body(4), timeout=60)
        assert quick.status_code == 200, "a request that starts in time is served"
        busy = Stream(srv.url, long_body())  # holds the only batch slot
        try:
            assert busy.started.wait(60)
            t0 = time.monotonic()
            r = httpx.post(srv.url + "/v1/completions", json=long_body(4), timeout=60)
            waited = time.monotonic() - t0
            assert r.status_code == 503, r.text
            assert r.json()["error"]["type"] == "service_unavailable" and "max_waiting_time" in r.text
            assert r.json()["error"]["param"] == "request"  # the request as a whole, not one of its fields
            assert 0.9 < waited < 10
            with httpx.stream("POST", srv.url + "/v1/completions", json={**long_body(4), "stream": True},
                              timeout=60) as s:
                events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
            assert events and events[-1]["error"]["code"] == 503, "in a stream: an error event"
        finally:
            busy.close()


def test_health_turns_503_after_a_worker_dies(long_model, caplog):
    engine = make_engine(long_model, tp_size=2, health_check_interval_ms=200)
    with serving(engine) as srv, caplog.at_level(logging.ERROR, logger="heterollm"):
        assert httpx.get(srv.url + "/health").status_code == 200
        ps = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(os.getpid())], capture_output=True,
                            text=True).stdout.splitlines()
        workers = [int(line.split()[0]) for line in ps if "spawn_main" in line]
        assert len(workers) == 2
        os.kill(max(workers), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while httpx.get(srv.url + "/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert "not running" in r.json()["error"]["message"]
        # the log says why, as /health does
        why = r.json()["error"]["message"].split("not running: ", 1)[1]
        assert any(rec.getMessage() == f"the engine cannot go on ({why}): failing every request"
                   for rec in caplog.records), [rec.getMessage() for rec in caplog.records]


def test_data_parallel_routes_to_the_least_loaded_replica(long_model):
    engines = [make_engine(long_model, max_model_len=4096, num_gpu_blocks_override=1024) for _ in range(2)]
    with serving(engines) as srv:
        r0, r1 = srv.server.replicas
        streams = []
        try:
            # loads: a = 4 + 3000 tokens; b goes where nothing runs; c (4 + 500) to the lighter of the two
            for body, want in ((long_body(LONG), (1, 0)), (long_body(1500), (1, 1)), (long_body(500), (1, 2))):
                streams.append(Stream(srv.url, body))
                assert streams[-1].started.wait(60)
                assert (len(r0._outstanding), len(r1._outstanding)) == want, [r0.load, r1.load]
        finally:
            for s in streams:
                s.close()
