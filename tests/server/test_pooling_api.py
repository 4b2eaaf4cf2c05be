"""The pooling routes over HTTP: the official `openai` client's embeddings.create (float and base64,
dimensions, strings and token ids) against the offline pooled vectors, /v1/rerank and /v1/score in
vLLM's shapes against transformers' reranker scores, and bad input (empty, over-long, wrong task:
400s naming the field or --task)."""
from __future__ import annotations

import time

import httpx
import openai
import pytest
import torch

from conftest import MODEL, make_engine, serving
from helpers import build_tiny_model, hf_pooled, hf_reranker_score

QUERY = "What is the capital of China?"
DOCS = ["The capital of China is Beijing.", "Gravity pulls things down.", "Beijing is in the north of China."]

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("pool-api"), "qwen3")


@pytest.fixture(scope="module")
def embed_srv(qwen3):
    with serving(make_engine(qwen3, task="embed", max_model_len=64)) as running:
        yield running


@pytest.fixture(scope="module")
def rerank_srv(qwen3):
    with serving(make_engine(qwen3, enable_qwen3_reranker=True)) as running:
        yield running


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_client_embeddings(embed_srv, qwen3):
    tok = embed_srv.engine.tokenizer
    texts = ["hello world", "the capital of Japan is Tokyo"]
    for kwargs in ({}, {"encoding_format": "float"}):  # unset: the client asks for base64 and decodes it
        res = client(embed_srv).embeddings.create(model=MODEL, input=texts, **kwargs)
        assert [d.index for d in res.data] == [0, 1] and res.model == MODEL
        for text, d in zip(texts, res.data):
            want = hf_pooled(qwen3, tok.encode(text), "LAST")
            torch.testing.assert_close(torch.tensor(d.embedding), want, atol=1e-4, rtol=0)
        n = sum(len(tok.encode(t)) for t in texts)
        assert res.usage.prompt_tokens == res.usage.total_tokens == n
    res = client(embed_srv).embeddings.create(model=MODEL, input="hello world", dimensions=8)
    torch.testing.assert_close(torch.tensor(res.data[0].embedding),
                               hf_pooled(qwen3, tok.encode("hello world"), "LAST", dimensions=8), atol=1e-4, rtol=0)
    ids = [[5, 6, 7], [8, 9]]
    res = client(embed_srv).embeddings.create(model=MODEL, input=ids)
    for one, d in zip(ids, res.data):
        torch.testing.assert_close(torch.tensor(d.embedding), hf_pooled(qwen3, one, "LAST"), atol=1e-4, rtol=0)
    one = client(embed_srv).embeddings.create(model=MODEL, input=[5, 6, 7])
    assert len(one.data) == 1 and one.data[0].embedding == pytest.approx(res.data[0].embedding, abs=1e-6)


def test_base64_is_little_endian_float32(embed_srv):
    import base64

    import numpy as np
    body = httpx.post(embed_srv.url + "/v1/embeddings", json={"input": "hi", "encoding_format": "base64"}).json()
    plain = httpx.post(embed_srv.url + "/v1/embeddings", json={"input": "hi"}).json()
    decoded = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == pytest.approx(plain["data"][0]["embedding"], abs=1e-7)
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"


def test_rerank_and_score_shapes_and_values(rerank_srv, qwen3):
    want = [hf_reranker_score(qwen3, QUERY, d) for d in DOCS]
    body = httpx.post(rerank_srv.url + "/v1/rerank", json={"model": MODEL, "query": QUERY, "documents": DOCS,
                                                           "top_n": 2}, timeout=60).json()
    order = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in body["results"]] == order
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx([want[i] for i in order], abs=1e-5)
    assert [r["document"]["text"] for r in body["results"]] == [DOCS[i] for i in order]
    assert body["usage"]["total_tokens"] > 0
    bare = httpx.post(rerank_srv.url + "/rerank", json={"query": QUERY, "documents": DOCS,
                                                        "return_documents": False}).json()
    assert len(bare["results"]) == 3 and "document" not in bare["results"][0]
    score = httpx.post(rerank_srv.url + "/v1/score", json={"model": MODEL, "text_1": QUERY, "text_2": DOCS}).json()
    assert [d["index"] for d in score["data"]] == [0, 1, 2] and score["data"][0]["object"] == "score"
    assert [d["score"] for d in score["data"]] == pytest.approx(want, abs=1e-5)


def test_embedding_server_scores_by_cosine(embed_srv):
    before = int(time.time())
    score = httpx.post(embed_srv.url + "/v1/score", json={"text_1": "hello", "text_2": ["hello", "bye"]}).json()
    assert score["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)
    assert score["data"][1]["score"] < 1.0
    # vLLM's score response: an id, a list object created now, the model, the data and the usage
    assert set(score) == {"id", "object", "created", "model", "data", "usage"}
    assert score["id"].startswith("score-") and score["object"] == "list" and score["model"] == MODEL
    assert before <= score["created"] <= time.time()
    status, err = error(embed_srv, "/v1/score", {"text_1": "hello", "text_2": "bye", "instruction": "judge"})
    assert status == 400 and err["param"] == "instruction"
    assert err["message"] == ("instruction is Qwen3-Reranker's (--enable_qwen3_reranker); an embedding launch "
                              "scores by cosine")


def error(srv, path: str, body: dict) -> tuple[int, dict]:
    r = httpx.post(srv.url + path, json=body, timeout=60)
    return r.status_code, r.json()["error"]


@pytest.mark.parametrize("body, param, needle", [
    ({"input": []}, "input", "empty"),
    ({"input": ""}, "input", "empty"),
    ({"input": ["ok", ""]}, "input.1", "empty"),
    ({"input": [[]]}, "input", "empty"),
    ({"input": list(range(3, 68))}, "input", "max_model_len) is 64 tokens, but the input has 65"),
    ({"input": [99999999]}, "input", "vocabulary"),
    ({"input": "x", "dimensions": 0}, "dimensions", "positive"),
    ({"input": "x", "dimensions": 65}, "dimensions", "hidden size"),
    ({"input": "x", "encoding_format": "bytes"}, "encoding_format", "float"),
    ({"input": "x", "colour": "red"}, "colour", "extra"),
    ({}, "input", "required"),
])
def test_bad_embedding_input(embed_srv, body, param, needle):
    status, err = error(embed_srv, "/v1/embeddings", body)
    assert status == 400 and err["param"] == param and needle in err["message"], err


def test_over_long_input_with_truncation_is_served(embed_srv, qwen3):
    ids = list(range(3, 80))
    body = httpx.post(embed_srv.url + "/v1/embeddings", json={"input": ids, "truncate_prompt_tokens": 20}).json()
    torch.testing.assert_close(torch.tensor(body["data"][0]["embedding"]), hf_pooled(qwen3, ids[-20:], "LAST"),
                               atol=1e-4, rtol=0)


def test_wrong_task_names_the_flag(embed_srv, rerank_srv):
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        status, err = error(embed_srv, path, body)
        assert status == 400 and "--task" in err["message"], err
    status, err = error(rerank_srv, "/v1/embeddings", {"input": "hi"})
    assert status == 400 and "--task embed" in err["message"], err


def test_bad_rerank_and_score_input(rerank_srv):
    cases = [("/v1/rerank", {"query": "q", "documents": []}, "documents", "empty"),
             ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n", ">= 0"),
             ("/v1/rerank", {"documents": ["a"]}, "query", "required"),
             ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2", "as many"),
             ("/v1/score", {"text_1": [], "text_2": "c"}, "text_1", "empty")]
    for path, body, param, needle in cases:
        status, err = error(rerank_srv, path, body)
        assert status == 400 and err["param"] == param and needle in err["message"], (path, body, err)


def test_a_plain_generate_server_refuses_pooling_routes(tiny_llama):
    with serving(make_engine(tiny_llama)) as srv:
        for path, body in (("/v1/embeddings", {"input": "hi"}), ("/v1/score", {"text_1": "a", "text_2": "b"}),
                           ("/v1/rerank", {"query": "a", "documents": ["b"]})):
            status, err = error(srv, path, body)
            assert status == 400 and "--task" in err["message"], (path, err)
        ok = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200
