"""The tool-call formats of the model families' published chat templates, each written once.

| format | what the model writes | names |
|---|---|---|
| JSON in tags (Hermes) | `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` per call | hermes, qwen25, qwen3 |
| XML functions (Qwen3-Coder) | `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>` | qwen3_coder, qwen35 |
| GLM key/value | `<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>` (4.7 and 5: no newlines) | glm45, glm47, glm5 |
| DeepSeek V3 | `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>` | deepseekv3 |
| DeepSeek DSML | `<｜DSML｜BLOCK>\n<｜DSML｜invoke name="NAME">\n<｜DSML｜parameter name="KEY" string="true">VALUE</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜BLOCK>` | deepseekv32 (function_calls), deepseekv4 (tool_calls), deepseekv41 (spaced tags) |
| Kimi K2 | `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|><|tool_calls_section_end|>` | kimi_k2 |
| Llama 3 JSON | `<|python_tag|>{"name": ..., "parameters": {...}}` (several joined by `;`), at the start of the answer | llama3_json |
| Mistral | `[TOOL_CALLS] [{"name": ..., "arguments": {...}}]`, or `[TOOL_CALLS]NAME[ARGS]{...}` | mistral |
| Pythonic | `[get_weather(city="Paris"), ...]` (Llama 3.2 / 4), at the start of the answer | pythonic |

Values the XML-like formats write as raw text are typed by the tool's JSON schema (a string stays
text; integer, number, boolean, object and array are parsed, and kept as text when they do not parse).
"""
from __future__ import annotations

import ast
import json
import re
from abc import abstractmethod
from typing import Any, ClassVar

from heterollm.parsers.base import ToolCall, ToolParser, Tools, Unit, args_json, held_tail

_DECODER = json.JSONDecoder()


def _json_value_at(text: str, i: int) -> tuple[Any, int] | None:
    """The JSON value starting at text[i] and the index after it, or None (incomplete or malformed)."""
    try:
        return _DECODER.raw_decode(text, i)
    except json.JSONDecodeError:
        return None


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _param_schema(tools: Tools, function: str, key: str) -> dict[str, Any]:
    for tool in tools:
        if tool.get("name") == function:
            props = (tool.get("parameters") or {}).get("properties") or {}
            schema = props.get(key)
            return schema if isinstance(schema, dict) else {}
    return {}


def typed_value(raw: str, schema: dict[str, Any]) -> Any:
    """A raw-text parameter value typed by its schema (see the module docstring)."""
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds or (kind is None and "enum" in schema and all(isinstance(v, str) for v in schema["enum"])):
        return raw
    text = raw.strip()
    if kind is None:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return raw
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return raw
    if "number" in kinds and isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    checks = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool), "boolean": lambda v: isinstance(v, bool),
              "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
              "null": lambda v: v is None}
    return value if any(checks.get(k, lambda v: False)(value) for k in kinds) else raw


class DelimitedFormat(ToolParser):
    """A format whose calls sit between a start and an end marker; `parse_block` reads one block."""

    start: ClassVar[str]
    end: ClassVar[str]

    def scan(self, text: str, tools: Tools) -> tuple[list[Unit], int]:
        units, pos = [], 0
        while True:
            i = text.find(self.start, pos)
            if i < 0:
                return units, len(text) - held_tail(text[pos:], self.start)
            j = text.find(self.end, i + len(self.start))
            if j < 0:
                return units, i
            units.append(Unit(i, j + len(self.end), self.parse_block(text[i + len(self.start):j], tools)))
            pos = j + len(self.end)

    @abstractmethod
    def parse_block(self, inner: str, tools: Tools) -> list[ToolCall] | None:
        """The calls between the markers, or None when the block is malformed."""


class HermesFormat(DelimitedFormat):
    start, end = "<tool_call>", "</tool_call>"

    def parse_block(self, inner: str, tools: Tools) -> list[ToolCall] | None:
        try:
            obj = json.loads(inner)
        except json.JSONDecodeError:
            return None
        return _json_call(obj)


def _json_call(obj: Any, keys: tuple[str, ...] = ("arguments", "parameters")) -> list[ToolCall] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    raw = next((obj[k] for k in keys if k in obj), {})
    arguments = args_json(raw)
    if arguments is None:
        return None
    call = ToolCall(obj["name"], arguments)
    if isinstance(obj.get("id"), str) and obj["id"]:
        call.id = obj["id"]
    return [call]


class Qwen3CoderFormat(DelimitedFormat):
    start, end = "<tool_call>", "</tool_call>"
    _FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
    _PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)

    def parse_block(self, inner: str, tools: Tools) -> list[ToolCall] | None:
        functions = list(self._FUNCTION.finditer(inner))
        if not functions or self._FUNCTION.sub("", inner).strip():
            return None
        calls = []
        for f in functions:
            name, body = f.group(1).strip(), f.group(2)
            if self._PARAM.sub("", body).strip():
                return None
            args = {}
            for p in self._PARAM.finditer(body):
                key, raw = p.group(1).strip(), p.group(2)
                raw = raw[1:] if raw.startswith("\n") else raw
                raw = raw[:-1] if raw.endswith("\n") else raw
                args[key] = typed_value(raw, _param_schema(tools, name, key))
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return calls


class GlmFormat(DelimitedFormat):
    start, end = "<tool_call>", "</tool_call>"
    _PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def parse_block(self, inner: str, tools: Tools) -> list[ToolCall] | None:
        first = inner.find("<arg_key>")
        name = (inner if first < 0 else inner[:first]).strip()
        if not name or "<" in name or "\n" in name:
            return None
        body = "" if first < 0 else inner[first:]
        if self._PAIR.sub("", body).strip():
            return None
        args = {m.group(1).strip(): typed_value(m.group(2), _param_schema(tools, name, m.group(1).strip()))
                for m in self._PAIR.finditer(body)}
        return [ToolCall(name, json.dumps(args, ensure_ascii=False))]


class DeepSeekV3Format(DelimitedFormat):
    needs_special_tokens = True
    start, end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    _CALL = re.compile(r"<｜tool▁call▁begin｜>(\w+)<｜tool▁sep｜>([^\n]+)\n```(?:json)?\n(.*?)\n```<｜tool▁call▁end｜>",
                       re.S)

    def parse_block(self, inner: str, tools: Tools) -> list[ToolCall] | None:
        calls = []
        for m in self._CALL.finditer(inner):
            arguments = args_json(m.group(3))
            if arguments is None:
                return None
            calls.append(ToolCall(m.group(2).strip(), arguments))
        return calls if calls and not self._CALL.sub("", inner).strip() else None


class KimiK2Format(DelimitedFormat):
    needs_special_tokens = True
    start, end = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    _CALL = re.compile(r"<\|tool_call_begin\|>\s*([\w.\-]+:\d+)\s*<\|tool_call_argument_begin\|>(.*?)"
                       r"<\|tool_call_end\|>", re.S)

    def parse_block(self, inner: str, tools: Tools) -> list[ToolCall] | None:
        calls = []
        for m in self._CALL.finditer(inner):
            call_id, arguments = m.group(1), args_json(m.group(2))
            name = call_id.rsplit(":", 1)[0].removeprefix("functions.")
            if arguments is None or not name:
                return None
            calls.append(ToolCall(name, arguments, id=call_id))
        return calls if calls and not self._CALL.sub("", inner).strip() else None


class DsmlFormat(DelimitedFormat):
    """DeepSeek V3.2 / V4 / V4.1's DSML: the block's tag name and spacing differ per version."""

    needs_special_tokens = True
    block: ClassVar[str]
    tag: ClassVar[str] = "｜DSML｜"

    @classmethod
    def _patterns(cls) -> tuple[re.Pattern, re.Pattern]:
        t = re.escape(cls.tag)
        invoke = re.compile(rf'<{t}invoke name="([^"]+)">(.*?)</{t}invoke>', re.S)
        param = re.compile(rf'<{t}parameter name="([^"]+)" string="(true|false)">(.*?)</{t}parameter>', re.S)
        return invoke, param

    def parse_block(self, inner: str, tools: Tools) -> list[ToolCall] | None:
        invoke, param = self._patterns()
        calls = []
        for m in invoke.finditer(inner):
            name, body = m.group(1), m.group(2)
            if param.sub("", body).strip():
                return None
            args = {}
            for p in param.finditer(body):
                if p.group(2) == "true":
                    args[p.group(1)] = p.group(3)
                else:
                    try:
                        args[p.group(1)] = json.loads(p.group(3))
                    except json.JSONDecodeError:
                        return None
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return calls if calls and not invoke.sub("", inner).strip() else None


class DeepSeekV32Format(DsmlFormat):
    start, end = "<｜DSML｜function_calls>", "</｜DSML｜function_calls>"


class DeepSeekV4Format(DsmlFormat):
    start, end = "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"


class DeepSeekV41Format(DsmlFormat):
    tag = "｜DSML｜ "
    start, end = "<｜DSML｜ calls>", "</｜DSML｜ calls>"


class Llama3JsonFormat(ToolParser):
    """Llama 3.1 / 3.2 JSON calls: the answer is `<|python_tag|>` (optional) and JSON objects joined by `;`."""

    needs_special_tokens = True
    _TAG = "<|python_tag|>"

    def scan(self, text: str, tools: Tools) -> tuple[list[Unit], int]:
        i = _skip_ws(text, 0)
        rest = text[i:]
        if not rest or (len(rest) < len(self._TAG) and self._TAG.startswith(rest)):
            return [], 0
        if rest.startswith(self._TAG):
            i = _skip_ws(text, i + len(self._TAG))
        elif rest[0] != "{":
            return [], len(text)  # a plain answer
        units: list[Unit] = []
        unit_start = 0  # the first unit claims the leading whitespace and the tag
        while i < len(text):
            if text[i] != "{":
                return units, len(text)  # text after the calls stays content
            value = _json_value_at(text, i)
            if value is None:
                return units, unit_start  # not closed yet (or malformed: text once the answer ends)
            obj, end = value
            units.append(Unit(unit_start, end, _json_call(obj)))
            if units[-1].calls is None:
                return units, len(text)
            unit_start, i = end, _skip_ws(text, end)
            if i < len(text) and text[i] == ";":
                i = _skip_ws(text, i + 1)
        return units, unit_start


class MistralFormat(ToolParser):
    needs_special_tokens = True
    _MARK = "[TOOL_CALLS]"
    _NAMED = re.compile(r"([A-Za-z0-9_\-.]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\]")

    def scan(self, text: str, tools: Tools) -> tuple[list[Unit], int]:
        units, pos = [], 0
        while True:
            i = text.find(self._MARK, pos)
            if i < 0:
                return units, len(text) - held_tail(text[pos:], self._MARK)
            j = _skip_ws(text, i + len(self._MARK))
            if j >= len(text):
                return units, i
            unit = self._array(text, i, j) if text[j] == "[" else self._named(text, i, j)
            if unit is None:
                return units, i
            units.append(unit)
            pos = unit.end

    def _array(self, text: str, i: int, j: int) -> Unit | None:
        value = _json_value_at(text, j)
        if value is None:
            return None
        calls = []
        for obj in value[0] if isinstance(value[0], list) and value[0] else [None]:
            one = _json_call(obj)
            if one is None:
                return Unit(i, value[1], None)
            calls += one
        return Unit(i, value[1], calls)

    def _named(self, text: str, i: int, j: int) -> Unit | None:
        m = self._NAMED.match(text, j)
        if m is None:
            rest = text[j:]
            return None if re.fullmatch(r"[A-Za-z0-9_\-.]*(\[[A-Z_]*\]?[A-Za-z0-9]*)?(\[[A-Z]*)?", rest) else \
                Unit(i, j, None)
        value = _json_value_at(text, m.end())
        if value is None:
            return None
        arguments = args_json(value[0])
        if arguments is None:
            return Unit(i, value[1], None)
        call = ToolCall(m.group(1), arguments)
        if m.group(2):
            call.id = m.group(2)
        return Unit(i, value[1], [call])


class PythonicFormat(ToolParser):
    """`[f(a=1), g(b="x")]` at the start of the answer (Llama 3.2 / 4's pythonic calls; Llama 4
    may wrap them in <|python_start|> ... <|python_end|>)."""

    needs_special_tokens = True
    _OPEN, _CLOSE = "<|python_start|>", "<|python_end|>"

    def scan(self, text: str, tools: Tools) -> tuple[list[Unit], int]:
        start = i = _skip_ws(text, 0)
        rest = text[i:]
        if not rest or (len(rest) < len(self._OPEN) and self._OPEN.startswith(rest)):
            return [], 0
        if rest.startswith(self._OPEN):
            i = _skip_ws(text, i + len(self._OPEN))
            if i >= len(text):
                return [], start
        if text[i] != "[":
            return [], len(text)
        end = _bracket_end(text, i)
        if end is None:
            return [], start
        calls = _python_calls(text[i:end])
        if rest.startswith(self._OPEN):
            j = _skip_ws(text, end)
            if len(text) - j < len(self._CLOSE) and self._CLOSE.startswith(text[j:]):
                return [], start
            if text.startswith(self._CLOSE, j):
                end = j + len(self._CLOSE)
        return [Unit(start, end, calls)], len(text)


def _bracket_end(text: str, i: int) -> int | None:
    """The index after the bracket that closes text[i], skipping Python string literals; None if unclosed."""
    depth, quote, k = 0, None, i
    while k < len(text):
        ch = text[k]
        if quote:
            if ch == "\\":
                k += 1
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return k + 1
        k += 1
    return None


def _python_calls(source: str) -> list[ToolCall] | None:
    try:
        tree = ast.parse(source, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except ValueError:
            return None
        if len(args) != len(node.keywords):
            return None
        try:
            calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
        except TypeError:  # a literal JSON cannot hold (a set, bytes, a complex number)
            return None
    return calls
