"""Issue 20's sampling fields over HTTP on both routes: logit_bias, bad_words, allowed_token_ids,
min_tokens, truncate_prompt_tokens and best_of each change the answer as transformers' own generate
(with the matching logits processor) or a float64 reference says; bad values are a 400 whose
`param` names the field, and the server serves on."""
from __future__ import annotations

import httpx
import pytest

from conftest import MODEL
from helpers import hf_generate, hf_logprobs

PROMPT = [5, 6, 7, 8]
MSG = [{"role": "user", "content": "hi"}]
GREEDY = {"temperature": 0, "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def completion(http, prompt=PROMPT, **body) -> dict:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 6, **GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def chat(http, **body) -> dict:
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG, "max_tokens": 6, **GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def chat_prompt(srv) -> list[int]:
    return srv.engine.tokenizer.apply_chat_template(MSG, add_generation_prompt=True)


def hf(tiny_llama, ids, max_new=6, **kwargs) -> list[int]:
    return hf_generate(tiny_llama, ids, max_new, eos_token_id=None, min_new_tokens=max_new, **kwargs)


def test_logit_bias_on_both_routes(http, srv, tiny_llama):
    target = 1234
    bias = {"1234": 5.0, "40": -100}
    want = hf(tiny_llama, PROMPT, sequence_bias={(1234,): 5.0, (40,): -100.0})
    got = completion(http, logit_bias=bias)["choices"][0]["token_ids"]
    assert got == want and target in got
    assert completion(http, logit_bias={"1234": 1e6})["choices"][0]["token_ids"] == [target] * 6  # clamped to 100
    ids = chat_prompt(srv)
    want = hf(tiny_llama, ids, sequence_bias={(1234,): 5.0, (40,): -100.0})
    assert chat(http, logit_bias=bias)["choices"][0]["token_ids"] == want


def test_bad_words_on_both_routes(http, srv, tiny_llama):
    tok = srv.engine.tokenizer
    plain, spaced = tok.encode("hello", add_special_tokens=False), tok.encode(" hello", add_special_tokens=False)
    bias = {(spaced[0],): 6.0}  # makes " hello" likely, mid-text
    assert spaced[0] in hf(tiny_llama, PROMPT, sequence_bias=bias)
    want = hf(tiny_llama, PROMPT, sequence_bias=bias, bad_words_ids=[plain, spaced])
    got = completion(http, logit_bias={str(spaced[0]): 6.0}, bad_words=["hello"])["choices"][0]
    assert got["token_ids"] == want and "hello" not in got["text"]
    ids = chat_prompt(srv)
    want = hf(tiny_llama, ids, sequence_bias=bias, bad_words_ids=[plain, spaced])
    assert chat(http, logit_bias={str(spaced[0]): 6.0}, bad_words=["hello"])["choices"][0]["token_ids"] == want


def test_allowed_token_ids_on_both_routes(http, srv, tiny_llama):
    allowed = [100, 200, 300, 7000]
    want = hf(tiny_llama, PROMPT, prefix_allowed_tokens_fn=lambda _b, _i: allowed)
    assert completion(http, allowed_token_ids=allowed)["choices"][0]["token_ids"] == want
    ids = chat_prompt(srv)
    want = hf(tiny_llama, ids, prefix_allowed_tokens_fn=lambda _b, _i: allowed)
    got = chat(http, allowed_token_ids=allowed)["choices"][0]["token_ids"]
    assert got == want and set(got) <= set(allowed)


def test_min_tokens_masks_eos_on_both_routes(http, srv, tiny_llama):
    eos = srv.engine.tokenizer.hf.eos_token_id
    body = {"ignore_eos": False, "min_tokens": 3, "logit_bias": {str(eos): 100}, "max_tokens": 10}
    want = hf_generate(tiny_llama, PROMPT, 10, eos_token_id=eos, min_new_tokens=3, sequence_bias={(eos,): 100.0})
    assert len(want) == 4 and want[-1] == eos  # exactly min_tokens tokens, then EOS
    out = completion(http, **body)
    assert out["choices"][0]["token_ids"] == want and out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == 4
    ids = chat_prompt(srv)
    want = hf_generate(tiny_llama, ids, 10, eos_token_id=eos, min_new_tokens=3, sequence_bias={(eos,): 100.0})
    assert chat(http, **body)["choices"][0]["token_ids"] == want


def test_truncate_prompt_tokens_on_both_routes(http, srv, tiny_llama):
    long = list(range(100, 140))
    out = completion(http, prompt=long, truncate_prompt_tokens=5, echo=True)
    assert out["usage"]["prompt_tokens"] == 5
    assert out["choices"][0]["token_ids"] == hf(tiny_llama, long[-5:])
    assert out["choices"][0]["text"].startswith(srv.engine.tokenizer.decode(long[-5:], skip_special_tokens=False))
    assert completion(http, prompt=long, truncate_prompt_tokens=-1)["usage"]["prompt_tokens"] == 40
    ids = chat_prompt(srv)
    out = chat(http, truncate_prompt_tokens=4)
    assert out["usage"]["prompt_tokens"] == 4 and out["choices"][0]["token_ids"] == hf(tiny_llama, ids[-4:])
    # truncated before the context check: prompts longer than max_model_len (256) fit once cut
    too_long = list(range(100, 400))
    assert completion(http, prompt=too_long, truncate_prompt_tokens=8)["usage"]["prompt_tokens"] == 8
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi " * 300}],
                                                "max_tokens": 2, "truncate_prompt_tokens": 8})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 8, r.text


def test_best_of_returns_the_highest_cumulative_logprob(http, tiny_llama):
    sampled = {"temperature": 1.0, "seed": 3, "ignore_eos": True, "return_token_ids": True, "max_tokens": 5}
    # sequence i samples with seed + i: n=4 shows the 4 candidates best_of=4 ranks
    seqs = [c["token_ids"] for c in completion(http, n=4, **sampled)["choices"]]

    def cumulative(seq):  # float64 over transformers' log-softmax at each generated position
        lps = hf_logprobs(tiny_llama, PROMPT + seq).double()
        return sum(lps[len(PROMPT) - 1 + j, t].item() for j, t in enumerate(seq))

    scores = [cumulative(s) for s in seqs]
    best = sorted(range(4), key=lambda i: -scores[i])
    out = completion(http, n=2, best_of=4, **sampled)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert [c["token_ids"] for c in out["choices"]] == [seqs[best[0]], seqs[best[1]]]
    assert out["usage"]["completion_tokens"] == 10  # the returned choices' tokens, as vLLM counts
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG, "n": 1, "best_of": 2, **sampled})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field,value,words", [
    ("logit_bias", {"abc": 1.0}, "not a token id"),
    ("logit_bias", {"99999999": 1.0}, "vocabulary"),
    ("logit_bias", {"-3": 1.0}, "non-negative"),
    ("logit_bias", {"5": "x"}, "valid number"),
    ("allowed_token_ids", [5, 99999999], "vocabulary"),
    ("allowed_token_ids", [], "non-empty"),
    ("allowed_token_ids", ["5"], "valid integer"),
    ("bad_words", [" "], "blank"),
    ("bad_words", "hello", "valid array"),
    ("truncate_prompt_tokens", 0, "-1"),
    ("truncate_prompt_tokens", -2, "-1"),
    ("truncate_prompt_tokens", 257, "max_model_len"),
    ("best_of", 1, "between n (2)"),
    ("best_of", 129, "between n"),
])
def test_bad_values_are_a_400_naming_the_field(http, route, field, value, words):
    base = {"prompt": "Once upon a time"} if route == "/v1/completions" else {"messages": MSG}
    r = http.post(route, json={"model": MODEL, "max_tokens": 2, "n": 2, **base, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    # a wrong type inside the field is named down to its item (logit_bias.5), as for every field
    assert err["param"].split(".")[0] == field and err["type"] == "invalid_request_error", err
    assert words in err["message"], err


def test_best_of_with_stream_is_a_400_and_the_server_serves_on(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "n": 1, "best_of": 2, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of" and "stream" in r.json()["error"]["message"]
    ok = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "n": 2, "best_of": 2, "stream": True,
                                            "max_tokens": 2})
    assert ok.status_code == 200 and ok.text.rstrip().endswith("data: [DONE]")  # best_of == n streams
    assert completion(http)["choices"][0]["finish_reason"] == "length"
