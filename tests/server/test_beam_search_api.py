"""vLLM's `use_beam_search` (+ `length_penalty`) on /v1/completions and /v1/chat/completions: the n
choices are the beams of a beam search written in the test on transformers' forward of the same
tiny model, best first; fields beam search would ignore are 400s naming them."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from beam_reference import hf_beam_search
from conftest import make_engine, serving
from helpers import build_tiny_model, hf_greedy

PROMPT = [1, 9038, 2057, 253]


@pytest.fixture(scope="module")
def hf(tiny_llama):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def hf_tokenizer(folder):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder)


def post(srv, path: str, **body) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=120)


def texts(srv, beams, prompt: list[int]) -> list[str]:
    return [srv.engine.tokenizer.decode(tokens[len(prompt):]) for tokens, _, _ in beams]


def test_completions_choices_are_the_beams_best_first(srv, hf):
    prompts = [PROMPT, [19556, 905, 28, 1115]]
    r = post(srv, "/v1/completions", prompt=prompts, n=3, max_tokens=4, use_beam_search=True)
    assert r.status_code == 200, r.text
    body = r.json()
    want = [t for p in prompts for t in texts(srv, hf_beam_search(hf, p, 3, 4), p)]
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert [c["text"] for c in body["choices"]] == want
    assert {c["finish_reason"] for c in body["choices"]} == {"length"}
    assert body["usage"]["completion_tokens"] == 6 * 4 and body["usage"]["prompt_tokens"] == 8


def test_completions_echo_prefixes_the_prompt(srv, hf):
    text = "Hello world, this is"
    ids = srv.engine.tokenizer.encode(text)
    r = post(srv, "/v1/completions", prompt=text, n=2, max_tokens=3, use_beam_search=True, echo=True)
    assert [c["text"] for c in r.json()["choices"]] == [text + t for t in texts(srv, hf_beam_search(hf, ids, 2, 3),
                                                                                 ids)]


def test_chat_choices_and_its_stream_are_the_beams(srv, hf):
    messages = [{"role": "user", "content": "What is the capital of Japan?"}]
    ids = srv.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    want = texts(srv, hf_beam_search(hf, ids, 2, 5), ids)
    r = post(srv, "/v1/chat/completions", messages=messages, n=2, max_tokens=5, use_beam_search=True)
    assert r.status_code == 200, r.text
    assert [c["message"]["content"] for c in r.json()["choices"]] == want
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    # vLLM streams a chat beam search: the finished answer, one chunk per choice
    r = post(srv, "/v1/chat/completions", messages=messages, n=2, max_tokens=5, use_beam_search=True, stream=True)
    assert r.status_code == 200
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    got = ["", ""]
    for event in events[:-1]:
        for c in json.loads(event)["choices"]:
            got[c["index"]] += c["delta"].get("content", "")
    assert got == want


def test_width_one_is_greedy(srv, tiny_llama):
    r = post(srv, "/v1/completions", prompt=PROMPT, max_tokens=6, use_beam_search=True)
    assert r.json()["choices"][0]["text"] == srv.engine.tokenizer.decode(hf_greedy(tiny_llama, [PROMPT], 6)[0])


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/completions", {"stream": True}, "stream"),
    ("/v1/completions", {"temperature": 0.7}, "temperature"),
    ("/v1/chat/completions", {"temperature": 1.0}, "temperature"),
    ("/v1/completions", {"logprobs": 2}, "logprobs"),
    ("/v1/completions", {"logprobs": 0}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2}, "logprobs"),
    ("/v1/completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/completions", {"top_p": 0.5}, "top_p"),
    ("/v1/chat/completions", {"top_k": 5}, "top_k"),
    ("/v1/completions", {"repetition_penalty": 1.2}, "repetition_penalty"),
    ("/v1/completions", {"stop": ["x"]}, "stop"),
    ("/v1/completions", {"stop_token_ids": [5]}, "stop_token_ids"),
    ("/v1/completions", {"min_tokens": 2}, "min_tokens"),
    ("/v1/completions", {"n": 11}, "n"),
])
def test_what_beam_search_cannot_honour_is_a_400_naming_it(srv, path, extra, param):
    base = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = post(srv, path, **{**base, "max_tokens": 3, "use_beam_search": True, "n": 2, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"]


def test_neutral_values_are_accepted(srv):
    r = post(srv, "/v1/completions", prompt=PROMPT, max_tokens=2, use_beam_search=True, n=2, temperature=0,
             top_p=1.0, top_k=-1, stop=[], seed=3)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


def test_length_penalty_and_eos_over_http(tmp_path, hf, tiny_llama):
    """EOS is made the second token the greedy path takes, so a short beam finishes; length_penalty 0
    and 3 then rank it differently (checked on the reference first). Chat gets the same prompt through
    a template that renders the message as it is."""
    text = "Hello world, this is"
    prompt = hf_tokenizer(tiny_llama).encode(text)
    eos = hf_greedy(tiny_llama, [prompt], 2)[0][1]
    folder = build_tiny_model(tmp_path / "eos", "llama", eos_token_id=eos)
    by_penalty = {lp: hf_beam_search(hf, prompt, 3, 4, eos=eos, length_penalty=lp) for lp in (0.0, 3.0)}
    assert [b[0] for b in by_penalty[0.0]] != [b[0] for b in by_penalty[3.0]]  # the case exercises the penalty
    chat = {"messages": [{"role": "user", "content": text}], "chat_template": "{{ messages[0]['content'] }}"}
    with serving(make_engine(folder)) as srv:
        for lp, want in by_penalty.items():
            r = post(srv, "/v1/completions", prompt=text, n=3, max_tokens=4, use_beam_search=True, length_penalty=lp)
            choices = r.json()["choices"]
            assert [c["text"] for c in choices] == texts(srv, want, prompt)
            assert [c["finish_reason"] for c in choices] == [w[2] for w in want]
            assert [c["stop_reason"] for c in choices] == [eos if w[2] == "stop" else None for w in want]
            r = post(srv, "/v1/chat/completions", **chat, n=3, max_tokens=4, use_beam_search=True, length_penalty=lp)
            assert [c["message"]["content"] for c in r.json()["choices"]] == texts(srv, want, prompt)
        kept = post(srv, "/v1/completions", prompt=text, n=3, max_tokens=4, use_beam_search=True, length_penalty=0.0,
                    include_stop_str_in_output=True).json()
        stops = sum(w[2] == "stop" for w in by_penalty[0.0])
        generated = sum(len(w[0]) - len(prompt) for w in by_penalty[0.0])
        assert kept["usage"]["completion_tokens"] == generated + stops  # the EOS counts, the text hides it
        assert [c["text"] for c in kept["choices"]] == texts(srv, by_penalty[0.0], prompt)
        ignoring = post(srv, "/v1/completions", prompt=text, n=3, max_tokens=4, use_beam_search=True,
                        ignore_eos=True).json()
        assert {c["finish_reason"] for c in ignoring["choices"]} == {"length"}


def test_a_width_beyond_the_limit_names_n_and_says_the_limit(srv):
    """The engine's beam_width refusal, worded for the request's own field `n` (MAX_BEAM_WIDTH 10:
    each round asks for twice the width in logprobs, and 20 is the most a request may ask)."""
    r = post(srv, "/v1/completions", prompt=PROMPT, max_tokens=3, use_beam_search=True, n=11)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == ("n (with use_beam_search): must be an integer in [1, 10] (each round asks "
                                            "for 2 x beam_width logprobs, at most 20), got 11")


@pytest.mark.parametrize("path, prefix", [("/v1/completions", "cmpl-"), ("/v1/chat/completions", "chatcmpl-")])
def test_a_beam_search_response_takes_the_request_id(srv, path, prefix):
    base = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = post(srv, path, **base, max_tokens=2, use_beam_search=True, n=2, request_id="beams-7")
    assert r.status_code == 200 and r.json()["id"] == prefix + "beams-7", r.text
