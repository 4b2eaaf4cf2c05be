"""Structured output over HTTP, in every spelling: OpenAI's response_format through the official
client, vLLM's structured_outputs and guided_* through extra_body; streamed text equal to the
whole answer for the same seed; each malformed constraint a 400 naming its field while the
engine keeps serving the others; and a server without a backend refusing with the flag named."""
from __future__ import annotations

import asyncio
import json
import math
import re

import httpx
import jsonschema
import pytest

from conftest import MODEL, make_engine, serving

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 99999}},
          "required": ["city", "population"], "additionalProperties": False}


@pytest.fixture(scope="module")
def srv(tiny_llama):
    with serving(make_engine(tiny_llama, guided_decoding_backend="auto",
                             guided_decoding_disable_any_whitespace=True)) as running:
        yield running


@pytest.fixture(scope="module")
def client(srv):
    from openai import OpenAI
    return OpenAI(base_url=f"{srv.url}/v1", api_key="EMPTY", max_retries=0)


ROUTES = {"completions": "completions", "chat": "chat/completions"}


def post(srv, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/{ROUTES[route]}", json={"model": MODEL, **body}, timeout=120)


def test_openai_client_response_format_json_schema(client):
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=80, temperature=0.7, seed=4, n=3,
        messages=[{"role": "user", "content": "A city as JSON"}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
    for choice in chat.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_openai_client_extra_body_spellings(client):
    choice = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=10, temperature=1.0, seed=1, n=4,
                                       extra_body={"guided_choice": ["left", "right"]})
    assert {c.text for c in choice.choices} <= {"left", "right"}
    regex = client.completions.create(model=MODEL, prompt="Code:", max_tokens=12, temperature=1.0, seed=2,
                                      extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", regex.choices[0].text)
    grammar = client.chat.completions.create(
        model=MODEL, max_tokens=20, temperature=1.0, seed=3, messages=[{"role": "user", "content": "x"}],
        extra_body={"structured_outputs": {"grammar": 'root ::= "(" [a-z] ("," [a-z])? ")"'}})
    assert re.fullmatch(r"\([a-z](,[a-z])?\)", grammar.choices[0].message.content)
    obj = client.chat.completions.create(model=MODEL, max_tokens=40, temperature=0, messages=[
        {"role": "user", "content": "x"}], extra_body={"guided_json": json.dumps(SCHEMA)})
    jsonschema.validate(json.loads(obj.choices[0].message.content), SCHEMA)
    older = client.completions.create(model=MODEL, prompt="(", max_tokens=20, temperature=1.0, seed=4,
                                      extra_body={"guided_grammar": 'root ::= [a-z] ("," [a-z])* ")"',
                                                  "guided_decoding_backend": "xgrammar"})
    assert re.fullmatch(r"[a-z](,[a-z])*\)", older.choices[0].text)
    anything = client.completions.create(model=MODEL, prompt="{", max_tokens=40, temperature=0,
                                         extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                             "name": "c", "schema": SCHEMA}}})
    jsonschema.validate(json.loads(anything.choices[0].text), SCHEMA)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_streamed_text_equals_the_whole_answer(srv, route):
    body = {"max_tokens": 60, "temperature": 0.9, "seed": 11, "n": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}}
    body.update({"prompt": "JSON:"} if route == "completions" else {"messages": [{"role": "user", "content": "JSON"}]})
    whole = post(srv, route, body).json()["choices"]
    texts = ["", ""]
    with httpx.stream("POST", f"{srv.url}/v1/{ROUTES[route]}", json={"model": MODEL, **body, "stream": True},
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] += c.get("text") or (c.get("delta") or {}).get("content") or ""
    expected = [c["text"] if route == "completions" else c["message"]["content"] for c in whole]
    assert texts == expected
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_logprobs_are_the_constrained_distribution(srv):
    """With at most 5 tokens allowed per step, top_logprobs=5 lists every allowed token: each is a
    continuation of a choice (or the stop token once one is complete), and their probabilities sum to 1."""
    choices = ["yes", "no"]
    r = post(srv, "completions", {"prompt": "Yes or no?", "max_tokens": 4, "temperature": 0, "logprobs": 5,
                                  "structured_outputs": {"choice": choices}}).json()
    choice = r["choices"][0]
    assert choice["text"] in choices
    prefix = ""
    for token, top in zip(choice["logprobs"]["tokens"], choice["logprobs"]["top_logprobs"]):
        for alt in top:
            assert any(c.startswith(prefix + alt) for c in choices) or (prefix in choices and alt == "<|im_end|>"), alt
        assert sum(math.exp(v) for v in top.values()) == pytest.approx(1.0, abs=1e-4)
        prefix += token if token != "<|im_end|>" else ""
    assert prefix == choice["text"]


BAD = [
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "parenthesis"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar", "EBNF"),
    ({"structured_outputs": {"json": {"type": "objec"}}}, "structured_outputs.json", "objec"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs.pattern", "not a field"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "xgrammar"),
    ({"guided_json": "{\"type\": "}, "guided_json", "not valid JSON"),
    ({"guided_regex": "[z-a]"}, "guided_regex", "character class"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "only one"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "xgrammar"),
    ({"guided_whitespace_pattern": " ", "guided_json": {}}, "guided_whitespace_pattern", "xgrammar"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format", "objec"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "only one"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict", "strict must be a boolean"),
    ({"structured_outputs": {"regex": "a", "disable_additional_properties": True}},
     "structured_outputs.disable_additional_properties", "\"additionalProperties\": false"),
]


@pytest.mark.parametrize("extra, field, words", BAD, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD)])
def test_a_malformed_constraint_is_a_400_naming_its_field(srv, extra, field, words):
    r = post(srv, "chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and words in err["message"], err


def test_bad_constraints_do_not_disturb_the_batch(srv):
    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            good = c.post(f"{srv.url}/v1/completions", json={
                "model": MODEL, "prompt": "go", "max_tokens": 24, "temperature": 0, "ignore_eos": True})
            constrained = c.post(f"{srv.url}/v1/completions", json={
                "model": MODEL, "prompt": "go", "max_tokens": 8, "temperature": 0, "guided_regex": "[0-9]{4}"})
            bad = [c.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "go", **extra})
                   for extra, _, _ in BAD[:6]]
            return await asyncio.gather(good, constrained, *bad)
    good, constrained, *bad = asyncio.run(run())
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 24
    assert re.fullmatch("[0-9]{4}", constrained.json()["choices"][0]["text"])
    assert all(r.status_code == 400 for r in bad)
    assert post(srv, "completions", {"prompt": "again", "max_tokens": 3}).status_code == 200


def test_a_server_without_a_backend_names_the_flag(tiny_llama):
    with serving(make_engine(tiny_llama)) as plain:  # --guided_decoding_backend off, the flag table's default
        r = post(plain, "completions", {"prompt": "x", "guided_regex": "a"})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "guided_regex" and "--guided_decoding_backend" in err["message"]
        assert post(plain, "chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                    "response_format": {"type": "text"}}).status_code == 200
