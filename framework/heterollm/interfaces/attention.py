"""AttentionBackend: paged attention over the KV cache (entry-point group `heterollm.attention`)."""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from heterollm.interfaces.component import Component

if TYPE_CHECKING:
    import torch


@dataclass
class AttentionInputs:
    """Per-step batch layout handed to `build_metadata`, as plain Python lists (one entry per sequence).

    The new tokens of all sequences are flattened in sequence order: sequence i owns
    `query_lens[i]` consecutive tokens. Prefill, chunked prefill and decode differ only in counts.
    """

    query_lens: list[int]
    """Tokens computed for each sequence this step (1 for a decode)."""
    context_lens: list[int]
    """Tokens of each sequence already in the KV cache before this step."""
    block_tables: list[list[int]]
    """Block ids of each sequence, in order; covers context_lens + query_lens slots."""
    block_size: int


@dataclass
class AttentionMetadata:
    """What `forward` needs for one step; built once per step, shared by every layer."""

    num_tokens: int
    slot_mapping: torch.Tensor
    """(num_tokens,) flat cache slot (block_id * block_size + offset) for each new token."""
    query_start_loc: torch.Tensor
    """(num_seqs + 1,) start offset of each sequence's new tokens."""
    seq_lens: torch.Tensor
    """(num_seqs,) context length after this step (context_lens + query_lens)."""
    block_tables: torch.Tensor
    """(num_seqs, max_blocks) block ids, padded with 0 past each sequence's blocks."""
    query_lens: list[int]
    context_lens: list[int]


class AttentionBackend(Component):
    """Writes new K/V into cache slots and attends over each sequence's cached blocks, for a mixed
    batch of prefill chunks and decodes in one call."""

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor (K and V together)."""

    @abstractmethod
    def build_metadata(self, inputs: AttentionInputs, device: torch.device) -> AttentionMetadata:
        """Tensors for this step's attention, on `device`."""

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal paged attention.

        query: (num_tokens, num_heads, head_dim); key, value: (num_tokens, num_kv_heads, head_dim);
        kv_cache: this layer's tensor of `kv_cache_shape`. Returns (num_tokens, num_heads, head_dim).

        Every sequence's new K/V must be in the cache before any sequence of the step reads it: a
        sequence's context may include blocks another sequence of the same step is computing (the
        prefix cache shares them within a batch). Blocks shared between tables are only read.
        """
