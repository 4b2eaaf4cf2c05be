"""vLLM's `prompt_logprobs` over HTTP, in vLLM's format (per choice on /v1/completions, top level on
/v1/chat/completions): per prompt token null (the first) or {token id: {logprob, rank, decoded_token}},
the prompt's token first, then the top k; checked against transformers' log_softmax on the prompt."""
from __future__ import annotations

import httpx
import pytest

from helpers import hf_logprobs

PROMPT = [1, 9038, 2057, 253, 1115, 28]


def post(srv, path: str, **body) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=120)


def check_against_hf(srv, folder, ids: list[int], got: list, k: int) -> None:
    want = hf_logprobs(folder, ids)  # (len, vocab): position j predicts token j + 1
    decode = srv.engine.tokenizer.decode
    assert len(got) == len(ids) and got[0] is None
    for j in range(1, len(ids)):
        row = want[j - 1]
        entries = list(got[j].items())
        token, own = entries[0]
        assert token == str(ids[j])
        assert own["logprob"] == pytest.approx(float(row[ids[j]]), abs=1e-4)
        lo = int((row > row[ids[j]] + 1e-5).sum()) + 1  # the rank, allowing for float noise in near-ties
        hi = int((row > row[ids[j]] - 1e-5).sum())
        assert lo <= own["rank"] <= max(lo, hi)
        assert own["decoded_token"] == decode([ids[j]], skip_special_tokens=False)
        top = row.topk(k)
        tops = entries[1:] if str(ids[j]) not in [str(t) for t in top.indices.tolist()] else entries
        assert [int(t) for t, _ in tops] == top.indices.tolist()
        for rank, ((t, e), v) in enumerate(zip(tops, top.values.tolist()), start=1):
            assert e["logprob"] == pytest.approx(v, abs=1e-4)
            assert e["rank"] == rank and e["decoded_token"] == decode([int(t)], skip_special_tokens=False)


@pytest.mark.parametrize("k", [0, 3])
def test_completions_carry_them_per_choice(srv, tiny_llama, k):
    r = post(srv, "/v1/completions", prompt=PROMPT, max_tokens=2, n=2, temperature=0, prompt_logprobs=k)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2 and choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]
    check_against_hf(srv, tiny_llama, PROMPT, choices[0]["prompt_logprobs"], k)
    if k == 0:
        assert all(len(e) == 1 for e in choices[0]["prompt_logprobs"][1:])


def test_chat_carries_them_at_the_top_level(srv, tiny_llama):
    messages = [{"role": "user", "content": "What is the capital of Japan?"}]
    ids = srv.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    r = post(srv, "/v1/chat/completions", messages=messages, max_tokens=2, prompt_logprobs=2)
    assert r.status_code == 200, r.text
    body = r.json()
    assert "prompt_logprobs" not in body["choices"][0]
    check_against_hf(srv, tiny_llama, ids, body["prompt_logprobs"], 2)


def test_a_cached_prompt_gets_the_same_ones(srv):
    """The second request's prompt is in the prefix cache; its prompt logprobs are still computed."""
    first = post(srv, "/v1/completions", prompt=PROMPT * 3, max_tokens=1, prompt_logprobs=1).json()
    again = post(srv, "/v1/completions", prompt=PROMPT * 3, max_tokens=1, prompt_logprobs=1).json()
    assert again["choices"][0]["prompt_logprobs"] == first["choices"][0]["prompt_logprobs"]
    assert len(first["choices"][0]["prompt_logprobs"]) == 18


def test_absent_unless_asked(srv):
    c = post(srv, "/v1/completions", prompt=PROMPT, max_tokens=1).json()
    assert c["choices"][0]["prompt_logprobs"] is None
    chat = post(srv, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], max_tokens=1).json()
    assert chat["prompt_logprobs"] is None


def test_echo_with_logprobs_and_prompt_logprobs(srv, tiny_llama):
    """vLLM's echo + logprobs also fills prompt_logprobs (at the logprobs' k); prompt_logprobs sets its
    own k while the echoed tokens' top_logprobs keep the logprobs' k."""
    echo = post(srv, "/v1/completions", prompt=PROMPT, max_tokens=1, echo=True, logprobs=1).json()["choices"][0]
    check_against_hf(srv, tiny_llama, PROMPT, echo["prompt_logprobs"], 1)
    both = post(srv, "/v1/completions", prompt=PROMPT, max_tokens=1, echo=True, logprobs=1,
                prompt_logprobs=4).json()["choices"][0]
    check_against_hf(srv, tiny_llama, PROMPT, both["prompt_logprobs"], 4)
    assert all(len(top) <= 2 for top in both["logprobs"]["top_logprobs"][1:])


@pytest.mark.parametrize("path, extra", [
    ("/v1/completions", {"prompt_logprobs": 21}),
    ("/v1/completions", {"prompt_logprobs": -1}),
    ("/v1/chat/completions", {"prompt_logprobs": 21}),
    ("/v1/completions", {"prompt_logprobs": 1, "stream": True}),
    ("/v1/chat/completions", {"prompt_logprobs": 2, "stream": True}),
    ("/v1/completions", {"prompt_logprobs": "2"}),
])
def test_bad_values_are_400s_naming_the_field(srv, path, extra):
    base = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = post(srv, path, **base, max_tokens=1, **extra)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt_logprobs"


def test_zero_with_a_stream_is_accepted(srv):
    r = post(srv, "/v1/completions", prompt=PROMPT, max_tokens=2, prompt_logprobs=0, stream=True)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
