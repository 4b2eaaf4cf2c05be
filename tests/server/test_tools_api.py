"""Tool calling and reasoning over HTTP with the official `openai` client, on a tiny random llama:
tool_choice required / named decode under structured output, so even random weights answer with
valid calls; an `auto` answer constrained (through structured_outputs) to the Hermes format goes
through --tool_call_parser. Streamed deltas, accumulated the way the client's own
ChatCompletionStreamState does, equal the non-streamed message; bad input is a 400 naming the field
or the flag."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from conftest import MODEL, make_engine, serving

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 16},
                                           "filters": {"type": "object", "properties": {
                                               "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                        "maxItems": 2}},
                                               "required": ["tags"], "additionalProperties": False}},
          "required": ["query", "filters"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH}}]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Tokyo|Lima)", '
               r'"days": [1-7]\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def tools_srv(tiny_llama):
    with serving(make_engine(tiny_llama, guided_decoding_backend="auto", guided_decoding_disable_any_whitespace=True,
                             tool_call_parser="hermes", reasoning_parser="qwen3")) as running:
        yield running


@pytest.fixture(scope="module")
def client(tools_srv):
    from openai import OpenAI
    return OpenAI(base_url=f"{tools_srv.url}/v1", api_key="EMPTY", max_retries=0)


def accumulate(stream):
    """The openai client's own accumulation of a chat stream (what agent frameworks read)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    state = ChatCompletionStreamState()
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        state.handle_chunk(chunk)
    return state.get_final_completion(), chunks


def calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def create(client, stream=False, **kwargs):
    args = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 120, "temperature": 0.8, "seed": 3,
            **kwargs}
    if stream:
        return accumulate(client.chat.completions.create(stream=True, **args))
    return client.chat.completions.create(**args), None


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "search"}}])
def test_forced_calls_streamed_and_not(client, tool_choice):
    for seed in (2, 3):  # seeds whose random-weight calls end within max_tokens (a longer one: "length")
        whole, _ = create(client, tool_choice=tool_choice, seed=seed)
        streamed, chunks = create(client, stream=True, tool_choice=tool_choice, seed=seed)
        for chat in (whole, streamed):
            choice = chat.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content is None and choice.message.tool_calls
            for name, args in calls(choice.message):
                jsonschema.validate(args, SCHEMAS[name])
                if isinstance(tool_choice, dict):
                    assert name == "search"
            for call in choice.message.tool_calls:
                assert call.type == "function" and call.id.startswith("call_")
        assert calls(streamed.choices[0].message) == calls(whole.choices[0].message)
        # the first delta of each call carries index, id, type and name; the arguments come after
        firsts = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls
                  and c.choices[0].delta.tool_calls[0].id]
        assert [(d.index, d.type, d.function.name, d.function.arguments) for d in firsts] == \
            [(i, "function", name, "") for i, (name, _) in enumerate(calls(whole.choices[0].message))]


def test_parallel_tool_calls_false_gives_one_call(client):
    for seed in (4, 5):
        chat, _ = create(client, tool_choice="required", parallel_tool_calls=False, seed=seed)
        assert len(chat.choices[0].message.tool_calls) == 1


def test_auto_parses_the_hermes_format(client):
    """tool_choice auto: the answer (here held to the Hermes format by a regex) goes through --tool_call_parser."""
    extra = {"structured_outputs": {"regex": "I will check\\.\\n" + HERMES_CALL}}
    whole, _ = create(client, extra_body=extra)
    streamed, _ = create(client, stream=True, extra_body=extra)
    for chat in (whole, streamed):
        assert chat.choices[0].finish_reason == "tool_calls"
        assert chat.choices[0].message.content == "I will check.\n"
        [(name, args)] = calls(chat.choices[0].message)
        assert name == "get_weather" and args["city"] in ("Paris", "Tokyo", "Lima")
    assert calls(streamed.choices[0].message) == calls(whole.choices[0].message)


def test_reasoning_then_a_tool_call(client):
    extra = {"structured_outputs": {"regex": "<think>\\n[a-z ]{1,30}\\n</think>\\n\\n" + HERMES_CALL}}
    whole, _ = create(client, extra_body=extra)
    streamed, chunks = create(client, stream=True, extra_body=extra)
    for chat in (whole, streamed):
        message = chat.choices[0].message
        reasoning = message.reasoning_content if hasattr(message, "reasoning_content") else \
            message.model_extra["reasoning_content"]
        assert reasoning.startswith("\n") and reasoning.endswith("\n") and message.content is None
        assert calls(message)[0][0] == "get_weather" and chat.choices[0].finish_reason == "tool_calls"
    assert calls(streamed.choices[0].message) == calls(whole.choices[0].message)
    streamed_reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks
                                 if c.choices)
    assert streamed_reasoning == whole.choices[0].message.model_extra["reasoning_content"]


def test_reasoning_content_and_include_reasoning(client):
    extra = {"structured_outputs": {"regex": "<think>\\n[a-z ]{1,20}\\n</think>\\n\\n[a-z ]{1,20}"}}
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0.8, seed=1,
                                          extra_body=extra)
    message = chat.choices[0].message
    assert message.model_extra["reasoning_content"].strip() and message.content.startswith("\n\n")
    assert chat.choices[0].finish_reason == "stop" and not message.tool_calls
    hidden = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0.8, seed=1,
                                            extra_body={**extra, "include_reasoning": False})
    assert "reasoning_content" not in hidden.choices[0].message.model_extra
    assert hidden.choices[0].message.content == message.content


def test_enable_thinking_reaches_the_template(tools_srv):
    """chat_template_kwargs.enable_thinking: the template closes an empty block, so the answer is content."""
    template = ("{% for m in messages %}{{ m.content }}{% endfor %}{% if enable_thinking is defined and "
                "not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}")
    for thinking, key in ((True, "reasoning_content"), (False, "content")):
        r = httpx.post(f"{tools_srv.url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": MESSAGES, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "chat_template": template, "chat_template_kwargs": {"enable_thinking": thinking}})
        message = r.json()["choices"][0]["message"]
        assert message.get(key), message


def test_history_with_tool_calls_and_tool_results_reaches_the_template(tools_srv):
    """An assistant message's tool_calls (arguments as a JSON string, OpenAI's shape) reach the template
    as a mapping, as the families' templates read them; tool messages keep their tool_call_id; the
    request's tools are passed to the template."""
    template = ("{% if tools %}[{{ tools | length }} tools: {{ tools[0].function.name }}]{% endif %}"
                "{% for m in messages %}{% if m.tool_calls %}{% for t in m.tool_calls %}<call {{ t.id }}>"
                "{{ t.function.name }}{{ t.function.arguments | tojson }}{% endfor %}{% elif m.role == 'tool' %}"
                "<result {{ m.tool_call_id }}>{{ m.content }}{% else %}{{ m.content }}{% endif %}{% endfor %}")
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": "{\"city\": \"Paris\", \"days\": 2}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = httpx.post(f"{tools_srv.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": messages, "tools": TOOLS, "tool_choice": "none", "max_tokens": 1,
        "chat_template": template, "return_token_ids": True})
    assert r.status_code == 200, r.text
    prompt = tools_srv.engine.tokenizer.decode(r.json()["prompt_token_ids"], skip_special_tokens=False)
    assert prompt == ('[2 tools: get_weather]What is the weather in Paris?<call call_1>get_weather'
                      '{"city": "Paris", "days": 2}<result call_1>sunny')


BAD = [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name", "nope"),
    ({"tool_choice": "sometimes"}, "tool_choice", "required"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strng"}}}]},
     "tools.0.function.parameters.type", "strng"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "object", "properties": []}}}}}]},
     "tools.0.function.parameters.properties.a.properties", "object of schemas"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name", "letters"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "tools.0.type must be \"function\", got 'retrieval'"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "response_format"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "x", "function": {"name": 3}}]}]},
     "messages.0.tool_calls.0.function", "name"),
]


@pytest.mark.parametrize("extra,param,words", BAD)
def test_bad_tool_input_is_a_400_naming_the_field(tools_srv, extra, param, words):
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **extra}
    r = httpx.post(f"{tools_srv.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_parameters_without_a_type_are_an_object_schema(tools_srv):
    """JSON Schema's default: a parameters schema that names no type is taken (as an object's)."""
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"properties": {"q": {"type": "string"}}}}}
    body = {"model": MODEL, "messages": MESSAGES, "tools": [tool], "max_tokens": 4}
    r = httpx.post(f"{tools_srv.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_a_server_without_the_flags_names_them(srv):
    """The plain server: no --tool_call_parser, no --reasoning_parser, --guided_decoding_backend off."""
    cases = [({"tools": TOOLS}, "tools", "--tool_call_parser"),
             ({"tools": TOOLS, "tool_choice": "auto"}, "tools", "--tool_call_parser"),
             ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice", "--guided_decoding_backend"),
             ({"include_reasoning": False}, "include_reasoning", "--reasoning_parser")]
    for extra, param, flag in cases:
        r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param and flag in r.json()["error"]["message"]
    # tool_choice none keeps the tools in the prompt and parses nothing: no parser needed
    r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 4, "tools": TOOLS, "tool_choice": "none"})
    assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]


def test_unknown_parser_names_are_refused_at_launch(tiny_llama):
    from heterollm.config import ConfigError
    from heterollm.entrypoints.openai.server import OpenAIServer, ServerSettings
    engine = make_engine(tiny_llama, tool_call_parser="nope")
    try:
        with pytest.raises(ConfigError, match="--tool_call_parser: unknown parser 'nope'"):
            OpenAIServer(engine, ServerSettings(served_model_names=[MODEL]))
    finally:
        engine.shutdown()
