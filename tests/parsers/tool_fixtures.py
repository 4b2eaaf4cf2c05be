"""Model outputs for each tool-call format, written the way the families' published chat templates
render an assistant's tool calls (Qwen2.5 / Qwen3 / Hermes, Qwen3-Coder / Qwen3.5, GLM-4.5 / 4.7,
DeepSeek V3 and the DSML of V3.2 / V4 / V4.1, Kimi K2, Llama 3.1 JSON, Mistral, Llama 3.2 pythonic).

Each case: (output text, expected content or None, expected calls as (name, arguments object))."""
from __future__ import annotations

import json

TOOLS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}, "days": {"type": "integer"}},
        "required": ["city"]}},
    {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "filters": {"type": "object"}}, "required": ["query"]}},
]
PARIS = ("get_weather", {"city": "Paris", "days": 3})
TOKYO = ("get_weather", {"city": "Tokyo", "unit": "c"})
NESTED = ("search", {"query": "a]b}\"c", "filters": {"tags": ["x", "y"], "range": {"from": 1, "to": 2.5}, "on": True}})
PLAIN = ("The weather in Paris is mild.", "The weather in Paris is mild.", [])


def _j(args: dict) -> str:
    return json.dumps(args, ensure_ascii=False)


# -- Hermes: Qwen2.5 / Qwen3's template writes <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>
def _hermes(call) -> str:
    return f'<tool_call>\n{{"name": "{call[0]}", "arguments": {_j(call[1])}}}\n</tool_call>'


HERMES = {
    "plain": PLAIN,
    "one": (_hermes(PARIS), None, [PARIS]),
    "parallel": (_hermes(PARIS) + "\n" + _hermes(TOKYO), None, [PARIS, TOKYO]),
    "nested": (_hermes(NESTED), None, [NESTED]),
    "text_before": ("Let me check.\n" + _hermes(PARIS), "Let me check.\n", [PARIS]),
    "malformed": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',
                  '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>', []),
    "unclosed": ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
                 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', []),
}


# -- Qwen3-Coder / Qwen3.5: XML functions, raw parameter values typed by the schema
def _xml_value(v) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def _coder(call) -> str:
    params = "".join(f"<parameter={k}>\n{_xml_value(v)}\n</parameter>\n" for k, v in call[1].items())
    return f"<tool_call>\n<function={call[0]}>\n{params}</function>\n</tool_call>"


QWEN3_CODER = {
    "plain": PLAIN,
    "one": (_coder(PARIS), None, [PARIS]),
    "parallel": (_coder(PARIS) + "\n" + _coder(TOKYO), None, [PARIS, TOKYO]),
    "nested": (_coder(NESTED), None, [NESTED]),
    "text_before": ("I will look it up.\n\n" + _coder(PARIS), "I will look it up.\n\n", [PARIS]),
    "malformed": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
                  "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>", []),
}


# -- GLM-4.5: name, newline, <arg_key>/<arg_value> pairs on lines; GLM-4.7 / 5: the same without newlines
def _glm(call, sep="\n") -> str:
    pairs = "".join(f"<arg_key>{k}</arg_key>{sep}<arg_value>{_xml_value(v)}</arg_value>{sep}" for k, v in call[1].items())
    return f"<tool_call>{call[0]}{sep}{pairs}</tool_call>"


GLM45 = {
    "plain": PLAIN,
    "one": (_glm(PARIS), None, [PARIS]),
    "parallel": (_glm(PARIS) + _glm(TOKYO), None, [PARIS, TOKYO]),
    "nested": (_glm(NESTED), None, [NESTED]),
    "text_before": ("Checking the forecast.\n" + _glm(PARIS), "Checking the forecast.\n", [PARIS]),
    "malformed": ("<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>",
                  "<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>", []),
}
GLM47 = {**GLM45, "one": (_glm(PARIS, ""), None, [PARIS]),
         "parallel": (_glm(PARIS, "") + _glm(TOKYO, ""), None, [PARIS, TOKYO])}


# -- DeepSeek V3: special-token sections, the arguments in a ```json fence
def _dsv3(*calls) -> str:
    body = "\n".join(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{_j(a)}\n```<｜tool▁call▁end｜>"
                     for n, a in calls)
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


DEEPSEEKV3 = {
    "plain": PLAIN,
    "one": (_dsv3(PARIS), None, [PARIS]),
    "parallel": (_dsv3(PARIS, TOKYO), None, [PARIS, TOKYO]),
    "nested": (_dsv3(NESTED), None, [NESTED]),
    "text_before": ("Let me see.\n\n" + _dsv3(PARIS), "Let me see.\n\n", [PARIS]),
    "malformed": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n{\"city\": "
                  "\"Paris\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
                  "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n{\"city\": "
                  "\"Paris\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>", []),
}


# -- DSML (DeepSeek V3.2: function_calls; V4: tool_calls; V4.1: spaced tags " calls", " invoke", " parameter")
def _dsml(block: str, tag: str, *calls) -> str:
    def param(k, v):
        string = isinstance(v, str)
        return f'<{tag}parameter name="{k}" string="{"true" if string else "false"}">{v if string else _j(v)}' \
               f'</{tag}parameter>'

    invokes = "\n".join(f'<{tag}invoke name="{n}">\n' + "\n".join(param(k, v) for k, v in a.items()) +
                        f"\n</{tag}invoke>" for n, a in calls)
    return f"<{tag}{block}>\n{invokes}\n</{tag}{block}>"


def _dsml_cases(block: str, tag: str) -> dict:
    bad = f'<{tag}{block}>\n<{tag}invoke name="get_weather">\n<{tag}parameter name="days" string="false">three' \
          f'</{tag}parameter>\n</{tag}invoke>\n</{tag}{block}>'
    return {
        "plain": PLAIN,
        "one": (_dsml(block, tag, PARIS), None, [PARIS]),
        "parallel": (_dsml(block, tag, PARIS, TOKYO), None, [PARIS, TOKYO]),
        "nested": (_dsml(block, tag, NESTED), None, [NESTED]),
        "text_before": ("Checking.\n\n" + _dsml(block, tag, PARIS), "Checking.\n\n", [PARIS]),
        "malformed": (bad, bad, []),
    }


DEEPSEEKV32 = _dsml_cases("function_calls", "｜DSML｜")
DEEPSEEKV4 = _dsml_cases("tool_calls", "｜DSML｜")
DEEPSEEKV41 = _dsml_cases("calls", "｜DSML｜ ")


# -- Kimi K2: functions.NAME:INDEX ids in a special-token section
def _kimi(*calls) -> str:
    body = "".join(f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{_j(a)}<|tool_call_end|>"
                   for i, (n, a) in enumerate(calls))
    return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


KIMI_K2 = {
    "plain": PLAIN,
    "one": (_kimi(PARIS), None, [PARIS]),
    "parallel": (_kimi(PARIS, TOKYO), None, [PARIS, TOKYO]),
    "nested": (_kimi(NESTED), None, [NESTED]),
    "text_before": ("I'll check the weather. " + _kimi(PARIS), "I'll check the weather. ", [PARIS]),
    "malformed": ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                  "{\"city\": Paris}<|tool_call_end|><|tool_calls_section_end|>",
                  "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                  "{\"city\": Paris}<|tool_call_end|><|tool_calls_section_end|>", []),
}


# -- Llama 3.1 JSON: the whole answer is the call(s), `parameters`, optionally after <|python_tag|>
def _llama(call) -> str:
    return f'{{"name": "{call[0]}", "parameters": {_j(call[1])}}}'


LLAMA3_JSON = {
    "plain": PLAIN,
    "one": (_llama(PARIS), None, [PARIS]),
    "python_tag": ("<|python_tag|>" + _llama(PARIS), None, [PARIS]),
    "parallel": (_llama(PARIS) + "; " + _llama(TOKYO), None, [PARIS, TOKYO]),
    "nested": (_llama(NESTED), None, [NESTED]),
    # the format calls only at the start of an answer: text first means a plain answer
    "text_before": ("Here: " + _llama(PARIS), "Here: " + _llama(PARIS), []),
    "malformed": ('{"name": "get_weather", "parameters": {"city": ', '{"name": "get_weather", "parameters": {"city": ',
                  []),
}


# -- Mistral: [TOOL_CALLS] and a JSON array (v0.3's template), or NAME[ARGS]{...} (newer tokenizers)
def _mistral(*calls) -> str:
    return "[TOOL_CALLS] [" + ", ".join(f'{{"name": "{n}", "arguments": {_j(a)}}}' for n, a in calls) + "]"


MISTRAL = {
    "plain": PLAIN,
    "one": (_mistral(PARIS), None, [PARIS]),
    "parallel": (_mistral(PARIS, TOKYO), None, [PARIS, TOKYO]),
    "nested": (_mistral(NESTED), None, [NESTED]),
    "text_before": ("Checking now. " + _mistral(PARIS), "Checking now. ", [PARIS]),
    "args_form": ("[TOOL_CALLS]get_weather[ARGS]" + _j(PARIS[1]) + "[TOOL_CALLS]get_weather[ARGS]" + _j(TOKYO[1]),
                  None, [PARIS, TOKYO]),
    "malformed": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}]',
                  '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}]', []),
}


# -- Pythonic (Llama 3.2 / 4): a Python list of calls with keyword arguments
def _py(call) -> str:
    return f"{call[0]}(" + ", ".join(f"{k}={v!r}" for k, v in call[1].items()) + ")"


PYTHONIC = {
    "plain": PLAIN,
    "one": ("[" + _py(PARIS) + "]", None, [PARIS]),
    "parallel": ("[" + _py(PARIS) + ", " + _py(TOKYO) + "]", None, [PARIS, TOKYO]),
    "nested": ("[" + _py(NESTED) + "]", None, [NESTED]),
    "llama4_tags": ("<|python_start|>[" + _py(PARIS) + "]<|python_end|>", None, [PARIS]),
    "text_before": ("Sure: [" + _py(PARIS) + "]", "Sure: [" + _py(PARIS) + "]", []),
    "malformed": ("[" + _py(PARIS), "[" + _py(PARIS), []),
}

BY_PARSER = {
    "hermes": HERMES, "qwen25": HERMES, "qwen3": HERMES, "qwen3_coder": QWEN3_CODER, "qwen35": QWEN3_CODER,
    "glm45": GLM45, "glm47": GLM47, "glm5": GLM47, "deepseekv3": DEEPSEEKV3, "deepseekv32": DEEPSEEKV32,
    "deepseekv4": DEEPSEEKV4, "deepseekv41": DEEPSEEKV41, "kimi_k2": KIMI_K2, "llama3_json": LLAMA3_JSON,
    "mistral": MISTRAL, "pythonic": PYTHONIC,
}
