"""Example parser plugin: Llama 3.1's custom tool-calling format from Meta's prompt guide,
`<function=NAME>{"arg": ...}</function>`, registered as `llama3_function_tag`.

A format only says where its calls are: subclass a heterollm.parsers format (here the delimited
one: a start and an end marker) and read one block; streaming, malformed output and the
OpenAI response shape are the core's."""
from __future__ import annotations

import re

from heterollm.parsers import ToolCall
from heterollm.parsers.tool_formats import DelimitedFormat
from heterollm.parsers.base import args_json
from heterollm.plugins import hookimpl

__heterollm_api__ = ">=2.0,<3"


class FunctionTagFormat(DelimitedFormat):
    start, end = "<function=", "</function>"
    _BLOCK = re.compile(r"([A-Za-z0-9_.\-]+)>(.*)", re.S)

    def parse_block(self, inner, tools):
        m = self._BLOCK.fullmatch(inner)
        arguments = args_json(m.group(2)) if m else None
        return None if arguments is None else [ToolCall(m.group(1), arguments)]


@hookimpl
def heterollm_register_parsers(registry):
    registry.register_tool_parser("llama3_function_tag", FunctionTagFormat, "heterollm-example-tool-parser")
