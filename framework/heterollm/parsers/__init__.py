"""Reasoning and tool-call parsers: a registry of formats, and the per-choice splitting of an answer
into reasoning_content, content and tool_calls (whole or streamed)."""
from heterollm.parsers.base import (ChoiceParser, Delta, Parsed, ReasoningParser, ToolCall, ToolParser, Tools, Unit,
                                    held_tail, split)
from heterollm.parsers.registry import ParserRegistry, build_registry

__all__ = ["ChoiceParser", "Delta", "Parsed", "ParserRegistry", "ReasoningParser", "ToolCall", "ToolParser", "Tools",
           "Unit", "build_registry", "held_tail", "split"]
