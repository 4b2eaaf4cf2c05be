"""AttentionBackend: paged attention over the KV cache (a backend's `components["attention"]`)."""
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
    """Block ids of each sequence, in order: the blocks holding its first context_lens + query_lens
    slots, no more (a block past them may hold anything, NaN included)."""
    block_size: int
    tree_parents: list[list[int] | None] | None = None
    """Speculative decoding's tree verification (only for a backend whose `supports_tree_attention()`):
    per sequence None (causal, as always), or for each of its new tokens the index of its parent
    among them (-1: none). New token t then attends to the cached context, to itself and to its
    ancestors only, not to every new token before it. Slots still follow the tokens' order
    (token t in slot context_lens + t); the model's positions (RoPE) are the caller's."""

    @property
    def num_decode_tokens(self) -> int:
        """Tokens of the decodes: sequences adding exactly one token after a cached context."""
        return sum(1 for q, c in zip(self.query_lens, self.context_lens) if q == 1 and c > 0)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of every other sequence (a prompt, or a prefill chunk over cached context)."""
        return sum(self.query_lens) - self.num_decode_tokens


@dataclass
class AttentionMetadata:
    """What `forward` needs for one step; built once per step, shared by every layer.

    Graph runners read only the fields declared here. A backend's subclass may add what its own
    kernels need (gather plans, host-side arguments); a field a graph runner must keep in static
    buffers belongs here, not there.
    """

    num_tokens: int
    slot_mapping: torch.Tensor
    """(num_tokens,) flat cache slot (block_id * block_size + offset) for each new token."""
    query_start_loc: torch.Tensor
    """(num_seqs + 1,) start offset of each sequence's new tokens."""
    seq_lens: torch.Tensor
    """(num_seqs,) context length after this step (context_lens + query_lens)."""
    block_tables: torch.Tensor
    """(num_seqs, max_blocks) block ids; each row padded past its sequence's blocks with block ids
    of the backend's choice (attention never reads a padded column within seq_lens)."""
    query_lens: list[int]
    context_lens: list[int]
    block_size: int
    """Slots per cache block (slot = block_id * block_size + offset)."""
    num_prefill_tokens: int
    """Tokens of sequences that are not decodes (AttentionInputs.num_prefill_tokens)."""
    num_decode_tokens: int
    """Tokens of decodes, one per sequence (AttentionInputs.num_decode_tokens)."""

    @property
    def decode_only(self) -> bool:
        """Every sequence adds one token after a cached context: the step a graph runner may replay.
        A backend serves it without host synchronization (graph-capturable)."""
        return self.num_prefill_tokens == 0 and self.num_decode_tokens > 0

    def dynamic_dims(self) -> list[tuple[torch.Tensor, int]]:
        """(tensor, dim) pairs of this metadata whose size changes from one decode-only step to the
        next, beyond the batch dimension of the declared fields; a compiling graph runner (CPU's
        torch.compile) treats them as symbols rather than specializing on them. Default: none."""
        return []


class AttentionBackend(Component):
    """Writes new K/V into cache slots and attends over each sequence's cached blocks, for a mixed
    batch of prefill chunks and decodes in one call. It owns the cache layout, including any
    scratch block a graph runner pads batches onto."""

    cache_block_dim: int = 2
    """The dimension of a `kv_cache_shape` (and `mla_cache_shape`, `quantized_kv_cache_shape`) tensor
    that indexes blocks: a KV connector moves block b of a layer as `cache.select(cache_block_dim, b)`
    (scales of a quantized cache with it). The default is the
    core's layouts' (2, kv heads, blocks, block size, head dim); a layout with blocks first sets 0."""

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor (K and V together) holding `num_blocks` blocks for
        sequences, plus any scratch block of its own."""

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: str) -> bool:
        """Whether this backend stores K/V quantized as `kv_cache_dtype` (--kv_cache_dtype; "auto", the
        model's dtype through `kv_cache_shape`, is served by every backend). For "int8", K and V of each
        token and KV head are held as int8 with a float scale of their own (symmetric absmax); how the
        values and scales are laid out is the backend's (`quantized_kv_cache_shape`). False for anything
        but "auto" (the default): the launch is refused with that reason. A latent (MLA) cache stays in
        the model dtype whatever this says: a launch of an MLA model with int8 is refused."""
        return kv_cache_dtype == "auto"

    def quantized_kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                                 kv_cache_dtype: str) -> tuple[int, ...]:
        """Shape of one layer's cache tensor of element type `getattr(torch, kv_cache_dtype)` (only where
        `supports_kv_cache_dtype(kv_cache_dtype)`): the quantized K and V and their scales together in one
        tensor, so the runner, graph runners and block copies keep handling one tensor per layer and
        the block count follows its bytes (scales included). `forward` then gets that tensor as
        `kv_cache`, knows it by its dtype, quantizes the new K/V on write and dequantizes on read."""
        raise NotImplementedError(f"{type(self).__name__} does not implement a quantized KV cache")

    def scratch_block(self, kv_cache: torch.Tensor) -> int | None:
        """Id of a block outside `num_blocks` that no sequence owns: a graph runner writes a padded
        row's K/V there and points its block table at it. None (the default): the layout has
        none, and a graph runner replays only batches that fill a captured bucket exactly."""
        return None

    @abstractmethod
    def build_metadata(self, inputs: AttentionInputs, device: torch.device) -> AttentionMetadata:
        """Tensors for this step's attention, on `device`."""

    @classmethod
    def supports_sliding_window(cls) -> bool:
        """Whether `forward` honours `sliding_window`. False (the default): a launch whose model has a
        sliding-window layer (Mistral, Gemma 2/3, ...) is refused with that reason, so `forward` is
        never asked for a window."""
        return False

    @classmethod
    def supports_tree_attention(cls) -> bool:
        """Whether `build_metadata` honours `AttentionInputs.tree_parents`. False (the default):
        tree speculation (--speculative_suffix_use_tree_spec) is refused at launch with that reason."""
        return False

    @classmethod
    def supports_logit_softcap(cls) -> bool:
        """Whether `forward` honours `logit_softcap` (Gemma 2's attn_logit_softcapping). False (the
        default): such a model is refused at launch with that reason."""
        return False

    @classmethod
    def supports_mla(cls) -> bool:
        """Whether `mla_cache_shape` and `forward_mla` are implemented: multi-head latent attention
        (DeepSeek-V2 / V3, Kimi-K2) with its compressed cache. False (the default): such a model is
        refused at launch with that reason."""
        return False

    def mla_cache_shape(self, num_blocks: int, block_size: int, latent_dim: int) -> tuple[int, ...]:
        """Shape of one layer's latent cache (only where `supports_mla()`): `latent_dim` values per
        token (the normalized compressed KV, then the rotated shared key part), no heads, no V plane."""
        raise NotImplementedError(f"{type(self).__name__} does not implement MLA attention")

    def forward_mla(self, query: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor,
                    metadata: AttentionMetadata, scale: float, value_dim: int) -> torch.Tensor:
        """Causal paged attention over a latent cache, in the absorbed form: every query head attends
        to one shared key per token, the token's latent, and reads its first `value_dim` features as
        the value (only where `supports_mla()`).

        query: (num_tokens, num_heads, latent_dim), the heads' queries already mapped into the latent
        space; latent: (num_tokens, latent_dim), written to the step's slots first (the same
        ordering rule as `forward`); kv_cache: this layer's tensor of `mla_cache_shape`. Returns
        (num_tokens, num_heads, value_dim): softmax(scale * q . latent) @ latent[:, :value_dim] over
        each token's causal context, as `forward` computes it (draft trees included where
        `supports_tree_attention()`)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement MLA attention")

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, sliding_window: int | None = None,
                logit_softcap: float | None = None) -> torch.Tensor:
        """Causal paged attention.

        query: (num_tokens, num_heads, head_dim); key, value: (num_tokens, num_kv_heads, head_dim);
        kv_cache: this layer's tensor of `kv_cache_shape` (or of `quantized_kv_cache_shape` under
        --kv_cache_dtype). Returns (num_tokens, num_heads, head_dim).
        `sliding_window` W (only where `supports_sliding_window()`): the query at position p attends
        to keys at positions p - W + 1 .. p, as transformers' sliding-window mask; None: to all.
        `logit_softcap` c (only where `supports_logit_softcap()`): scores s = scale * q.k become
        c * tanh(s / c) before the mask and softmax.

        Every sequence's new K/V must be in the cache before any sequence of the step reads it: a
        sequence's context may include blocks another sequence of the same step is computing (the
        prefix cache shares them within a batch). Blocks shared between tables are only read.
        """
