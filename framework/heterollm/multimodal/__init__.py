"""Multimodal input: images a request carries beside its prompt.

A user's image (an OpenAI `image_url` part, or `multi_modal_data` offline) is loaded by `media.py`,
turned into pixel patches by transformers' own image processor for the family (`processor.py`),
and stands in the prompt as a run of placeholder tokens, one per merged patch. The engine keeps one
`MultiModalItem` per image with the request; the scheduler hands a request's items to the runner
while its prompt is being computed, and the runner (`model_executor/mm_encoder.py`) runs the vision
encoder, batched across the step's requests, and puts its outputs where the placeholders are.

The prefix cache names an image's placeholder tokens by the image's content hash
(`cache_token_ids`), so the same image and text hit the cache and a different image never does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import torch


@dataclass
class MultiModalItem:
    """One image of a request, preprocessed."""

    modality: str
    """"image" (the only one served yet)."""
    hash: str
    """Content hash (hex XXH3-128) of what the encoder sees: the processed pixels and their grid."""
    offset: int
    """Index in the prompt of the item's first placeholder token."""
    length: int
    """Placeholder tokens it fills (one per merged patch: t * h * w / merge^2)."""
    grid_thw: tuple[int, int, int]
    """Patches in time, height and width, as the processor reports them."""
    pixel_values: torch.Tensor
    """(t * h * w, channels * temporal_patch * patch^2) float32 patches, as the processor flattens them."""

    @property
    def end(self) -> int:
        return self.offset + self.length

    def to_wire(self) -> dict[str, Any]:
        """Plain types for the engine-core IPC (msgpack): the pixels as raw float32 bytes."""
        pv = self.pixel_values.float().contiguous()
        return {"modality": self.modality, "hash": self.hash, "offset": self.offset, "length": self.length,
                "grid_thw": list(self.grid_thw), "shape": list(pv.shape), "pixels": pv.numpy().tobytes()}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> MultiModalItem:
        import numpy as np
        import torch

        pixels = torch.from_numpy(np.frombuffer(data["pixels"], dtype=np.float32).copy()).view(*data["shape"])
        return cls(data["modality"], data["hash"], data["offset"], data["length"], tuple(data["grid_thw"]), pixels)


def cache_token_ids(token_ids: Sequence[int], items: Sequence[MultiModalItem]) -> list[int]:
    """The tokens the prefix cache hashes: `token_ids` with each item's placeholders replaced by a
    negative id drawn from its content hash (never a real token id), so a block holding part of an
    image is named by that image."""
    out = list(token_ids)
    for item in items:
        key = -1 - (int(item.hash[:15], 16))
        out[item.offset:item.end] = [key] * item.length
    return out


__all__ = ["MultiModalItem", "cache_token_ids"]
