"""Verification of one sequence's drafts against the target's distribution.

The target scored k + 1 positions in one forward: row j predicts the token after draft j - 1 (row 0:
after the sequence's last known token). Greedy keeps drafts while each equals the row's argmax and
then takes the argmax of the first row that disagrees (or of the last row): exactly what k + 1
greedy steps without speculation give. Sampling follows Leviathan et al. / Chen et al.: draft d_j,
proposed with probability q_j(d_j), is accepted with probability min(1, p_j(d_j) / q_j(d_j)); on
the first rejection the token is drawn from max(p_j - q_j, 0) normalized; when every draft is
accepted a bonus token is drawn from p_k. Each emitted token is then distributed as p. A proposer
that drafts deterministically (suffix, n-gram, a greedy draft model) has a one-hot q.
"""
from __future__ import annotations

import torch

from heterollm.sampling.params import SamplingParams
from heterollm.sampling.sampler import draw, sampling_probs


def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams, generator: torch.Generator | None,
           draft_probs: torch.Tensor | None = None) -> list[int]:
    """The tokens the sequence takes: the accepted drafts and one token of the target's own.

    `logits`: (k + 1, vocab) fp32, already through the request's logits processors and penalties
    (row j with the drafts before it counted as output); `draft_probs`: (k, vocab) the distributions
    the drafts were sampled from, None for deterministic drafts. Draws use `generator` (None: the
    global one), so a seeded request verifies reproducibly."""
    k = len(drafts)
    if params.greedy:
        best = logits.argmax(-1).tolist()
        accepted = 0
        while accepted < k and best[accepted] == drafts[accepted]:
            accepted += 1
        return drafts[:accepted] + [best[accepted]]
    p = sampling_probs(logits, [params] * (k + 1))
    device = p.device
    index = torch.tensor(drafts, dtype=torch.long, device=device)
    rows = torch.arange(k, device=device)
    p_draft = p[rows, index]
    q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs[rows, index].to(p.dtype)
    u = torch.rand(k, generator=generator, device=device, dtype=p.dtype) if k else p_draft
    # accept while u * q <= p (probability min(1, p / q)); q > 0 for a token that was proposed
    ok = (u * q_draft <= p_draft).tolist()
    accepted = next((j for j, good in enumerate(ok) if not good), k)
    if accepted == k:
        return drafts + [int(draw(p[k:], [generator])[0])]
    q_row = (torch.nn.functional.one_hot(index[accepted], p.shape[-1]).to(p.dtype) if draft_probs is None
             else draft_probs[accepted].to(p.dtype))
    residual = (p[accepted] - q_row).clamp(min=0)
    if float(residual.sum()) <= 0:  # p == q on the support: any draw from p is right
        residual = p[accepted]
    return drafts[:accepted] + [int(draw((residual / residual.sum()).unsqueeze(0), [generator])[0])]


def verify_tree(logits: torch.Tensor, drafts: list[int], parents: list[int], params: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], list[int]]:
    """Tree speculation: (the tokens taken, the row of `logits` each was drawn from).

    `logits` row 0 follows the sequence's last known token, row i + 1 follows draft i; `parents[i]`
    is draft i's parent (-1: the last known token). From the root, greedy moves to the child holding
    the row's argmax while there is one. Sampling tries the node's children in order, each accepted
    with probability r(child) under the residual r (p at first; a rejected child's token is removed
    and r renormalized: multi-draft rejection sampling with one-hot proposals, which keeps p); when
    every child is rejected the token is drawn from r. Children hold distinct tokens."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i)
    tokens: list[int] = []
    rows: list[int] = []
    node = -1
    while True:
        row = node + 1
        rows.append(row)
        kids = children.get(node, [])
        if params.greedy:
            best = int(logits[row].argmax())
            tokens.append(best)
            node = next((c for c in kids if drafts[c] == best), None)
            if node is None:
                return tokens, rows
            continue
        residual = sampling_probs(logits[row:row + 1], [params])[0]
        chosen = None
        for c in kids:
            u = float(torch.rand(1, generator=generator, device=residual.device, dtype=residual.dtype))
            if u < float(residual[drafts[c]]):
                chosen = c
                break
            left = residual.clone()
            left[drafts[c]] = 0
            if float(left.sum()) > 0:
                residual = left / left.sum()
        if chosen is None:
            tokens.append(int(draw(residual.unsqueeze(0), [generator])[0]))
            return tokens, rows
        tokens.append(drafts[chosen])
        node = chosen
