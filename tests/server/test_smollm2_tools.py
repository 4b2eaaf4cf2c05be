"""tool_choice required / named on the real default model (SmolLM2-135M-Instruct) through the
server and the official openai client: every answer is a call whose arguments validate against
the tool's schema (jsonschema), streamed or not. The strings are bounded (maxLength), as a client
bounds them for a 135M model: forced to call add_book about the weather, it otherwise repeats
itself inside a title until max_tokens; and parallel_tool_calls is false, since under `required`
it otherwise repeats the same call until max_tokens (both are the model, not the grammar)."""
from __future__ import annotations

import json

import jsonschema
import pytest

from conftest import make_engine, serving

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
BOOK = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40}, "year": {"type": "integer"},
                                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}},
        "required": ["title", "year"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add_book", "description": "Add a book to the library",
                                           "parameters": BOOK}}]
SCHEMAS = {"get_weather": WEATHER, "add_book": BOOK}
QUESTIONS = ["What's the weather like in Paris today?", "Add 'Dune' by Frank Herbert (1965) to my library.",
             "Is it raining in Tokyo?"]


@pytest.fixture(scope="module")
def client():
    from openai import OpenAI
    engine = make_engine("smollm2", guided_decoding_backend="auto", max_model_len=1024)
    with serving(engine) as running:
        yield OpenAI(base_url=f"{running.url}/v1", api_key="EMPTY", max_retries=0)


@pytest.mark.slow  # 6-18 s each on the real model (and 10 s to start it); tiny models' tool calls: test_tools_api.py
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}},
                                         {"type": "function", "function": {"name": "add_book"}}])
def test_every_answer_is_a_valid_call(client, tool_choice):
    for question in QUESTIONS:
        args = {"model": "tiny-llama", "messages": [{"role": "user", "content": question}], "tools": TOOLS,
                "tool_choice": tool_choice, "max_tokens": 160, "temperature": 0, "parallel_tool_calls": False}
        whole = client.chat.completions.create(**args)
        streamed = [c for c in client.chat.completions.create(stream=True, **args) if c.choices]
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message.content
        got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
        for name, arguments in got:
            jsonschema.validate(arguments, SCHEMAS[name])
            if isinstance(tool_choice, dict):
                assert name == tool_choice["function"]["name"]
        pieces = {}
        for chunk in streamed:
            for d in chunk.choices[0].delta.tool_calls or []:
                entry = pieces.setdefault(d.index, ["", ""])
                entry[0] += d.function.name or ""
                entry[1] += d.function.arguments or ""
        assert [(n, json.loads(a)) for n, a in pieces.values()] == got
        assert streamed[-1].choices[0].finish_reason == "tool_calls"
