"""The parser registry: names -> tool-call formats and reasoning formats. The built-in names map
onto the formats of tool_formats.py (several names share one format, as their families' templates
do); plugins add names through the `heterollm_register_parsers` hook (an installed
`heterollm.plugins` entry, or the file `--tool_parser_plugin` names), which the server calls once
at start-up. `auto` picks the format the model's chat template writes, else its model_type's."""
from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

from heterollm.config import ConfigError
from heterollm.parsers import tool_formats as f
from heterollm.parsers.base import ReasoningParser, ToolParser
from heterollm.parsers.reasoning import ThinkParser

logger = logging.getLogger("heterollm.parsers")

BUILTIN_TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": f.HermesFormat, "qwen25": f.HermesFormat, "qwen3": f.HermesFormat,
    "qwen3_coder": f.Qwen3CoderFormat, "qwen35": f.Qwen3CoderFormat,
    "glm45": f.GlmFormat, "glm47": f.GlmFormat, "glm5": f.GlmFormat,
    "deepseekv3": f.DeepSeekV3Format, "deepseekv32": f.DeepSeekV32Format, "deepseekv4": f.DeepSeekV4Format,
    "deepseekv41": f.DeepSeekV41Format, "kimi_k2": f.KimiK2Format,
    "llama3_json": f.Llama3JsonFormat, "mistral": f.MistralFormat, "pythonic": f.PythonicFormat,
}
BUILTIN_REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    name: ThinkParser for name in ("qwen3", "qwen35", "deepseek-r1", "glm45", "glm47", "glm5")}

AUTO_TOOL_BY_TEMPLATE = (
    # (a string the chat template writes, the format); more specific markers first
    ("<｜DSML｜ calls>", "deepseekv41"), ("<｜DSML｜tool_calls>", "deepseekv4"),
    ("<｜DSML｜function_calls>", "deepseekv32"), ("<｜tool▁calls▁begin｜>", "deepseekv3"),
    ("<|tool_calls_section_begin|>", "kimi_k2"), ("<function=", "qwen3_coder"), ("<arg_key>", "glm47"),
    ("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"),
)
AUTO_TOOL_BY_MODEL_TYPE = {
    # xLLM's auto table (model_type -> parser), for checkpoints whose template is not Jinja
    "qwen2": "qwen25", "qwen3": "qwen25", "qwen3_moe": "qwen25", "qwen3_coder": "qwen3_coder",
    "qwen3_5": "qwen35", "qwen35": "qwen35", "kimi_k2": "kimi_k2", "kimi_k25": "kimi_k2",
    "deepseek_v3": "deepseekv3", "deepseek_v32": "deepseekv32", "deepseek_v4": "deepseekv4",
    "glm_moe_dsa": "glm5",
}


class ParserRegistry:
    """Tool-call and reasoning parser classes by name, each with where it came from."""

    def __init__(self) -> None:
        self.tool: dict[str, tuple[type[ToolParser], str]] = {}
        self.reasoning: dict[str, tuple[type[ReasoningParser], str]] = {}
        for name, cls in BUILTIN_TOOL_PARSERS.items():
            self.register_tool_parser(name, cls, "heterollm")
        for name, cls in BUILTIN_REASONING_PARSERS.items():
            self.register_reasoning_parser(name, cls, "heterollm")

    def register_tool_parser(self, name: str, cls: type[ToolParser], origin: str = "a plugin") -> None:
        """Add a tool-call format under `name` (a ToolParser subclass); a name taken twice is an error."""
        self._add(self.tool, name, cls, ToolParser, origin, "tool_call_parser")

    def register_reasoning_parser(self, name: str, cls: type[ReasoningParser], origin: str = "a plugin") -> None:
        """Add a reasoning format under `name` (a ReasoningParser subclass)."""
        self._add(self.reasoning, name, cls, ReasoningParser, origin, "reasoning_parser")

    @staticmethod
    def _add(table: dict, name: str, cls: Any, base: type, origin: str, flag: str) -> None:
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ConfigError(f"--{flag}: {origin} registers {cls!r} as {name!r}, which is not a "
                              f"heterollm.parsers.{base.__name__} subclass")
        if name == "auto" or name in table:
            where = "the automatic choice" if name == "auto" else table[name][1]
            raise ConfigError(f"--{flag}: {origin} registers {name!r}, which {where} already names")
        table[name] = (cls, origin)

    def tool_parser(self, name: str, model_type: str, chat_template: str) -> ToolParser:
        """The named tool-call parser (`auto`: from the chat template, else the model_type)."""
        if name == "auto":
            name = next((n for marker, n in AUTO_TOOL_BY_TEMPLATE if marker in chat_template), None) or \
                AUTO_TOOL_BY_MODEL_TYPE.get(model_type, "")
            if not name:
                raise ConfigError(f"--tool_call_parser auto: neither the chat template nor the model_type "
                                  f"{model_type!r} shows which tool-call format this model writes; name one of "
                                  f"{', '.join(sorted(self.tool))}")
            logger.info("--tool_call_parser auto: %s", name)
        if name not in self.tool:
            raise ConfigError(f"--tool_call_parser: unknown parser {name!r}; registered: {', '.join(sorted(self.tool))}"
                              f", auto")
        cls = self.tool[name][0]
        parser = cls()
        parser.name = name
        return parser

    def reasoning_parser(self, name: str, chat_template: str) -> ReasoningParser:
        """The named reasoning parser (`auto`: the one whose markers the chat template writes)."""
        if name == "auto":
            name = next((n for n, (cls, _) in self.reasoning.items()
                         if cls.markers and any(m in chat_template for m in cls.markers)), "")
            if not name:
                raise ConfigError(f"--reasoning_parser auto: the chat template writes no reasoning block this server "
                                  f"knows; name one of {', '.join(sorted(self.reasoning))}")
        if name not in self.reasoning:
            raise ConfigError(f"--reasoning_parser: unknown parser {name!r}; registered: "
                              f"{', '.join(sorted(self.reasoning))}, auto")
        parser = self.reasoning[name][0]()
        parser.name = name
        return parser


def load_parser_plugin_file(path: str) -> Any:
    """`--tool_parser_plugin FILE`: import the file as a module (a pluggy plugin for the parser hook)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--tool_parser_plugin: {path} is not a file")
    spec = importlib.util.spec_from_file_location(f"heterollm_parser_plugin_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ConfigError(f"--tool_parser_plugin: {path} failed to import: {type(exc).__name__}: {exc}") from None
    if not callable(getattr(module, "heterollm_register_parsers", None)):
        raise ConfigError(f"--tool_parser_plugin: {path} defines no `heterollm_register_parsers` hook "
                          f"(a function marked @heterollm.plugins.hookimpl)")
    return module


def build_registry(plugin_manager: Any, plugin_file: str | None = None) -> ParserRegistry:
    """The built-in parsers plus those every plugin registers through the hook (the file's too)."""
    registry = ParserRegistry()
    if plugin_file:
        module = load_parser_plugin_file(plugin_file)
        if not plugin_manager.is_registered(module):
            plugin_manager.register(module, name=f"--tool_parser_plugin {plugin_file}")
    plugin_manager.hook.heterollm_register_parsers(registry=registry)
    return registry
