"""Limits on admitting new prefills, from the two flag tables (all off by default in the class; the
engine fills them from the flags, whose defaults are on):

- xLLM `--prefill_scheduling_memory_usage_threshold` U (default 0.95): while at least a fraction U
  of the KV cache's blocks is in use, no waiting request starts (running decodes keep the rest).
- FastDeploy `--kv_cache_ratio` R (default 0.75) and `--static_decode_blocks` S (default 2): a
  request's prefill footprint is its prompt's blocks plus S blocks set aside for its decode (a
  running request counts the blocks it holds, up to that); the footprints of the running requests
  and the one being admitted may take at most R of the cache's blocks, the rest is left to decodes
  growing.
- FastDeploy `--max_num_partial_prefills` P and `--max_long_partial_prefills` L (default 1 and 1)
  with `--long_prefill_token_threshold` T (default 4% of max_model_len): with chunked prefill, at
  most P requests are part way through their prompt at once (a prompt that completes within the
  step it starts in does not count), at most L of them with prompts over T tokens; a waiting
  request that would be one more is passed over for shorter ones behind it that complete.

Each limit yields when nothing is running, so a lone request is never held back by them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillLimits:
    memory_usage_threshold: float = 1.0
    """No admission while this fraction of blocks (or more) is in use (1.0: never held)."""
    prefill_block_ratio: float = 1.0
    """Running requests' prefill footprints may take at most this fraction of the blocks."""
    static_decode_blocks: int = 0
    """Blocks each request's footprint sets aside for its decode."""
    max_partial: int | None = None
    """Requests part way through a chunked prompt at once (None: no limit)."""
    max_long_partial: int | None = None
    long_threshold: int = 0
    """Prompts over this many tokens are long (for max_long_partial)."""

    @property
    def splits_cache(self) -> bool:
        """Whether the prefill share binds (a ratio below 1, or blocks set aside for decodes)."""
        return self.prefill_block_ratio < 1 or self.static_decode_blocks > 0

    def footprint(self, num_prompt_tokens: int, block_size: int) -> int:
        """Blocks a request's prefill takes from the prefill share: its prompt's, plus its decode's set-aside."""
        return -(-num_prompt_tokens // block_size) + self.static_decode_blocks

    def is_long(self, num_prompt_tokens: int) -> bool:
        return num_prompt_tokens > self.long_threshold

    def partial_allowed(self, partial: int, long_partial: int, long: bool) -> bool:
        """Whether one more request may be left part way through its prompt."""
        if self.max_partial is not None and partial >= self.max_partial:
            return False
        return not (long and self.max_long_partial is not None and long_partial >= self.max_long_partial)


def prefill_limits(config, max_model_len: int) -> PrefillLimits:
    """The limits the flags ask for (FastDeploy's partial-prefill limits only with chunked prefill)."""
    fd, sched = config.fastdeploy, config.scheduler
    chunked = sched.enable_chunked_prefill
    threshold = fd.long_prefill_token_threshold or max(1, int(max_model_len * 0.04))
    return PrefillLimits(sched.prefill_scheduling_memory_usage_threshold, fd.kv_cache_ratio, fd.static_decode_blocks,
                         fd.max_num_partial_prefills if chunked else None,
                         fd.max_long_partial_prefills if chunked else None, threshold)
