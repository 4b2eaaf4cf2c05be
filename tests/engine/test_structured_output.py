"""Structured output through the offline API on a tiny random llama: JSON schemas (validated with
jsonschema), regexes, choices and an EBNF grammar (checked with Python's `re`, not with xgrammar);
logprobs of the constrained distribution against transformers; the request that waits for its
grammar; and the same constrained tokens under chunked prefill, prefix caching, preemption and
schedule overlap."""
from __future__ import annotations

import json
import re
from concurrent.futures import Future

import jsonschema
import pytest
import torch

from helpers import ADMIT_ALL, build_tiny_model, hf_logprobs
from json_schemas import SCHEMAS
from heterollm import LLM, SamplingParams
from heterollm.scheduler.request import RequestRejected

FLAGS = dict(dtype="float32", block_size=8, num_gpu_blocks_override=400, max_model_len=320,
             guided_decoding_backend="auto", guided_decoding_disable_any_whitespace=True)



@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("structured"), "llama")


@pytest.fixture(scope="module")
def llm(tiny):
    engine = LLM(str(tiny), **FLAGS)
    yield engine
    engine.shutdown()


def test_twenty_json_schemas_validate(llm):
    assert len(SCHEMAS) == 20
    params = [SamplingParams(max_tokens=160, temperature=0.8, seed=i, structured_outputs={"json": s})
              for i, s in enumerate(SCHEMAS)]
    outs = llm.generate(["Answer in JSON:"] * len(SCHEMAS), params)
    for schema, out in zip(SCHEMAS, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)


@pytest.mark.parametrize("regex", [r"[0-9]{3}-[a-z]{2}", r"(yes|no), because [a-z]{1,8}\.", r"\d+(\.\d{1,2})?",
                                   r"[A-Z][a-z]{2,5}( [A-Z][a-z]{2,5}){0,2}"])
def test_regex_outputs_fullmatch(llm, regex):
    out = llm.generate("Text:", SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=3,
                                               structured_outputs={"regex": regex}))[0]
    for c in out.outputs:
        assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c.text


def test_choice_outputs_are_in_the_list(llm):
    choices = ["positive", "negative", "it's \"complicated\""]
    out = llm.generate("Sentiment:", SamplingParams(max_tokens=20, temperature=1.5, seed=1, n=8,
                                                    structured_outputs={"choice": choices}))[0]
    assert all(c.text in choices and c.finish_reason == "stop" for c in out.outputs)


def test_an_ebnf_grammar_output_parses(llm):
    grammar = '''root ::= item ("," item)*
item ::= word | "(" [0-9] ")"
word ::= [a-c] [a-c]? [a-c]?'''
    language = r"([a-c]{1,3}|\([0-9]\))(,([a-c]{1,3}|\([0-9]\)))*"  # the same language, written as a regex
    out = llm.generate("List:", SamplingParams(max_tokens=60, temperature=1.0, seed=5, n=4,
                                               structured_outputs={"grammar": grammar}))[0]
    for c in out.outputs:
        if c.finish_reason == "stop":
            assert re.fullmatch(language, c.text), c.text
        else:  # cut by max_tokens: still a prefix of a sentence
            assert re.fullmatch(r"[a-c(),0-9]*", c.text), c.text
    assert any(c.finish_reason == "stop" for c in out.outputs)


def test_json_object_is_an_object(llm):
    """A random model writes long keys (any string is allowed): an answer cut by max_tokens is still
    an object's beginning; one that stopped is a whole object (the real model: test_smollm2.py)."""
    out = llm.generate("JSON:", SamplingParams(max_tokens=60, temperature=1.0, seed=2, n=6,
                                               structured_outputs={"json_object": True}))[0]
    for c in out.outputs:
        assert c.text.startswith("{"), c.text
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)


def test_logprobs_are_those_of_the_constrained_distribution(llm, tiny):
    tok = llm.get_tokenizer()
    prompt = tok.encode("Is it?")
    choices = ["yes", "no"]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        max_tokens=5, temperature=0, logprobs=3, structured_outputs={"choice": choices}))[0].outputs[0]
    ref = hf_logprobs(tiny, prompt)[-1]
    allowed = [i for i in range(len(tok)) if tok.decode([i]) and any(c.startswith(tok.decode([i])) for c in choices)]
    constrained = ref[allowed].log_softmax(-1)
    best = int(torch.argmax(constrained))
    first = out.logprobs[0]
    assert first.token_id == allowed[best]
    assert first.logprob == pytest.approx(float(constrained[best]), abs=1e-4)
    assert {t for t, _ in first.top} <= set(allowed)


def test_off_refuses_with_the_flag_named(tiny):
    plain = LLM(str(tiny), **{**FLAGS, "guided_decoding_backend": "off"})
    with pytest.raises(RequestRejected, match="--guided_decoding_backend") as info:
        plain.generate("x", SamplingParams(structured_outputs={"regex": "a"}))
    assert info.value.field == "structured_outputs.regex"
    plain.shutdown()


def test_a_bad_constraint_admits_nothing(llm):
    good = SamplingParams(max_tokens=4, temperature=0)
    with pytest.raises(ValueError, match="structured_outputs.grammar: EBNF parser"):
        llm.generate(["a", "b"], [good, SamplingParams(structured_outputs={"grammar": "root ::= ("})])
    assert not llm.engine.has_unfinished()


def test_a_request_waits_for_its_grammar_and_others_go_on(llm, monkeypatch):
    engine = llm.engine
    real = engine.structured.compile(_regex("[ab]{4}"))
    real.result()
    pending: Future = Future()
    monkeypatch.setattr(engine.structured, "compile", lambda spec: pending)
    engine.add_request("x", SamplingParams(max_tokens=8, temperature=0, structured_outputs={"regex": "[ab]{4}"}),
                       request_id="grammar")
    engine.add_request("y", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), request_id="plain")
    done = {}
    for _ in range(10):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert "plain" in done and "grammar" not in done
    assert [r.request_id for r in engine.scheduler.deferred] == ["grammar"]
    pending.set_result(real.result())
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert re.fullmatch("[ab]{4}", done["grammar"].outputs[0].text)


def test_a_grammar_that_fails_after_admission_aborts_only_its_request(llm, monkeypatch):
    engine = llm.engine
    failing: Future = Future()
    monkeypatch.setattr(engine.structured, "compile", lambda spec: failing)
    engine.add_request("x", SamplingParams(max_tokens=8, structured_outputs={"regex": "[ab]"}), request_id="bad")
    engine.add_request("y", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), request_id="ok")
    failing.set_exception(RuntimeError("[1:2:3] /x.cc:1: boom"))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["bad"].outputs[0].finish_reason == "abort" and not done["bad"].outputs[0].token_ids
    assert len(done["ok"].outputs[0].token_ids) == 3


def _regex(pattern):
    from heterollm.sampling import StructuredOutputsParams
    return StructuredOutputsParams(regex=pattern)


def _workload():
    params, prompts = [], []
    for i, schema in enumerate(SCHEMAS[:8]):
        prompts.append({"prompt_token_ids": list(range(100 + i, 100 + i + 30 + 7 * i))})
        params.append(SamplingParams(max_tokens=60, temperature=0.9, seed=i, n=1 + i % 2,
                                     structured_outputs={"json": schema}))
    prompts.append({"prompt_token_ids": list(range(200, 250))})
    params.append(SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    return prompts, params


@pytest.mark.parametrize("extra", [
    {"max_tokens_per_chunk_for_prefill": 16, "enable_prefix_cache": True},
    {"num_gpu_blocks_override": 40, "max_tokens_per_chunk_for_prefill": 16, **ADMIT_ALL},  # preempts
    {"enable_schedule_overlap": True},
    {"enable_schedule_overlap": True, "num_gpu_blocks_override": 40, **ADMIT_ALL},
], ids=["chunked-prefix", "preempting", "overlap", "overlap-preempting"])
def test_the_same_constrained_tokens_under_every_scheduling(tiny, llm, extra):
    prompts, params = _workload()
    baseline = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
    other = LLM(str(tiny), **{**FLAGS, **extra})
    outs = other.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in outs] == baseline
    for out, p in zip(outs, params):
        for c in out.outputs:
            if p.structured_outputs is not None and c.finish_reason == "stop":
                jsonschema.validate(json.loads(c.text), p.structured_outputs.json)
    if extra.get("num_gpu_blocks_override") == 40:
        assert other.engine.scheduler.num_preemptions > 0
    other.shutdown()
