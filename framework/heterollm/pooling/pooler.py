"""The runner's pooler: from each pooling request's share of a step's final hidden states (after the
model's last norm) to its pooled output, once its last prompt chunk has run. A prompt split into
chunks keeps a running sum (MEAN) or its first position (CLS) here between steps; a chunk that starts
at position 0 (a new request, or one recomputed after a preemption) starts over."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from heterollm.interfaces import ScheduledRequest
from heterollm.pooling.params import PoolingParams, PoolingType


@dataclass
class _Partial:
    total: torch.Tensor | None = None
    """(hidden,) fp32: the sum (MEAN) or the first position (CLS) so far."""
    count: int = 0


class Pooler:
    def __init__(self, compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.compute_logits = compute_logits
        self.partial: dict[str, _Partial] = {}

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.partial.pop(request_id, None)

    def __call__(self, reqs: list[ScheduledRequest], hidden: torch.Tensor,
                 ends: list[int]) -> list[torch.Tensor | None]:
        """hidden: (num_tokens, hidden) for the whole step; ends[i]: where request i's tokens end.
        Per request: its pooled output on the CPU, fp32 (None: not pooling, or not finished)."""
        out: list[torch.Tensor | None] = [None] * len(reqs)
        for i, r in enumerate(reqs):
            if r.pooling is None:
                continue
            rows = hidden[ends[i] - len(r.new_token_ids):ends[i]]  # (chunk, hidden)
            if r.pooling.task == "score":
                if r.sample:
                    out[i] = score(self.compute_logits(rows[-1:]), r.pooling)
                continue
            pooled = self._accumulate(r, rows)
            if r.sample:
                out[i] = embed(pooled, r.pooling)
        return out

    def _accumulate(self, r: ScheduledRequest, rows: torch.Tensor) -> torch.Tensor:
        """(hidden,) fp32: the request's pooled hidden state so far."""
        kind = r.pooling.pooling_type
        if kind is PoolingType.LAST:
            return rows[-1].float()
        part = self.partial.get(r.request_id)
        if part is None or r.num_computed_tokens == 0:
            part = self.partial[r.request_id] = _Partial()
        if kind is PoolingType.CLS:
            if r.num_computed_tokens == 0:
                part.total, part.count = rows[0].float(), 1
        else:
            chunk = rows.float().sum(0)
            part.total = chunk if part.total is None else part.total + chunk
            part.count += rows.shape[0]
        if r.sample:
            del self.partial[r.request_id]
        return part.total / part.count


def embed(pooled: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """Matryoshka truncation first, then L2 normalization (vLLM's order)."""
    if params.dimensions is not None:
        pooled = pooled[: params.dimensions]
    if params.normalize:
        pooled = torch.nn.functional.normalize(pooled, dim=-1)
    return pooled.cpu()


def score(logits: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """(1,) the relevance probability from the last position's logits (1, vocab or num_labels)."""
    logits = logits[0].float()
    if params.score_token_ids is not None:
        probs = logits[list(params.score_token_ids)].softmax(-1)
        return probs[-1:].cpu()
    return logits.sigmoid().cpu()
