"""Every tool-call parser name against outputs written from its family's published format
(tool_fixtures.py): plain text, one call, parallel calls, nested JSON arguments, text before a
call, malformed output (it stays text, never an error); and each text streamed in every split
(character by character, and in two pieces at every boundary) adds up to the whole text's result."""
from __future__ import annotations

import json

import pytest

from heterollm.parsers import ChoiceParser, ParserRegistry
from tool_fixtures import BY_PARSER, TOOLS

CASES = [(name, case) for name, cases in BY_PARSER.items() for case in cases]


def parser_for(name: str) -> ChoiceParser:
    return ChoiceParser(tools_parser=ParserRegistry().tool_parser(name, "", ""), tools=TOOLS)


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def streamed(name: str, pieces: list[str]) -> tuple[str | None, list[tuple[str, dict]]]:
    """The deltas of a stream of these pieces, assembled as a client does."""
    p, text, content, calls = parser_for(name), "", "", []
    for i, piece in enumerate(pieces):
        text += piece
        d = p.update(text, i == len(pieces) - 1)
        assert not d.reasoning
        content += d.content
        calls += d.calls
    return content or None, calls_of(calls)


@pytest.mark.parametrize("name,case", CASES)
def test_whole_text(name, case):
    text, content, calls = BY_PARSER[name][case]
    parsed = parser_for(name).result(text)
    assert parsed.content == content
    assert calls_of(parsed.calls) == calls
    for call in parsed.calls:
        assert call.id and isinstance(call.arguments, str)


@pytest.mark.parametrize("name,case", CASES)
def test_every_streaming_split_adds_up(name, case):
    text, content, calls = BY_PARSER[name][case]
    assert streamed(name, list(text)) == (content, calls)
    for i in range(len(text) + 1):
        assert streamed(name, [text[:i], text[i:]]) == (content, calls), f"split at {i}: {text[:i]!r}"


def test_kimi_keeps_the_models_call_ids():
    from tool_fixtures import KIMI_K2
    parsed = parser_for("kimi_k2").result(KIMI_K2["parallel"][0])
    assert [c.id for c in parsed.calls] == ["functions.get_weather:0", "functions.get_weather:1"]


def test_schema_types_raw_values():
    """XML-like formats write values as text: the tool's schema types them; text that does not
    parse as its type stays text."""
    from heterollm.parsers.tool_formats import typed_value
    assert typed_value("3", {"type": "integer"}) == 3
    assert typed_value("3", {"type": "string"}) == "3"
    assert typed_value("three", {"type": "integer"}) == "three"
    assert typed_value("true", {"type": "boolean"}) is True
    assert typed_value('{"a": [1]}', {"type": "object"}) == {"a": [1]}
    assert typed_value("2.5", {"type": "number"}) == 2.5
    assert typed_value("Paris", {}) == "Paris"
    assert typed_value("[1]", {"type": "integer"}) == "[1]"


def test_parallel_tool_calls_false_keeps_the_first():
    from tool_fixtures import HERMES
    text = HERMES["parallel"][0]
    p = ChoiceParser(tools_parser=ParserRegistry().tool_parser("hermes", "", ""), tools=TOOLS, max_calls=1)
    assert [c.name for c in p.result(text).calls] == ["get_weather"]
    assert len(p.update(text, True).calls) == 1


def test_forced_formats_stream_and_keep_completed_calls():
    """tool_choice required's JSON array: each item is a call as soon as it closes; an answer cut off by
    max_tokens keeps the complete ones (the rest stays text). A named choice's object is its arguments."""
    from heterollm.entrypoints.openai.tools import NamedCallFormat, RequiredCallsFormat
    whole = '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}, ' \
            '{"name": "search", "parameters": {"query": "x]", "filters": {}}}]'
    cut = whole[:-20]
    for text, content, calls in ((whole, None, [PARIS_CALL, ("search", {"query": "x]", "filters": {}})]),
                                 (cut, cut[cut.index(", {\"name\": \"search\""):], [PARIS_CALL])):
        make = lambda: ChoiceParser(tools_parser=RequiredCallsFormat())
        parsed = make().result(text)
        assert (parsed.content, calls_of(parsed.calls)) == (content, calls)
        for i in range(len(text) + 1):
            p, got = make(), []
            got += p.update(text[:i], False).calls
            last = p.update(text, True)
            assert calls_of(got + last.calls) == calls
    named = ChoiceParser(tools_parser=NamedCallFormat("search")).result('{"query": "x", "filters": {"a": [1]}}')
    assert calls_of(named.calls) == [("search", {"query": "x", "filters": {"a": [1]}})] and named.content is None
    # the object may follow whitespace the grammar let through before it
    named = ChoiceParser(tools_parser=NamedCallFormat("search")).result(' \n{"query": "y"}')
    assert calls_of(named.calls) == [("search", {"query": "y"})] and named.content is None


def test_forced_tool_choices_constrain_to_compact_json_of_vllms_shape():
    """A named choice: the function's parameters object (a function without parameters: any object).
    "required": an array of {"name": one of the names, "parameters": its object}, one item unless
    parallel_tool_calls. Compact JSON either way, and errors name tool_choice."""
    from heterollm.entrypoints.openai.tools import forced_spec

    weather = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    bare = {"name": "ping"}
    named = forced_spec("get_weather", [bare, weather], parallel=True)
    assert named.json == weather["parameters"] and named.disable_any_whitespace and named.origin == "tool_choice"
    assert forced_spec("ping", [bare, weather], parallel=True).json == {"type": "object"}

    def item(name, params):
        return {"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                "required": ["name", "parameters"], "additionalProperties": False}

    required = forced_spec("required", [weather, bare], parallel=True)
    assert required.json == {"type": "array", "minItems": 1,
                             "items": {"anyOf": [item("get_weather", weather["parameters"]),
                                                 item("ping", {"type": "object"})]}}
    assert required.disable_any_whitespace and required.origin == "tool_choice"
    assert forced_spec("required", [weather], parallel=False).json["maxItems"] == 1


PARIS_CALL = ("get_weather", {"city": "Paris", "days": 3})
