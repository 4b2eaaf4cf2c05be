"""Structured output's parts, on hand-derived cases: the packed bitmask the sampler applies, the
constrained logprobs, the constraint's validation, and the compiler cache (sampling/structured.py)."""
from __future__ import annotations

import math
from concurrent.futures import Future

import pytest
import torch

from helpers import _tokenizer
from heterollm.sampling import SamplingParams, StructuredOutputError, StructuredOutputsParams
from heterollm.sampling.sampler import Sampler, SamplingRow, apply_token_bitmask
from heterollm.sampling.structured import GrammarState, StructuredOutputManager, choice_grammar, compiler_reason


def pack(allowed: set[int], words: int) -> torch.Tensor:
    """The xgrammar packing, written out: bit j of word w allows token 32w + j."""
    row = [0] * words
    for t in allowed:
        row[t // 32] |= 1 << (t % 32)
    return torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in row]], dtype=torch.int32)


def test_bitmask_allows_exactly_the_set_bits():
    logits = torch.arange(70, dtype=torch.float32).unsqueeze(0)
    allowed = {0, 31, 32, 63, 69}  # word edges, the sign bit (31, 63) and the last token
    out = apply_token_bitmask(logits, pack(allowed, 3))
    assert {i for i in range(70) if math.isfinite(out[0, i])} == allowed
    assert all(out[0, i] == i for i in allowed)


def test_bitmask_row_of_ones_allows_all_and_a_short_mask_forbids_the_rest():
    logits = torch.zeros(2, 70)
    bitmask = torch.cat([torch.full((1, 2), -1, dtype=torch.int32), pack({5}, 2)])  # 64 bits for 70 tokens
    out = apply_token_bitmask(logits, bitmask)
    assert torch.isfinite(out[0, :64]).all() and torch.isinf(out[0, 64:]).all()
    assert [i for i in range(70) if math.isfinite(out[1, i])] == [5]


def test_sampler_greedy_and_logprobs_follow_the_constrained_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]])
    rows = [SamplingRow(SamplingParams(temperature=0, logprobs=1), None, [1], []) for _ in range(2)]
    bitmask = torch.cat([pack({0, 2}, 1), torch.full((1, 1), -1, dtype=torch.int32)])
    tokens, lps = Sampler()(logits, rows, bitmask)
    assert tokens == [2, 3]  # the grammar's best token; an unconstrained row keeps its argmax
    assert lps[0].logprob == pytest.approx(2 - math.log(math.exp(0) + math.exp(2)), abs=1e-6)
    assert lps[0].top == [(2, pytest.approx(lps[0].logprob))] and lps[0].rank == 1
    assert lps[1].logprob == pytest.approx(3 - math.log(sum(math.exp(v) for v in range(4))), abs=1e-6)


def test_sampled_rows_never_leave_the_mask():
    logits = torch.zeros(1, 64)
    allowed = {3, 40, 41}
    gen = torch.Generator().manual_seed(0)
    row = SamplingRow(SamplingParams(temperature=1.0, seed=0), gen, [1], [])
    seen = {Sampler()(logits, [row], pack(allowed, 2))[0][0] for _ in range(200)}
    assert seen == allowed


@pytest.mark.parametrize("kwargs, field, words", [
    ({}, "structured_outputs", "none is given"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs", "regex, choice are given"),
    ({"json": '{"type": '}, "structured_outputs.json", "not valid JSON"),
    ({"json": "[1]"}, "structured_outputs.json", "must be an object"),
    ({"choice": []}, "structured_outputs.choice", "non-empty list"),
    ({"choice": ["a", ""]}, "structured_outputs.choice", "non-empty strings"),
    ({"json_object": False}, "structured_outputs.json_object", "must be true"),
    ({"grammar": ""}, "structured_outputs.grammar", "non-empty string"),
    ({"structural_tag": "[]"}, "structured_outputs.structural_tag", "JSON object"),
])
def test_malformed_constraints_name_their_field(kwargs, field, words):
    with pytest.raises(StructuredOutputError) as info:
        StructuredOutputsParams(**kwargs)
    assert info.value.field == field and words in str(info.value)


def test_the_origin_is_the_field_named():
    with pytest.raises(StructuredOutputError) as info:
        StructuredOutputsParams(json="{", origin="guided_json")
    assert info.value.field == "guided_json"


def test_sampling_params_take_a_dict_and_refuse_unknown_keys():
    p = SamplingParams(structured_outputs={"regex": "[ab]+"})
    assert isinstance(p.structured_outputs, StructuredOutputsParams) and p.structured_outputs.kind == "regex"
    with pytest.raises(ValueError, match="structured_outputs.regexp"):
        SamplingParams(structured_outputs={"regexp": "a"})


def test_the_cache_key_ignores_key_order_and_the_origin():
    a = StructuredOutputsParams(json={"type": "object", "required": ["x"]}, origin="guided_json")
    b = StructuredOutputsParams(json='{"required": ["x"], "type": "object"}')
    assert a.key == b.key
    assert a.key != StructuredOutputsParams(json=b.json, disable_any_whitespace=True).key


def test_compiler_reason_drops_the_cpp_location():
    exc = RuntimeError("[22:49:56] /project/cpp/regex_converter.cc:94: Regex parsing error at position 4: x\n")
    assert compiler_reason(exc) == "Regex parsing error at position 4: x"


@pytest.fixture(scope="module")
def manager():
    tok = _tokenizer()
    m = StructuredOutputManager(tok, len(tok), [tok.eos_token_id], cache_size=3)
    yield m
    m.shutdown()


def test_choice_grammar_accepts_exactly_the_choices(manager):
    choices = ['say "hi"', "back\\slash", "café", "a|b"]
    grammar = manager.compile(StructuredOutputsParams(choice=choices)).result()
    import xgrammar as xgr
    for text in choices + ["say hi", "a", "a|bc"]:
        m = xgr.GrammarMatcher(grammar)
        ok = m.accept_string(text) and m.is_completed()
        assert ok == (text in choices), text
    assert choice_grammar(["a\"b"]) == 'root ::= "a\\"b"'


def test_compiles_are_cached_by_key_and_evicted_least_recent_first(manager):
    specs = [StructuredOutputsParams(regex=f"[a-{c}]+") for c in "bcde"]
    first = manager.compile(specs[0])
    assert manager.compile(StructuredOutputsParams(regex="[a-b]+")) is first
    first.result()
    assert manager.compile_seconds[specs[0].key] > 0
    for s in specs[1:]:
        manager.compile(s).result()
    assert manager.compile(specs[0]) is not first  # the cache holds 3: the first one was evicted


@pytest.mark.parametrize("spec, field, words", [
    (StructuredOutputsParams(regex="a(b"), "structured_outputs.regex", "parenthesis is not closed"),
    (StructuredOutputsParams(grammar='root ::= "a" |', origin="guided_grammar"), "guided_grammar", "EBNF parser"),
    (StructuredOutputsParams(json={"type": "objec"}, origin="response_format"), "response_format", "objec"),
])
def test_a_compile_error_names_the_field_with_the_compilers_reason(manager, spec, field, words):
    exc = manager.compile(spec).exception()
    assert isinstance(exc, StructuredOutputError) and exc.field == field and words in str(exc)
    state = GrammarState(manager.compile(spec), spec)
    assert not state.ready and state.error.field == field


def test_grammar_state_waits_for_its_future_and_follows_tokens(manager):
    tok = _tokenizer()
    future: Future = Future()
    state = GrammarState(future, StructuredOutputsParams(choice=["yes", "no"]))
    assert not state.ready and state.error is None
    future.set_result(manager.compile(StructuredOutputsParams(choice=["yes", "no"])).result())
    assert state.ready
    bitmask = manager.fill_bitmask([state])
    first = {i for i in range(len(tok)) if (int(bitmask[0, i // 32]) >> (i % 32)) & 1}
    assert first == {i for i in range(len(tok)) if tok.decode([i]) and ("yes".startswith(tok.decode([i]))
                                                                       or "no".startswith(tok.decode([i])))}
    for t in tok.encode("yes", add_special_tokens=False):
        assert state.accept(t)
    assert not state.terminated and state.accept(tok.eos_token_id) and state.terminated
    assert not state.accept(tok.encode("no", add_special_tokens=False)[0])


def test_the_servers_whitespace_flag_is_the_default(manager):
    tok = _tokenizer()
    compact = StructuredOutputManager(tok, len(tok), [tok.eos_token_id], disable_any_whitespace=True)
    spec = StructuredOutputsParams(json={"type": "object"})
    compact.compile(spec).result()
    assert spec.disable_any_whitespace
    compact.shutdown()


@pytest.mark.parametrize("tag", [
    {"structures": [{"begin": "<num>", "schema": {"type": "integer"}, "end": "</num>"}], "triggers": ["<num>"]},
    {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<num>"], "tags": [
        {"type": "tag", "begin": "<num>", "content": {"type": "json_schema", "json_schema": {"type": "integer"}},
         "end": "</num>"}]}},
], ids=["vllm-structures", "xgrammar-format"])
def test_a_structural_tag_constrains_only_what_follows_its_trigger(manager, tag):
    import xgrammar as xgr
    grammar = manager.compile(StructuredOutputsParams(structural_tag=tag)).result()
    for text, ok in [("free text <num>12</num> more", True), ("no trigger at all", True), ("x <num>twelve", False)]:
        assert xgr.GrammarMatcher(grammar).accept_string(text) == ok, text


def test_length_bounded_strings_become_patterns_everywhere_but_in_data():
    from heterollm.sampling.structured import bounded_strings_as_patterns
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "maxLength": 5},
            "b": {"type": "string", "minLength": 2},
            "c": {"type": "string", "minLength": 1, "maxLength": 3, "pattern": "^[a-z]+$"},
            "d": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 4}},
            "e": {"anyOf": [{"type": "string", "maxLength": 2}, {"type": "integer", "maxLength": 9}]},
            "f": {"enum": [{"type": "string", "maxLength": 1}], "default": {"type": "string", "maxLength": 1}},
            "g": {"const": {"type": "string", "minLength": 3}, "examples": [{"type": "string", "maxLength": 1}]},
        },
        "$defs": {"name": {"type": "string", "minLength": 3, "maxLength": 7}},
    }
    out = bounded_strings_as_patterns(schema)
    props = out["properties"]
    assert props["a"] == {"type": "string", "pattern": "^.{0,5}$"}
    assert props["b"] == {"type": "string", "pattern": "^.{2,}$"}
    assert props["c"] == schema["properties"]["c"]  # a pattern of its own: left as it is
    assert props["d"]["items"] == {"type": "string", "pattern": "^.{1,4}$"}
    assert props["e"]["anyOf"] == [{"type": "string", "pattern": "^.{0,2}$"}, {"type": "integer", "maxLength": 9}]
    assert props["f"] == schema["properties"]["f"] and props["g"] == schema["properties"]["g"]  # data, not schema
    assert out["$defs"]["name"] == {"type": "string", "pattern": "^.{3,7}$"}
    assert schema["properties"]["a"] == {"type": "string", "maxLength": 5}  # the caller's schema is not changed
    assert bounded_strings_as_patterns([{"type": "string", "maxLength": 1}, 3]) == [
        {"type": "string", "pattern": "^.{0,1}$"}, 3]
    import re
    for pattern, ok, bad in [("^.{0,5}$", "abcde", "abcdef"), ("^.{2,}$", "ab", "a"), ("^.{3,7}$", "abc", "ab")]:
        assert re.fullmatch(pattern, ok) and not re.fullmatch(pattern, bad)
