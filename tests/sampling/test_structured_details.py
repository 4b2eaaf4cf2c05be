"""Structured output's details that whole-schema runs do not pin down (issue 27, the sampling/
mutation survivors): every validation message in full, the whitespace rules of JSON constraints (any
whitespace up to 24 characters, none when disabled, the server default), json_object, a structural
tag without triggers, the compile cache's size and timing, the bitmask rows of finished sequences,
and the tokenizer facts the manager hands xgrammar (stop tokens, a vocabulary wider than the
tokenizer). Expected values are written out by hand."""
from __future__ import annotations

import logging
import re

import pytest
import xgrammar as xgr

from helpers import _tokenizer
from heterollm.sampling import SamplingParams, SamplingParamsError, StructuredOutputError, StructuredOutputsParams
from heterollm.sampling.structured import GrammarState, StructuredOutputManager, compiler_reason

KINDS = "json, regex, choice, grammar, json_object, structural_tag"


@pytest.mark.parametrize("kwargs, message", [
    ({}, f"structured_outputs: give exactly one of {KINDS}; none is given"),
    ({"regex": "a", "grammar": "root ::= \"a\""}, f"structured_outputs: give exactly one of {KINDS}; regex, grammar are given"),
    ({"json": "[1]"}, "structured_outputs.json: a JSON schema must be an object"),
    ({"choice": ["a", 3]}, "structured_outputs.choice: must be a non-empty list of non-empty strings"),
    ({"json_object": 1}, "structured_outputs.json_object: must be true when given"),
    ({"regex": ""}, "structured_outputs.regex: must be a non-empty string"),
    ({"structural_tag": "[1]"}, "structured_outputs.structural_tag: must be a JSON object"),
    ({"regex": "a", "disable_any_whitespace": "yes"}, "structured_outputs.disable_any_whitespace: must be a boolean"),
])
def test_every_constraint_error_in_full(kwargs, message):
    with pytest.raises(StructuredOutputError) as info:
        StructuredOutputsParams(**kwargs)
    assert str(info.value) == message
    field, _, reason = message.partition(": ")
    assert info.value.field == field and info.value.reason == reason


def test_a_structural_tag_may_come_as_a_json_string():
    spec = StructuredOutputsParams(structural_tag='{"structures": [], "triggers": ["<x>"]}')
    assert spec.structural_tag == {"structures": [], "triggers": ["<x>"]}
    with pytest.raises(StructuredOutputError) as info:
        StructuredOutputsParams(structural_tag='{"structures": ')
    assert info.value.field == "structured_outputs.structural_tag"
    assert str(info.value).startswith("structured_outputs.structural_tag: not valid JSON: Expecting value: line 1")


def test_sampling_params_name_a_wrong_structured_outputs_in_full():
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(structured_outputs={"regexp": "a"})
    assert str(info.value) == ("structured_outputs.regexp: is not a structured output field (known: choice, "
                               "disable_any_whitespace, grammar, json, json_object, regex, structural_tag)")
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(structured_outputs="a")
    assert str(info.value) == "structured_outputs: must be a StructuredOutputsParams or a dict of its fields"
    given = StructuredOutputsParams(regex="a+")
    assert SamplingParams(structured_outputs=given).structured_outputs is given


def test_bad_words_default_to_an_empty_list_and_a_bias_must_be_a_real_number():
    assert SamplingParams(bad_words=None).bad_words == []
    for value in (True, "1", float("nan")):
        with pytest.raises(SamplingParamsError) as info:
            SamplingParams(logit_bias={1: value})
        assert info.value.field == "logit_bias"
    assert SamplingParams(logit_bias={1: 2, 3: -0.5}).logit_bias == {1: 2, 3: -0.5}


def test_an_error_renamed_for_another_field_keeps_its_reason():
    exc = StructuredOutputError("guided_regex", "parenthesis is not closed")
    renamed = exc.named("response_format")
    assert (renamed.field, renamed.reason, str(renamed)) == (
        "response_format", "parenthesis is not closed", "response_format: parenthesis is not closed")
    from concurrent.futures import Future
    future: Future = Future()
    future.set_exception(exc)
    spec = StructuredOutputsParams(regex="a(b", origin="guided_regex")
    with pytest.raises(StructuredOutputError) as info:
        GrammarState(future, StructuredOutputsParams(regex="a(b")).result()
    assert str(info.value) == "structured_outputs.regex: parenthesis is not closed"
    assert spec.field_name == "guided_regex"


def test_compiler_reason_joins_the_lines_and_falls_back_to_the_type():
    assert compiler_reason(RuntimeError("first\n\n  second  \n")) == "first second"
    assert compiler_reason(RuntimeError()) == "RuntimeError"
    assert compiler_reason(ValueError("")) == "ValueError"


# -- the compiled grammars ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


@pytest.fixture(scope="module")
def manager(tok):
    m = StructuredOutputManager(tok, len(tok), [tok.eos_token_id])  # the defaults, as the engine builds it
    yield m
    m.shutdown()


def accepts(grammar, text: str) -> bool:
    m = xgr.GrammarMatcher(grammar)
    return m.accept_string(text) and m.is_completed()


def test_json_whitespace_is_free_up_to_24_characters(manager):
    grammar = manager.compile(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}},
                                                            "required": ["a"]})).result()
    assert accepts(grammar, '{"a":1}') and accepts(grammar, '{ "a" : 1 }') and accepts(grammar, '{\n  "a": 1\n}')
    assert accepts(grammar, "{" + " " * 24 + '"a":1}')
    assert not accepts(grammar, "{" + " " * 25 + '"a":1}')  # a model cannot loop on whitespace forever


def test_disabled_whitespace_allows_none(manager, tok):
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}},
                                         "required": ["a"]}, disable_any_whitespace=True)
    grammar = manager.compile(spec).result()
    # exactly json.dumps' layout: ": " and ", ", nothing else
    assert accepts(grammar, '{"a": 1}')
    for text in ('{"a":1}', '{ "a": 1}', '{"a":  1}', '{"a": 1 }', '{\n"a": 1}'):
        assert not accepts(grammar, text), text
    # the server-wide flag turns it off for every request; a request cannot turn it back on
    compact = StructuredOutputManager(tok, len(tok), [tok.eos_token_id], disable_any_whitespace=True)
    try:
        spec = StructuredOutputsParams(json_object=True)
        assert not accepts(compact.compile(spec).result(), '{ }') and spec.disable_any_whitespace
    finally:
        compact.shutdown()
    plain = StructuredOutputsParams(json_object=True)
    manager.compile(plain).result()
    assert plain.disable_any_whitespace is False  # the default manager leaves a request as it came


def test_json_object_is_any_object_and_only_an_object(tok):
    fresh = StructuredOutputManager(tok, len(tok), [tok.eos_token_id])  # compiled here, not taken from a cache
    try:
        grammar = fresh.compile(StructuredOutputsParams(json_object=True)).result()
    finally:
        fresh.shutdown()
    for text in ('{}', '{"a": [1, {"b": null}]}', '{ "x" : "y" }'):
        assert accepts(grammar, text), text
    for text in ('[1]', '5', '"s"', "{" + " " * 25 + "}"):
        assert not accepts(grammar, text), text


def test_a_structural_tag_without_triggers_is_the_compilers_error(manager):
    # vLLM's older form with no "triggers": none are passed, and xgrammar says why it cannot compile
    tag = {"structures": [{"begin": "<n>", "schema": {"type": "integer"}, "end": "</n>"}]}
    exc = manager.compile(StructuredOutputsParams(structural_tag=tag)).exception()
    assert isinstance(exc, StructuredOutputError) and exc.field == "structured_outputs.structural_tag"
    assert exc.reason.endswith("Invalid structural tag error: Triggered tags format's triggers must be non-empty")


def test_the_cache_holds_exactly_its_size_and_times_each_compile(tok, caplog):
    small = StructuredOutputManager(tok, len(tok), [tok.eos_token_id], cache_size=2)
    try:
        a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
        first = small.compile(a)
        first.result()
        small.compile(b).result()
        assert small.compile(StructuredOutputsParams(regex="a+")) is first  # two fit: a is still there
        with caplog.at_level(logging.DEBUG, logger="heterollm.structured"):
            small.compile(c).result()  # a was used last, so b goes
        assert set(small.compile_seconds) == {a.key, c.key}  # evicted entries lose their timing too
        assert small.compile(a) is first
        assert 0 < small.compile_seconds[c.key] < 10
        line = next(r.getMessage() for r in caplog.records if r.name == "heterollm.structured")
        shown = re.fullmatch(r"compiled a regex constraint in ([0-9.]+) ms", line)
        assert shown and float(shown.group(1)) == pytest.approx(small.compile_seconds[c.key] * 1000, abs=0.051)
    finally:
        small.shutdown()


def test_state_builds_on_the_cached_compile(manager):
    spec = StructuredOutputsParams(choice=["yes", "no"])
    state = manager.state(spec)
    assert isinstance(state, GrammarState) and state.spec is spec and state.future is manager.compile(spec)
    assert state.result() is manager.compile(spec).result()


def allowed(bitmask, row: int, vocab: int) -> set[int]:
    return {i for i in range(vocab) if (int(bitmask[row, i // 32]) >> (i % 32)) & 1}


def test_a_finished_sequence_row_allows_everything_and_live_rows_keep_their_place(manager, tok):
    done = manager.state(StructuredOutputsParams(choice=["yes"]))
    for t in tok.encode("yes", add_special_tokens=False) + [tok.eos_token_id]:
        assert done.accept(t)
    assert done.terminated
    live = manager.state(StructuredOutputsParams(choice=["no"]))
    bitmask = manager.fill_bitmask([done, live])
    assert (bitmask[0] == -1).all()
    assert allowed(bitmask, 1, len(tok)) == {i for i in range(len(tok))
                                             if tok.decode([i]) and "no".startswith(tok.decode([i]))}


def test_the_managers_stop_tokens_end_the_grammar_and_padding_tokens_stay_forbidden(tok):
    stop = 7  # a stop token of the launch's own (generation_config), not the tokenizer's EOS
    wide = len(tok) + 64  # the model's vocabulary, padded past the tokenizer
    m = StructuredOutputManager(tok, wide, [stop])
    try:
        state = m.state(StructuredOutputsParams(choice=["yes"]))
        for t in tok.encode("yes", add_special_tokens=False):
            assert state.accept(t)
        bitmask = m.fill_bitmask([state])
        assert bitmask.shape == (1, -(-wide // 32))
        assert allowed(bitmask, 0, wide) == {stop}  # the end of the choice: only the launch's stop token
        fresh = m.fill_bitmask([m.state(StructuredOutputsParams(choice=["yes"]))])
        assert not allowed(fresh, 0, wide) & set(range(len(tok), wide))  # no padding token, ever
    finally:
        m.shutdown()
