"""What one forward step carries from the model runner through a GraphRunner into the model."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from heterollm.interfaces.attention import AttentionBackend, AttentionMetadata


@dataclass
class ForwardContext:
    """Per-step state every attention layer reads: the backend, its metadata, the caches."""

    backend: AttentionBackend
    metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]
    """One tensor of `backend.kv_cache_shape(...)` per layer."""


@dataclass
class StepInputs:
    """One step's model inputs."""

    input_ids: torch.Tensor
    """(num_tokens,) the new tokens of every sequence, flattened in sequence order."""
    positions: torch.Tensor
    """(num_tokens,) each token's position in its sequence; (3, num_tokens) temporal / height / width
    positions (M-RoPE) for a step computing a vision-language model's image-bearing prompt."""
    ctx: ForwardContext
    inputs_embeds: torch.Tensor | None = None
    """(num_tokens, hidden): the input embeddings, image placeholders replaced by the vision
    encoder's outputs, when the step holds image tokens (the model skips its embedding lookup);
    such steps, like those with (3, num_tokens) positions, run eagerly, never through a graph."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


StepForward = Callable[[StepInputs], "torch.Tensor"]
"""The model's forward over one step: (num_tokens, hidden) out."""

DecodeInputs = Callable[[int], StepInputs]
"""`make_inputs(n)`: a decode-only step of n sequences over the real caches, block tables as wide as
any step's, writing only slots no request owns yet (a graph runner captures from it at start-up)."""
