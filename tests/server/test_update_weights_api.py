"""POST /update_weights (--dynamic_load_weight 1): from a path or a safetensors body, the served
model's greedy answers switch to the new weights' (transformers' greedy on them); without the flag,
or with a path or body that cannot be read, a 400 naming what is wrong and the old weights stay."""
from __future__ import annotations

import httpx
import pytest

from conftest import MODEL, make_engine, serving
from helpers import build_tiny_model, hf_greedy

PROMPT = list(range(300, 316))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("reload-api")
    return build_tiny_model(root / "a", "llama", seed=0), build_tiny_model(root / "b", "llama", seed=1)


def greedy(url: str) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8,
                                                  "temperature": 0, "ignore_eos": True, "logprobs": 0,
                                                  "return_tokens_as_token_ids": True}, timeout=60)
    return [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def test_reload_from_a_path_and_from_a_body(models):
    from safetensors.torch import save_file
    a, b = models
    with serving(make_engine(a, dynamic_load_weight=1)) as srv:
        assert greedy(srv.url) == hf_greedy(a, [PROMPT], 8)[0]
        r = httpx.post(f"{srv.url}/update_weights", json={"path": str(b)}, timeout=60)
        assert r.status_code == 200 and r.json()["tensors"] > 0 and r.json()["replicas"] == 1, r.text
        assert greedy(srv.url) == hf_greedy(b, [PROMPT], 8)[0]
        # back to A, sent as a body
        payload = next(a.glob("*.safetensors")).read_bytes()
        r = httpx.post(f"{srv.url}/update_weights", content=payload,
                       headers={"Content-Type": "application/octet-stream"}, timeout=60)
        assert r.status_code == 200, r.text
        assert greedy(srv.url) == hf_greedy(a, [PROMPT], 8)[0]
        for kwargs, param in [({"json": {"path": "/no/such/folder"}}, "path"), ({"json": {}}, "path"),
                              ({"content": b"not json"}, "body"),
                              ({"content": b"\x00" * 16, "headers": {"Content-Type": "application/octet-stream"}},
                               "body")]:
            r = httpx.post(f"{srv.url}/update_weights", timeout=60, **kwargs)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert greedy(srv.url) == hf_greedy(a, [PROMPT], 8)[0]


def test_without_the_flag_the_route_names_it(models, tmp_path):
    a, b = models
    with serving(make_engine(a)) as srv:
        r = httpx.post(f"{srv.url}/update_weights", json={"path": str(b)}, timeout=60)
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "dynamic_load_weight" and "--dynamic_load_weight" in r.text
        assert greedy(srv.url) == hf_greedy(a, [PROMPT], 8)[0]
