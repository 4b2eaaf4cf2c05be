"""The contracts of the output parsers and the one piece of logic they share: splitting a
choice's text into reasoning, content and tool calls, the same way whether the text is whole or
arrives in pieces.

A tool-call format only says where its calls are (`ToolParser.scan`): the complete units it
found (each a list of calls, or None when the unit is malformed and stays text) and the index
from which the text is still undecided (a unit that has not closed, or a tail that may be the
start of its marker). `split` turns that into content and calls; `ChoiceParser` emits, for a
growing text, only what can no longer change, so the streamed deltas always add up to the
whole text's result."""
from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

Tools = list[dict[str, Any]]
"""The request's function definitions: OpenAI's `tools[i].function` objects (name, parameters, ...)."""


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as a JSON object's text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    """The model's own id when its format carries one (Kimi K2's `functions.name:0`), else a new one."""

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Unit:
    """A complete stretch of text [start, end) that the format claims."""

    start: int
    end: int
    calls: list[ToolCall] | None
    """The calls it holds, or None: malformed, so it stays in the content as text."""


class ToolParser(ABC):
    """One tool-call format. Stateless: `scan` sees the whole text so far each time."""

    name: ClassVar[str] = ""
    needs_special_tokens: ClassVar[bool] = False
    """Its markers are special tokens: the text must be decoded with them (skip_special_tokens=False)."""

    @abstractmethod
    def scan(self, text: str, tools: Tools) -> tuple[list[Unit], int]:
        """The complete units in `text`, in order, and the index from which the text is undecided
        (len(text) when nothing may still become a call). Every unit ends at or before that index.
        Scanning a longer text that starts with `text` must find the same units before it."""


class ReasoningParser(ABC):
    """Splits a choice's text into reasoning and the answer."""

    name: ClassVar[str] = ""
    markers: ClassVar[tuple[str, ...]] = ()
    """Strings a chat template that writes this format contains (for `--reasoning_parser auto`)."""

    @abstractmethod
    def starts_in_reasoning(self, prompt_text: str) -> bool:
        """Whether the answer starts inside the reasoning block (the template opened it in the prompt)."""

    @abstractmethod
    def split(self, text: str, in_reasoning: bool, final: bool) -> tuple[str, str]:
        """(reasoning, content) of `text`; unless `final`, a tail that may still change is left out
        of both. Each grows as the text grows."""


def held_tail(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def args_json(value: Any) -> str | None:
    """A call's arguments as JSON text (an object), or None when they are not an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def split(parser: ToolParser, text: str, tools: Tools, final: bool) -> tuple[str, list[ToolCall]]:
    """Content (the text outside well-formed units) and calls; unless `final`, only the decided part."""
    units, undecided = parser.scan(text, tools)
    limit = len(text) if final else undecided
    content, calls, pos = [], [], 0
    for unit in units:
        if unit.calls is None:
            continue
        content.append(text[pos:unit.start])
        calls.extend(unit.calls)
        pos = unit.end
    content.append(text[pos:limit] if pos < limit else "")
    return "".join(content), calls


@dataclass
class Delta:
    """What one step adds to a choice's message."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


@dataclass
class Parsed:
    """A choice's whole message: reasoning_content, content (None when only whitespace) and tool_calls."""

    reasoning: str | None
    content: str | None
    calls: list[ToolCall]


class _Sent:
    """Emits a growing text once it holds more than whitespace (whitespace alone is no message)."""

    def __init__(self) -> None:
        self.length = 0

    def next(self, text: str) -> str:
        if self.length == 0 and not text.strip():
            return ""
        out, self.length = text[self.length:], len(text)
        return out


class ChoiceParser:
    """One choice's parsing: reasoning (optional), then tool calls (optional) in the content.
    `update(text)` for each longer text of a stream; `result(text)` for the whole text. Both agree:
    the deltas of any sequence of updates followed by a final one add up to `result`."""

    def __init__(self, reasoning: ReasoningParser | None = None, in_reasoning: bool = False,
                 tools_parser: ToolParser | None = None, tools: Tools | None = None,
                 max_calls: int | None = None) -> None:
        self.reasoning, self.in_reasoning = reasoning, in_reasoning
        self.tools_parser, self.tools = tools_parser, tools or []
        self.max_calls = max_calls
        """parallel_tool_calls=false: only the first call is kept."""
        self._reasoning_sent, self._content_sent = _Sent(), _Sent()
        self._calls_sent = 0

    def _parts(self, text: str, final: bool) -> tuple[str, str, list[ToolCall]]:
        reasoning, content = ("", text)
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(text, self.in_reasoning, final)
        calls: list[ToolCall] = []
        if self.tools_parser is not None:
            content, calls = split(self.tools_parser, content, self.tools, final)
        if self.max_calls is not None:
            calls = calls[:self.max_calls]
        return reasoning, content, calls

    def update(self, text: str, final: bool) -> Delta:
        reasoning, content, calls = self._parts(text, final)
        new_calls, self._calls_sent = calls[self._calls_sent:], len(calls)
        return Delta(self._reasoning_sent.next(reasoning), self._content_sent.next(content), new_calls)

    def result(self, text: str) -> Parsed:
        reasoning, content, calls = self._parts(text, True)
        return Parsed(reasoning if reasoning.strip() else None, content if content.strip() else None, calls)
