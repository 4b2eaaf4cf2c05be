"""n-gram prompt lookup: the last n tokens (n from max down to min) are searched for earlier in the
request's own tokens; the tokens that followed their latest earlier occurrence are the drafts."""
from __future__ import annotations

from collections.abc import Sequence


class NgramProposer:
    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int, k: int) -> list[int]:
        tokens = list(token_ids)
        end = len(tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            pattern = tokens[end - n:]
            first = pattern[0]
            # the latest earlier occurrence: its continuation is the most recent use of the pattern
            for start in range(end - n - 1, -1, -1):
                if tokens[start] == first and tokens[start:start + n] == pattern:
                    return tokens[start + n:start + n + k]
        return []

    def finish(self, request_id: str) -> None:
        """Nothing is kept between steps."""
