"""Incremental detokenization that is correct for characters spanning several tokens.

The text is decoded over a window `ids[prefix:]` that starts a few tokens back (so that
tokenizers which drop a leading space at the start of a decode still produce the right
characters), and compared with the decoding of `ids[prefix:read]`, the part already emitted.
New text is emitted only when it does not end in an incomplete UTF-8 sequence (U+FFFD)."""
from __future__ import annotations

from heterollm.tokenizer.loader import Tokenizer

_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-(_CONTEXT + 1):])
        self.read = len(self.ids)
        self.prefix = max(self.read - _CONTEXT, 0)
        self.text = ""

    def _delta(self, force: bool) -> str:
        done = self.tokenizer.decode(self.ids[self.prefix:self.read], self.skip)
        full = self.tokenizer.decode(self.ids[self.prefix:], self.skip)
        if len(full) <= len(done) or (full.endswith("\ufffd") and not force):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        new = full[len(done):]
        self.text += new
        return new

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (may be "")."""
        self.ids.append(token_id)
        return self._delta(force=False)

    def flush(self) -> str:
        """At the end of generation, emit whatever incomplete tail remains."""
        return self._delta(force=True)
