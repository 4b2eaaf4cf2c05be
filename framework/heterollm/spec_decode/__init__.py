"""Speculative decoding: proposers guess the next tokens, one target forward scores them all, and
verification keeps the longest prefix the target agrees with plus one token of its own.

- Engine-side proposers (`Proposer`: suffix decoding, n-gram prompt lookup) read token ids only
  and run between steps; the scheduler sends their drafts with the request's next decode.
- The draft-model proposer runs on the workers beside the target (its own paged KV cache, the
  target's block tables) and returns the drafts with the step's tokens.
- Verification (rejection.py): greedy keeps drafts while they equal the target's argmax (output
  identical to decoding without speculation); sampling accepts a draft d with probability
  min(1, p(d) / q(d)) and on rejection draws from max(p - q, 0) normalized, which leaves the
  target's distribution p unchanged.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from heterollm.spec_decode.config import SpecConfig, resolve_spec


class Proposer(Protocol):
    """Drafts from token ids alone (no model): called between steps for each decoding request."""

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int, k: int) -> list[int]:
        """Up to k tokens to follow `token_ids` (the request's prompt + output so far)."""

    def finish(self, request_id: str) -> None:
        """The request ended (finished or aborted): forget it (or learn from it)."""


def check_spec_support(selection: Any, config: Any) -> None:
    """Raise a LaunchError when the selected attention backend cannot verify what the launch asks
    for: a draft tree needs `supports_tree_attention()`."""
    from heterollm.plugins.resolver import LaunchError

    spec = resolve_spec(config)
    attention = selection.components["attention"]
    if spec is not None and spec.tree and not attention.obj.supports_tree_attention():
        raise LaunchError([f"--speculative_suffix_use_tree_spec: attention {attention.name} ({attention.dist}) "
                           f"cannot verify a draft tree (no tree attention masks); path speculation works"])


def make_proposer(spec: SpecConfig) -> Proposer | None:
    """The engine-side proposer for `spec` (None for a draft model: it runs on the workers)."""
    if spec.method == "ngram":
        from heterollm.spec_decode.ngram import NgramProposer

        return NgramProposer(spec.ngram_min, spec.ngram_max)
    if spec.method == "Suffix":
        from heterollm.spec_decode.suffix import SuffixProposer

        return SuffixProposer(spec.suffix_max_depth, spec.suffix_max_cached_requests, spec.suffix_max_spec_factor,
                              spec.suffix_min_token_prob)
    return None


__all__ = ["Proposer", "SpecConfig", "check_spec_support", "make_proposer", "resolve_spec"]
