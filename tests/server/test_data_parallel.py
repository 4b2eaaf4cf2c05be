"""--dp_size replicas behind one server: requests spread by outstanding tokens, answers identical
to one engine, gauges per replica; the offline entry points refuse replicas."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import MODEL, make_engine, serving
from heterollm import LLM
from heterollm.config import ConfigError


def answers(srv, n=8):
    def one(i):
        body = {"model": MODEL, "prompt": list(range(5, 12 + 3 * i)), "max_tokens": 10 + i, "temperature": 0,
                "ignore_eos": True}
        return httpx.post(srv.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_two_replicas_answer_like_one_and_share_the_load(tiny_llama):
    with serving(make_engine(tiny_llama)) as one:
        want = answers(one)
    with serving([make_engine(tiny_llama), make_engine(tiny_llama)]) as two:
        assert answers(two) == want
        assert all(r.steps > 0 for r in two.server.replicas)  # both replicas ran requests
        assert all(r.load == 0 for r in two.server.replicas)
        text = httpx.get(two.url + "/metrics").text
        for rank in ("0", "1"):
            assert f'heterollm_num_requests_running{{dp_rank="{rank}",model_name="{MODEL}"}} 0.0' in text


def test_offline_api_refuses_replicas(tiny_llama):
    with pytest.raises(ConfigError, match="--dp_size=2: engine replicas are served behind `heterollm serve`"):
        LLM(str(tiny_llama), dp_size=2)


def test_generate_refuses_replicas(cli, tiny_llama):
    r = cli("generate", "--model", str(tiny_llama), "--prompt", "x", "--dp_size", "2")
    assert r.rc == 2 and "--dp_size=2: engine replicas are served behind `heterollm serve`" in r.err
