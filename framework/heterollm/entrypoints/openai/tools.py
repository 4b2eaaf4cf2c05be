"""Tool calling and reasoning on /v1/chat/completions: the checks of `tools` / `tool_choice`, the
constraint `required` and a named choice decode under (structured output), and the per-request
plan the response builder parses each choice with (parsers/)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from heterollm.entrypoints.openai.protocol import BadRequest
from heterollm.parsers import ChoiceParser, ReasoningParser, ToolCall, ToolParser, Tools, Unit
from heterollm.sampling import StructuredOutputsParams

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_TYPES = {"string", "number", "integer", "boolean", "object", "array", "null"}
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
NEEDS_GUIDED = ("tool_choice {!r} constrains decoding through structured output, which is off on this server "
                "(--guided_decoding_backend=off); start it with --guided_decoding_backend auto")


def check_schema(schema: Any, where: str) -> None:
    """A JSON schema's shape (what the grammar compiler and the template read), or BadRequest naming the spot."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise BadRequest(f"{where} must be a JSON schema (an object)", where)
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if not all(isinstance(k, str) and k in _TYPES for k in kinds) or (isinstance(kind, list) and not kind):
        raise BadRequest(f"{where}.type must be one of {', '.join(sorted(_TYPES))} (or a list of them), got {kind!r}",
                         f"{where}.type")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise BadRequest(f"{where}.required must be a list of property names", f"{where}.required")
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise BadRequest(f"{where}.enum must be a list", f"{where}.enum")
    for key in _SUBSCHEMA_LISTS:
        if key in schema:
            if not isinstance(schema[key], list):
                raise BadRequest(f"{where}.{key} must be a list of schemas", f"{where}.{key}")
            for i, sub in enumerate(schema[key]):
                check_schema(sub, f"{where}.{key}.{i}")
    for key in _SUBSCHEMA_MAPS:
        if key in schema:
            if not isinstance(schema[key], dict):
                raise BadRequest(f"{where}.{key} must be an object of schemas", f"{where}.{key}")
            for name, sub in schema[key].items():
                check_schema(sub, f"{where}.{key}.{name}")
    for key in _SUBSCHEMAS:
        if key in schema:
            check_schema(schema[key], f"{where}.{key}")


def check_tools(tools: list[dict[str, Any]]) -> Tools:
    """OpenAI's `tools` -> their function objects; BadRequest naming the field at fault."""
    functions, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if tool.get("type", "function") != "function":
            raise BadRequest(f"{where}.type must be \"function\", got {tool.get('type')!r}", f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise BadRequest(f"{where}.function is required (an object with name and parameters)", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise BadRequest(f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.', got {name!r}",
                             f"{where}.function.name")
        if name in names:
            raise BadRequest(f"{where}.function.name: {name!r} is given twice", f"{where}.function.name")
        names.add(name)
        if "description" in fn and not isinstance(fn["description"], (str, type(None))):
            raise BadRequest(f"{where}.function.description must be a string", f"{where}.function.description")
        params = fn.get("parameters")
        if params is not None:
            check_schema(params, f"{where}.function.parameters")
            if isinstance(params, dict) and params.get("type", "object") != "object":
                raise BadRequest(f"{where}.function.parameters must describe an object (type \"object\")",
                                 f"{where}.function.parameters.type")
        functions.append(fn)
    return functions


def tool_choice_mode(choice: Any, functions: Tools) -> str:
    """"auto", "none", "required", or the name of the one function the answer must call."""
    if choice is None:
        return "auto" if functions else "none"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise BadRequest(f"tool_choice must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", "
                             f"\"function\": {{\"name\": ...}}}}, got {choice!r}", "tool_choice")
        if choice != "none" and not functions:
            raise BadRequest(f"tool_choice {choice!r} needs tools", "tool_choice")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type", "function") != "function" or not isinstance(name, str):
        raise BadRequest("tool_choice must name a function as {\"type\": \"function\", \"function\": {\"name\": ...}}",
                         "tool_choice")
    if name not in {f["name"] for f in functions}:
        known = ", ".join(repr(f["name"]) for f in functions) or "none"
        raise BadRequest(f"tool_choice names the function {name!r}, which is not in tools (given: {known})",
                         "tool_choice.function.name")
    return name


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters")
    return params if isinstance(params, dict) else {"type": "object"}


def forced_spec(mode: str, functions: Tools, parallel: bool) -> StructuredOutputsParams:
    """The constraint of `required` (a JSON array of {name, parameters}, vLLM's form) or of a named
    function (its parameters object); compact JSON (no whitespace between tokens: a small model
    otherwise spends max_tokens on indentation, and the arguments are for machines)."""
    if mode != "required":
        fn = next(f for f in functions if f["name"] == mode)
        return StructuredOutputsParams(json=_parameters(fn), disable_any_whitespace=True, origin="tool_choice")
    items = {"anyOf": [{"type": "object", "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                                         "parameters": _parameters(f)},
                        "required": ["name", "parameters"], "additionalProperties": False} for f in functions]}
    schema = {"type": "array", "minItems": 1, "items": items, **({} if parallel else {"maxItems": 1})}
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True, origin="tool_choice")


class NamedCallFormat(ToolParser):
    """A named tool_choice's answer: the function's arguments, one JSON object."""

    def __init__(self, function: str) -> None:
        self.function = function

    def scan(self, text: str, tools: Tools) -> tuple[list[Unit], int]:
        try:
            obj, end = json.JSONDecoder().raw_decode(text, len(text) - len(text.lstrip()))
        except json.JSONDecodeError:
            return [], 0
        ok = isinstance(obj, dict)
        return [Unit(0, end, [ToolCall(self.function, json.dumps(obj, ensure_ascii=False))] if ok else None)], len(text)


class RequiredCallsFormat(ToolParser):
    """tool_choice "required"'s answer: a JSON array of {"name", "parameters"}. Each item is a unit of
    its own, so a call is streamed as soon as its item closes, and an answer cut off by max_tokens
    keeps the calls it completed."""

    def scan(self, text: str, tools: Tools) -> tuple[list[Unit], int]:
        decoder, units = json.JSONDecoder(), []
        i = _skip_ws(text, 0)
        if i >= len(text):
            return [], 0
        if text[i] != "[":
            return [], len(text)
        start, i = 0, _skip_ws(text, i + 1)
        while i < len(text):
            if text[i] == "]":
                units.append(Unit(start, i + 1, []))
                return units, len(text)
            if text[i] == "," and units:
                i = _skip_ws(text, i + 1)
                continue
            try:
                item, end = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                return units, start
            ok = isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("parameters"), dict)
            units.append(Unit(start, end, [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))]
                              if ok else None))
            if not ok:
                return units, len(text)
            start, i = end, _skip_ws(text, end)
        return units, start


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


@dataclass
class RequestParsing:
    """How one chat request's choices are parsed."""

    reasoning: ReasoningParser | None = None
    in_reasoning: bool = False
    """The prompt left a reasoning block open: the answer starts in it."""
    include_reasoning: bool = True
    tools_parser: ToolParser | None = None
    tools: Tools = field(default_factory=list)
    max_calls: int | None = None

    def choice(self) -> ChoiceParser:
        return ChoiceParser(self.reasoning, self.in_reasoning, self.tools_parser, self.tools, self.max_calls)


@dataclass
class ChatParsers:
    """The server's --tool_call_parser / --reasoning_parser (None when not set)."""

    tool: ToolParser | None = None
    reasoning: ReasoningParser | None = None
    guided: bool = False
    """Structured output is on (--guided_decoding_backend): required / named choices can be honoured."""

    def plan(self, body: Any) -> tuple[RequestParsing | None, Tools, StructuredOutputsParams | None]:
        """(the parsing plan or None, the functions for the chat template, the constraint of a
        required / named tool_choice); BadRequest for what cannot be served."""
        functions = check_tools(body.tools) if body.tools else []
        mode = tool_choice_mode(body.tool_choice, functions)
        if functions and mode != "none" and body.use_beam_search:
            raise BadRequest("tools: tool calls are not parsed from beam search answers (use_beam_search)", "tools")
        parallel = body.parallel_tool_calls is not False
        if functions and self.tool is None and mode == "auto":
            raise BadRequest("tools with tool_choice \"auto\" need a tool-call parser: start the server with "
                             "--tool_call_parser (auto, hermes, qwen25, llama3_json, ...); \"required\" or a named "
                             "function need only --guided_decoding_backend", "tools")
        include = body.include_reasoning is not False
        if not include and self.reasoning is None:
            raise BadRequest("include_reasoning=false needs --reasoning_parser: without it the answer is not split "
                             "into reasoning and content", "include_reasoning")
        spec, parser = None, None
        if mode == "auto":
            parser = self.tool
        elif mode != "none":
            if not self.guided:
                raise BadRequest(NEEDS_GUIDED.format(mode if mode == "required" else "naming a function"),
                                 "tool_choice")
            spec = forced_spec(mode, functions, parallel)
            parser = RequiredCallsFormat() if mode == "required" else NamedCallFormat(mode)
        # a forced call is decoded under its grammar from the first token: there is no reasoning before it
        reasoning = self.reasoning if spec is None else None
        if parser is None and reasoning is None:
            return None, functions, None
        return (RequestParsing(reasoning, False, include, parser, functions, None if parallel else 1),
                functions, spec)

    @property
    def needs_special_tokens(self) -> bool:
        return self.tool is not None and self.tool.needs_special_tokens

    def prepare(self, plan: RequestParsing | None, forced: StructuredOutputsParams | None, params: Any, body: Any,
                prompt_ids: list[int], tokenizer: Any) -> None:
        """Fit the request's SamplingParams to its plan: the forced call's constraint (alone: it cannot be
        combined with another), special tokens kept for formats whose markers are special tokens,
        and whether the prompt left a reasoning block open."""
        if forced is not None:
            if params.structured_outputs is not None:
                raise BadRequest(f"tool_choice {body.tool_choice!r} constrains the answer to a tool call, so it cannot "
                                 f"be combined with {params.structured_outputs.origin}", "tool_choice")
            params.structured_outputs = forced
        if plan is None:
            return
        if plan.tools_parser is not None and plan.tools_parser.needs_special_tokens and \
                "skip_special_tokens" not in body.model_fields_set:
            params.skip_special_tokens = False
        if plan.reasoning is not None:
            tail = tokenizer.decode(prompt_ids[-64:], skip_special_tokens=False)
            plan.in_reasoning = plan.reasoning.starts_in_reasoning(tail)


def chat_parsers(engine: Any) -> ChatParsers:
    """The server's parsers from the engine's launch flags (ConfigError naming the flag when one is unknown)."""
    from heterollm.parsers import build_registry

    cfg = engine.config
    tool_name, reasoning_name = cfg.model.tool_call_parser, cfg.model.reasoning_parser
    registry = build_registry(engine.plugins, cfg.fastdeploy.tool_parser_plugin)
    template = engine.tokenizer.hf.chat_template
    template = template if isinstance(template, str) else json.dumps(template or "")
    model_type = getattr(engine.source.hf_config, "model_type", "") or ""
    return ChatParsers(tool=registry.tool_parser(tool_name, model_type, template) if tool_name else None,
                       reasoning=registry.reasoning_parser(reasoning_name, template) if reasoning_name else None,
                       guided=cfg.fastdeploy.guided_decoding_backend != "off")
