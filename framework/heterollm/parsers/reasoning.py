"""Reasoning in `<think> ... </think>`: the one format of every family the flag names (Qwen3,
Qwen3.5, DeepSeek-R1, GLM-4.5 / 4.7 / 5). Where the families differ is who writes `<think>`: the
model (Qwen3), or the chat template at the end of the prompt (DeepSeek-R1, Qwen3.5, GLM-4.7 with
thinking on), or the template closes an empty block in the prompt (`enable_thinking: false`).
So the parser reads the rendered prompt instead of guessing per family: the answer starts inside
the reasoning when the prompt's last `<think>` is not closed."""
from __future__ import annotations

from heterollm.parsers.base import ReasoningParser, held_tail


class ThinkParser(ReasoningParser):
    start, end = "<think>", "</think>"
    markers = ("</think>",)

    def starts_in_reasoning(self, prompt_text: str) -> bool:
        return prompt_text.rfind(self.start) > prompt_text.rfind(self.end)

    def split(self, text: str, in_reasoning: bool, final: bool) -> tuple[str, str]:
        begin = 0
        if not in_reasoning:
            lead = text.lstrip()
            if not final and len(lead) < len(self.start) and self.start.startswith(lead):
                return "", ""  # may still open a reasoning block
            if not lead.startswith(self.start):
                return "", text
            begin = len(text) - len(lead) + len(self.start)
        close = text.find(self.end, begin)
        if close < 0:  # still reasoning (or cut off by max_tokens: all of it is reasoning)
            return text[begin:len(text) - (0 if final else held_tail(text[begin:], self.end))], ""
        return text[begin:close], text[close + len(self.end):]
