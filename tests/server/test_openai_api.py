"""The OpenAI API through the official `openai` client against a live server: completions, chat,
streaming, logprobs, n > 1, stop strings, usage numbers, /tokenize, /detokenize, /v1/models."""
from __future__ import annotations

import json
import math
import time

import httpx
import openai
import pytest

from conftest import MODEL
from heterollm.sampling import SamplingParams

CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def offline_greedy(srv, ids: list[int], max_tokens: int) -> list[int]:
    """The same engine, driven directly (on its own thread, between steps)."""
    def run(engine):
        rid = engine.add_request(ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        while True:
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    return out.outputs[0].token_ids
    return srv.server.async_engine.call(run)


def tokenize(http, **body) -> list[int]:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_models_health_version(http, client):
    assert http.get("/health").status_code == 200
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert http.get("/version").json()["version"]


def test_openapi_documents_every_post_body_as_required_json_of_its_request_model(http):
    """The POST routes read the raw request (to answer a bad body with an OpenAI-style 400 naming the
    field), so FastAPI cannot infer their bodies: /openapi.json (and /docs) carry each one's request
    model, as a required JSON body, so a generated client sends it."""
    from heterollm.entrypoints.openai import pooling, protocol
    spec = http.get("/openapi.json").json()
    assert http.get("/docs").status_code == 200
    routes = {"/v1/completions": protocol.CompletionRequest, "/v1/chat/completions": protocol.ChatCompletionRequest,
              "/tokenize": protocol.TokenizeRequest, "/detokenize": protocol.DetokenizeRequest,
              "/v1/embeddings": pooling.EmbeddingRequest, "/v1/rerank": pooling.RerankRequest,
              "/rerank": pooling.RerankRequest, "/v2/rerank": pooling.RerankRequest,
              "/v1/score": pooling.ScoreRequest, "/score": pooling.ScoreRequest}
    for path, model in routes.items():
        body = spec["paths"][path]["post"]["requestBody"]
        assert body["required"] is True, path
        [(kind, content)] = body["content"].items()
        want = model.model_json_schema()
        assert kind == "application/json", path
        assert set(content["schema"]["properties"]) == set(want["properties"]), path
        assert content["schema"].get("required") == want.get("required"), path
    assert "messages" in spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]["required"]
    assert {m for p in ("/health", "/metrics", "/version", "/v1/models") for m in spec["paths"][p]} == {"get"}


def test_models_lists_each_served_name_as_openai_and_vllm_describe_a_model(http):
    """OpenAI's Model object (id, object "model", created in seconds, owned_by) with vLLM's additions
    (root: the checkpoint, here the served name as no path was given; parent null; max_model_len:
    the fixture's 256), inside a list object."""
    before = int(time.time())
    body = http.get("/v1/models").json()
    [model] = body["data"]
    assert isinstance(model["created"], int) and 0 <= before - model["created"] < 3600
    del model["created"]
    assert body == {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "heterollm",
                                                "root": MODEL, "parent": None, "max_model_len": 256}]}


def test_completion_matches_engine_and_usage(srv, client, http):
    prompt = "The capital of France is"
    ids = tokenize(http, prompt=prompt)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    [choice] = out.choices
    expected = offline_greedy(srv, ids, 12)
    assert choice.text == srv.engine.tokenizer.decode(expected)
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == len(ids) + 12
    assert out.model == MODEL and out.object == "text_completion"


def test_completion_token_prompts_and_batches(client, http):
    ids = tokenize(http, prompt="Once upon a time")
    one = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    batch = client.completions.create(model=MODEL, prompt=["Once upon a time", "Hello"], max_tokens=6,
                                      temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == one.choices[0].text
    assert batch.usage.prompt_tokens == len(ids) + len(tokenize(http, prompt="Hello"))


def test_completion_logprobs_and_echo(client, http):
    prompt = "Roses are red"
    ids = tokenize(http, prompt=prompt)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=3,
                                    echo=True)
    [c] = out.choices
    lp = c.logprobs
    assert c.text.startswith(prompt)
    assert len(lp.tokens) == len(ids) + 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert value <= 0 and token in top and top[token] == pytest.approx(value)
    # greedy: the chosen token is the most likely one
    for token, top in zip(lp.tokens[len(ids):], lp.top_logprobs[len(ids):]):
        assert top[token] == pytest.approx(max(top.values()))
    assert lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens) == c.text


def test_echo_of_a_token_prompt_keeps_its_special_tokens(srv, client):
    """A prompt sent as token ids is echoed as their text, special tokens written out (vLLM's way)."""
    tok = srv.engine.tokenizer.hf
    ids = [tok.convert_tokens_to_ids("<|im_start|>")] + tok.encode("Roses are red", add_special_tokens=False)
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, echo=True,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text.startswith("<|im_start|>Roses are red")


def test_detokenize_writes_special_tokens_out_and_checks_the_model(srv, http):
    tok = srv.engine.tokenizer.hf
    ids = [tok.convert_tokens_to_ids("<|im_start|>")] + tok.encode("user", add_special_tokens=False)
    r = http.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": "<|im_start|>user"}, r.text
    r = http.post("/detokenize", json={"model": "not-served", "tokens": ids})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text


def test_chat_and_streaming_chat_agree(client, http):
    ids = tokenize(http, messages=CHAT)
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert full.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == msg.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == full.choices[0].finish_reason
    last = chunks[-1]
    assert last.choices == [] and last.usage.prompt_tokens == len(ids)
    assert last.usage.completion_tokens == full.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])
    # on the wire, every choice carries finish_reason (null until the end), the first one too, as OpenAI's
    with http.stream("POST", "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 3,
                                                            "stream": True}) as r:
        data = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert data[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None}]
    assert all("finish_reason" in c for d in data for c in d["choices"])
    assert all(set(d) >= {"id", "object", "created", "model", "choices"} and isinstance(d["created"], int)
               for d in data)


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                         top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob) and t.logprob <= 0
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
    # logprobs without top_logprobs: each position's own logprob and no alternatives
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0, logprobs=True,
                                         extra_body={"ignore_eos": True})
    assert [t.top_logprobs for t in out.choices[0].logprobs.content] == [[], [], []]


def test_n_choices_seeded(client):
    kw = dict(model=MODEL, prompt="Pick a number:", max_tokens=8, temperature=1.0, n=4, seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2, 3]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # the seed reproduces every choice
    assert len({c.text for c in a.choices}) > 1  # and the choices are different samples
    streamed = list(client.completions.create(**kw, stream=True))
    texts = {i: "" for i in range(4)}
    for ch in streamed:
        for c in ch.choices:
            texts[c.index] += c.text
    assert [texts[i] for i in range(4)] == [c.text for c in a.choices]


def test_stop_strings_never_leak(client):
    base = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    words = base.split()
    assert len(words) > 3
    stop = words[2]
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert out.finish_reason == "stop" and stop not in out.text
    assert base.startswith(out.text)
    assert out.model_extra["stop_reason"] == stop, "the matched stop string is the choice's stop_reason"
    chunks = [ch.choices[0] for ch in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}) if ch.choices]
    assert "".join(c.text for c in chunks) == out.text
    assert chunks[-1].finish_reason == "stop" and chunks[-1].model_extra["stop_reason"] == stop


def test_usage_counts_equal_the_tokens(client, http):
    out = client.completions.create(model=MODEL, prompt="Count me", max_tokens=7, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True})
    c = out.choices[0]
    assert out.usage.completion_tokens == len(c.logprobs.tokens) == 7
    assert out.usage.prompt_tokens == len(tokenize(http, prompt="Count me"))
    chunks = list(client.completions.create(model=MODEL, prompt="Count me", max_tokens=7, temperature=0,
                                            stream=True, stream_options={"include_usage": True,
                                                                         "continuous_usage_stats": True},
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    counts = [ch.usage.completion_tokens for ch in chunks]
    assert counts == sorted(counts)


def test_tokenize_detokenize_roundtrip(http):
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "héllo wörld 🙂", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == 256
    back = http.post("/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json()
    assert back["prompt"] == "héllo wörld 🙂"
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > r["count"]


def test_max_tokens_defaults(client, http):
    # completions: OpenAI's default of 16; chat: up to the context left
    out = client.completions.create(model=MODEL, prompt="Hi", temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16
    ids = tokenize(http, messages=CHAT)
    out = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 256 - len(ids)
    assert out.choices[0].finish_reason == "length"


def test_metrics_text(http, client):
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3, temperature=0)
    text = http.get("/metrics").text
    for name in ("heterollm_requests_total", "heterollm_time_to_first_token_seconds_bucket",
                 "heterollm_time_per_output_token_seconds_bucket", "heterollm_e2e_request_latency_seconds_bucket",
                 "heterollm_num_requests_running", "heterollm_num_requests_waiting", "heterollm_kv_cache_usage_perc",
                 "heterollm_prompt_tokens_total", "heterollm_generation_tokens_total"):
        assert name in text, name
    value = metric(text, "heterollm_generation_tokens_total")
    assert value >= 3 and math.isfinite(value)
    # every sample is labelled with the served model's name
    from prometheus_client.parser import text_string_to_metric_families

    labelled = [(sample.name, sample.labels["model_name"]) for family in text_string_to_metric_families(text)
                if family.name.startswith("heterollm_") for sample in family.samples if "model_name" in sample.labels]
    assert {name for name, _ in labelled} >= {"heterollm_e2e_request_latency_seconds_count",
                                              "heterollm_time_to_first_token_seconds_count",
                                              "heterollm_requests_total", "heterollm_prompt_tokens_total"}
    assert {value for _, value in labelled} == {MODEL}


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_cached_tokens_in_usage_and_prefix_cache_metrics(http, client):
    system = "You are a careful assistant who answers briefly and never repeats the question. " * 3
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}]
    before = metric(http.get("/metrics").text, "heterollm_prefix_cache_hits_total")
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    messages[1]["content"] = "Name a fruit."
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 40 and cached % 8 == 0 and cached < second.usage.prompt_tokens
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    last = list(stream)[-1]
    assert last.usage.prompt_tokens_details.cached_tokens >= cached
    text = http.get("/metrics").text
    assert metric(text, "heterollm_prefix_cache_hits_total") - before >= 2 * cached
    assert metric(text, "heterollm_prefix_cache_queries_total") >= metric(text, "heterollm_prefix_cache_hits_total")
    assert 0 < metric(text, "heterollm_prefix_cache_hit_rate") <= 1
    assert metric(text, "heterollm_prefix_cache_blocks") >= 5


def test_streamed_completion_logprobs_count_text_offsets_from_the_start_of_the_completion(client):
    """Without echo the first token starts at offset 0 and each next one where the text before it
    ends, across chunks: the stream's offsets are the whole response's."""
    kwargs = dict(model=MODEL, prompt="Roses are red", max_tokens=6, temperature=0, logprobs=1)
    whole = client.completions.create(**kwargs).choices[0].logprobs
    tokens, offsets = [], []
    for chunk in client.completions.create(**kwargs, stream=True):
        lp = chunk.choices[0].logprobs
        if lp is not None:
            tokens += lp.tokens
            offsets += lp.text_offset
    assert tokens == whole.tokens and len(tokens) == 6
    assert offsets[0] == 0 and offsets == [sum(len(t) for t in tokens[:k]) for k in range(6)]
    assert offsets == whole.text_offset
