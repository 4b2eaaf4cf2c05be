"""Turn a step's logits into tokens: penalties, temperature, top-k / top-p / min-p, seeded sampling,
and logprobs (of the model's own distribution, before any of those transforms)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from heterollm.interfaces import TokenLogprobs
from heterollm.model_executor import ops
from heterollm.sampling.params import SamplingParams


@dataclass
class SamplingRow:
    """One row of the logits to sample: the request's params, generator and history."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition (prompt + output, CTRL-style), presence and frequency (output only), in place.
    Every tensor it builds lives on `logits.device`."""
    vocab, device = logits.shape[-1], logits.device
    for i, row in enumerate(rows):
        p = row.params
        if not p.has_penalties:
            continue
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.long,
                                device=device)
            if seen.numel():
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
            counts = torch.bincount(torch.tensor(row.output_token_ids, dtype=torch.long, device=device),
                                    minlength=vocab)[:vocab]
            counts = counts.to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _banned_tokens(row: SamplingRow, vocab: int) -> list[int]:
    """One row's tokens banned at this step: the last token of each bad word whose other tokens end
    the output (a one-token word: always), and the stop tokens while min_tokens is not reached."""
    p, out = row.params, row.output_token_ids
    banned = [word[-1] for word in p.bad_words_token_ids
              if len(word) == 1 or out[1 - len(word):] == word[:-1]]
    if len(out) < p.min_tokens:
        banned += p.all_stop_token_ids
    return [t for t in banned if t < vocab]


def apply_logits_processors(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """allowed_token_ids, bad_words and min_tokens as masks to -inf, then logit_bias added, for the
    whole batch `logits` (rows, vocab): the (row, token) index lists are gathered per row, then one
    masked_fill and one index_put. Returns a new tensor (the input is left as it is); every tensor
    it builds lives on `logits.device`."""
    todo = [i for i, r in enumerate(rows) if r.params.has_logits_processors]
    if not todo:
        return logits
    vocab, device = logits.shape[-1], logits.device
    restricted: list[int] = []
    allow: tuple[list[int], list[int]] = ([], [])
    ban: tuple[list[int], list[int]] = ([], [])
    bias: tuple[list[int], list[int], list[float]] = ([], [], [])
    for i in todo:
        p = rows[i].params
        if p.allowed_token_ids is not None:
            restricted.append(i)
            allow[0].extend([i] * len(p.allowed_token_ids))
            allow[1].extend(p.allowed_token_ids)
        banned = _banned_tokens(rows[i], vocab)
        ban[0].extend([i] * len(banned))
        ban[1].extend(banned)
        for token, value in (p.logit_bias or {}).items():
            bias[0].append(i)
            bias[1].append(token)
            bias[2].append(value)

    def index(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    if restricted or ban[0]:
        # mask: (rows, vocab), True where the token may not be sampled
        mask = torch.zeros(logits.shape, dtype=torch.bool, device=device)
        if restricted:
            mask[index(restricted)] = True
            mask[index(allow[0]), index(allow[1])] = False
        if ban[0]:
            mask[index(ban[0]), index(ban[1])] = True
        logits = logits.masked_fill(mask, float("-inf"))
    if bias[0]:
        logits = logits.index_put((index(bias[0]), index(bias[1])),
                                  torch.tensor(bias[2], dtype=logits.dtype, device=device), accumulate=True)
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k (0 = off), outside the top-p nucleus, or below
    min_p * p(max). Row-wise parameters; always keeps each row's best token."""
    vocab = logits.shape[-1]
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
        kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if bool((top_p < 1).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly above each token
        drop_sorted = before >= top_p.unsqueeze(1)
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if bool((min_p > 0).any()):
        probs = logits.softmax(-1)
        floor = probs.max(-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def gather_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """Chosen token's logprob and rank plus the top-n alternatives, for each row."""
    out = []
    k = max(num_top, default=0)
    top = logprobs.topk(k, dim=-1) if k else None
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen_lp.unsqueeze(1)).sum(-1) + 1
    for i in range(logprobs.shape[0]):
        alts = []
        if top is not None and num_top[i]:
            alts = [(t, v) for t, v in zip(top.indices[i, : num_top[i]].tolist(), top.values[i, : num_top[i]].tolist())
                    if v != float("-inf")]  # a token the grammar forbids is no alternative
        out.append(TokenLogprobs(int(chosen[i]), float(chosen_lp[i]), int(ranks[i]), alts))
    return out


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set to -inf every token a row's grammar forbids. `bitmask` (rows, words) int32, packed as
    xgrammar packs it: bit j of word w allows token 32w + j (a row of -1 allows everything; tokens
    past the mask's width are forbidden). Torch ops only, on `logits.device`."""
    rows, vocab = logits.shape
    device = logits.device
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (bitmask.to(device=device, dtype=torch.int32).unsqueeze(-1) >> shifts) & 1  # (rows, words, 32)
    allowed = bits.flatten(1).bool()
    if allowed.shape[1] >= vocab:
        allowed = allowed[:, :vocab]
    else:
        allowed = torch.cat([allowed, allowed.new_zeros(rows, vocab - allowed.shape[1])], 1)
    return logits.masked_fill(~allowed, float("-inf"))


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: its logits over the temperature, restricted by top-k /
    top-p / min-p, softmaxed (rows, vocab). Every tensor it builds lives on `logits.device`."""
    device, dtype = logits.device, logits.dtype
    temps = torch.tensor([p.temperature for p in params], dtype=dtype, device=device).unsqueeze(1)
    logits = apply_top_k_top_p_min_p(
        logits / temps,
        torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
        torch.tensor([p.top_p for p in params], dtype=dtype, device=device),
        torch.tensor([p.min_p for p in params], dtype=dtype, device=device))
    return logits.softmax(-1)


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of `probs` (rows, vocab), each row drawn with its own generator (None: the
    global one): the exponential race argmax(p / E), E ~ Exp(1), samples from p."""
    noise = torch.empty_like(probs)
    for j, generator in enumerate(generators):
        noise[j].exponential_(generator=generator)
    return (probs / noise).argmax(-1)


def sample_rows(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One token per row of `logits` (rows, vocab): temperature, top-k / top-p / min-p, then a draw
    with each row's own generator. Every tensor it builds lives on `logits.device`."""
    return draw(sampling_probs(logits, [r.params for r in rows]), [r.generator for r in rows])


class Sampler:
    """Turns a step's logits (rows, vocab), on any device, into one token per row plus the
    logprobs each row asked for."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 bitmask: torch.Tensor | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
        """`bitmask`: the rows' packed grammar masks (structured output), or None; reported
        logprobs are those of the constrained distribution, as vLLM reports them."""
        if bitmask is None and all(plain_greedy(r) for r in rows):
            # the greedy fast path: the op registry's argmax on the logits as they are (a backend's
            # reads bf16 directly), no fp32 copy, masks or per-row work
            return ops.get("argmax")(logits).tolist(), [None] * len(rows)
        logits, raw_logprobs = self.prepare(logits, rows, bitmask)
        want_lp = [wants_logprobs(r) for r in rows]
        chosen = logits.argmax(-1)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            idx = torch.tensor(sampled, dtype=torch.long, device=logits.device)
            chosen[idx] = sample_rows(logits[idx], [rows[i] for i in sampled])
        lps: list[TokenLogprobs | None] = [None] * len(rows)
        if raw_logprobs is not None:
            sel = [i for i, w in enumerate(want_lp) if w]
            got = gather_logprobs(raw_logprobs[sel], chosen[sel], [rows[i].params.logprobs or 0 for i in sel])
            for i, g in zip(sel, got):
                lps[i] = g
        return chosen.tolist(), lps

    @staticmethod
    def prepare(logits: torch.Tensor, rows: list[SamplingRow],
                bitmask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the logits every row samples from: fp32, grammar-masked, logits processors and penalties
        applied; the model's own logprobs after the grammar mask, when a row wants logprobs, else None)."""
        logits = logits.float()
        if bitmask is not None:
            logits = apply_token_bitmask(logits, bitmask)
        raw_logprobs = logits.log_softmax(-1) if any(wants_logprobs(r) for r in rows) else None
        logits = apply_logits_processors(logits, rows)
        if any(r.params.has_penalties for r in rows):
            logits = apply_penalties(logits.clone(), rows)
        return logits, raw_logprobs


def plain_greedy(row: SamplingRow) -> bool:
    """Whether the row's token is the argmax of the model's own logits: greedy, and nothing that
    changes the logits (penalties, logit_bias, allowed or banned tokens) or reports their logprobs."""
    p = row.params
    return p.greedy and not p.has_penalties and not p.has_logits_processors and not wants_logprobs(row)


def wants_logprobs(row: SamplingRow) -> bool:
    """Whether the request reports logprobs (or ranks sequences by them: best_of > n)."""
    return row.params.logprobs is not None or row.params.needs_cumulative_logprob
