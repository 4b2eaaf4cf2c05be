"""The model runner's multimodal half, for a vision-language model (one with `encode_images`):

- the vision encoder runs in the step that first reaches an image's placeholder tokens, once for
  every image the step needs, batched across its requests; its outputs replace the placeholders'
  embeddings (`StepInputs.inputs_embeds`);
- an encoder cache (`--max_encoder_cache_size` MB per worker; 0: none) keeps outputs by image
  hash, so a prompt chunked across an image, a request preempted and recomputed, or another request
  with the same image does not encode it again;
- M-RoPE positions: the prompt's (3, L) positions come from the model (`mrope_positions`) when the
  request is first seen; tokens after the prompt are at index + delta, one position for all three
  rotary sections (so decode steps stay 1-D and graph-capturable);
- `--enable_mm_encoder_dp`: under tensor parallelism each rank encodes every tp-th image and the
  outputs are all-gathered, instead of every rank encoding every image.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import replace
from typing import Any

import torch

from heterollm.interfaces import ScheduledRequest, StepInputs
from heterollm.model_executor.parallel import ParallelContext

logger = logging.getLogger("heterollm.runner")


class MultiModalRunner:
    def __init__(self, model: Any, cache_bytes: int, pctx: ParallelContext, encoder_dp: bool) -> None:
        self.model = model
        self.cache_bytes = cache_bytes
        self.pctx = pctx
        self.encoder_dp = encoder_dp and pctx.tp_size > 1
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        """Image hash -> its placeholder embeddings, least recently used first."""
        self.cached_bytes = 0
        self.rope: dict[str, tuple[torch.Tensor, int]] = {}
        """Request -> (its prompt's (3, L) positions, the offset of later tokens)."""
        self.images_encoded = 0
        """Images this worker ran the encoder on (this rank's share under --enable_mm_encoder_dp)."""
        self.cache_hits = 0
        """Images a step needed that the encoder cache held."""

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.rope.pop(request_id, None)

    def prepare(self, reqs: list[ScheduledRequest], inputs: StepInputs) -> StepInputs:
        """The step's inputs with M-RoPE positions and the images' embeddings, where it has any."""
        positions = self._positions(reqs, inputs.positions)
        embeds = self._embeds(reqs, inputs.input_ids)
        if positions is inputs.positions and embeds is None:
            return inputs
        return replace(inputs, positions=positions, inputs_embeds=embeds)

    # -- positions ---------------------------------------------------------------------------
    def _positions(self, reqs: list[ScheduledRequest], flat: torch.Tensor) -> torch.Tensor:
        """`flat` (the step's 1-D positions) mapped through each multimodal request's M-RoPE: (3, T)
        when some token is a prompt token of such a request, else 1-D with the deltas added."""
        spans = []  # (step offset, tokens, prompt positions, delta)
        first = 0
        for r in reqs:
            n = len(r.new_token_ids)
            state = self._rope_state(r)
            if state is not None:
                spans.append((first, n, *state))
            first += n
        if not spans:
            return flat
        three = any(int(flat[a:a + n].min()) < pos.shape[1] for a, n, pos, _ in spans)
        out = flat.expand(3, -1).clone() if three else flat.clone()
        for a, n, pos, delta in spans:
            p = flat[a:a + n]
            inside = p < pos.shape[1]
            if three:
                mapped = (p + delta).expand(3, -1).clone()
                mapped[:, inside] = pos[:, p[inside]].to(mapped.device)
                out[:, a:a + n] = mapped
            else:
                out[a:a + n] = p + delta
        return out

    def _rope_state(self, r: ScheduledRequest) -> tuple[torch.Tensor, int] | None:
        state = self.rope.get(r.request_id)
        if state is None and r.mm_items:
            spans = [(item.offset, item.grid_thw) for item in r.mm_items]
            state = self.rope[r.request_id] = self.model.mrope_positions(len(r.prompt_token_ids), spans)
        return state

    # -- embeddings --------------------------------------------------------------------------
    def _embeds(self, reqs: list[ScheduledRequest], input_ids: torch.Tensor) -> torch.Tensor | None:
        """Input embeddings with the step's image placeholders filled in, or None when the step
        computes no image token."""
        uses = []  # (step row, item, first placeholder index, last + 1)
        first = 0
        for r in reqs:
            start, n = r.num_computed_tokens, len(r.new_token_ids)
            for item in r.mm_items or ():
                a, b = max(start, item.offset), min(start + n, item.end)
                if a < b:
                    uses.append((first + a - start, item, a - item.offset, b - item.offset))
            first += n
        if not uses:
            return None
        outputs = self._encode([item for _, item, _, _ in uses])
        embeds = self.model.embed_input_ids(input_ids)
        for row, item, a, b in uses:
            embeds[row:row + b - a] = outputs[item.hash][a:b].to(embeds.dtype)
        return embeds

    def _encode(self, items: list[Any]) -> dict[str, torch.Tensor]:
        """Every distinct image's embeddings: from the cache, else from one encoder pass over all the
        missing ones (split over the tensor-parallel ranks under --enable_mm_encoder_dp)."""
        found: dict[str, torch.Tensor] = {}
        missing: dict[str, Any] = {}
        for item in items:
            if item.hash in found or item.hash in missing:
                continue
            hit = self.cache.get(item.hash)
            if hit is not None:
                self.cache.move_to_end(item.hash)
                self.cache_hits += 1
                found[item.hash] = hit
            else:
                missing[item.hash] = item
        if missing:
            todo = list(missing.values())
            outs = self._encode_dp(todo) if self.encoder_dp else self._run_encoder(todo)
            for item, out in zip(todo, outs):
                found[item.hash] = out
                self._keep(item.hash, out)
        return found

    def _run_encoder(self, items: list[Any]) -> list[torch.Tensor]:
        if not items:
            return []
        device = next(self.model.parameters()).device
        pixels = torch.cat([item.pixel_values for item in items]).to(device)
        self.images_encoded += len(items)
        return self.model.encode_images(pixels, [item.grid_thw for item in items])

    def _encode_dp(self, items: list[Any]) -> list[torch.Tensor]:
        """Rank r encodes items r, r + tp, ...; one all-gather of the padded outputs gives every rank all."""
        tp, rank = self.pctx.tp_size, self.pctx.tp_rank
        lengths = [item.length for item in items]
        shares = [list(range(r, len(items), tp)) for r in range(tp)]
        rows = max(sum(lengths[i] for i in share) for share in shares)
        mine = self._run_encoder([items[i] for i in shares[rank]])
        hidden = int(self.model.config.hidden_size)
        local = torch.zeros(rows, hidden, dtype=next(self.model.parameters()).dtype,
                            device=next(self.model.parameters()).device)
        if mine:
            got = torch.cat(mine)
            local[:got.shape[0]] = got
        gathered = self.pctx.all_gather(local, 0).view(tp, rows, hidden)
        out: list[torch.Tensor | None] = [None] * len(items)
        for r, share in enumerate(shares):
            at = 0
            for i in share:
                out[i] = gathered[r, at:at + lengths[i]]
                at += lengths[i]
        return out  # type: ignore[return-value]

    def _keep(self, key: str, out: torch.Tensor) -> None:
        size = out.numel() * out.element_size()
        if size > self.cache_bytes:
            return
        self.cache[key] = out
        self.cached_bytes += size
        while self.cached_bytes > self.cache_bytes:
            _, old = self.cache.popitem(last=False)
            self.cached_bytes -= old.numel() * old.element_size()
