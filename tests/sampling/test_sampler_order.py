"""The order of the sampler's transforms, which greedy parity cannot see: top-k before top-p (the
nucleus is taken over the top-k renormalized, as transformers' warpers and vLLM do), and logprobs
of the model's own distribution, before penalties and temperature. Expected values come from
transformers' logits warpers, a float64 log-softmax, or a case worked by hand."""
from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from heterollm.sampling import SamplingParams
from heterollm.sampling.sampler import Sampler, SamplingRow, apply_top_k_top_p_min_p


def kept(logits: torch.Tensor) -> list[list[int]]:
    return [(row > float("-inf")).nonzero().squeeze(1).tolist() for row in logits]


def mask(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    n = logits.shape[0]
    return apply_top_k_top_p_min_p(logits.clone(), torch.full((n,), top_k), torch.full((n,), top_p, dtype=logits.dtype),
                                   torch.full((n,), min_p, dtype=logits.dtype))


def test_top_k_comes_before_top_p_by_hand():
    # p = [0.35, 0.30, 0.20, 0.15], top_k 2, top_p 0.5. Top-k first: {0.35, 0.30} renormalized is
    # {0.538, 0.462}; the first token alone already holds 0.538 >= 0.5, so the nucleus is {0}.
    # (Top-p first would keep {0, 1}: 0.35 < 0.5 needs the second token; top-k 2 keeps both.)
    logits = torch.tensor([[0.35, 0.30, 0.20, 0.15]]).log()
    assert kept(mask(logits, 2, 0.5)) == [[0]]


def hf_mask(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """transformers' warpers in its own order (top-k, top-p, min-p), on float64."""
    scores = logits.double()
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(None, scores)
    return scores


@pytest.mark.parametrize("top_k,top_p,min_p", [(5, 0.5, 0.0), (3, 0.6, 0.0), (8, 0.3, 0.0), (0, 0.7, 0.0),
                                               (6, 0.8, 0.2), (4, 1.0, 0.3)])
def test_masks_match_transformers_warpers(top_k, top_p, min_p):
    gen = torch.Generator().manual_seed(top_k * 100 + int(top_p * 10))
    logits = torch.randn(64, 20, generator=gen, dtype=torch.float64) * 2
    ours = kept(mask(logits, top_k, top_p, min_p))
    theirs = kept(hf_mask(logits, top_k, top_p, min_p))
    assert ours == theirs
    if top_k and top_p < 1:  # the case must tell the two orders apart on some rows
        p_first = kept(mask(mask(logits, 0, top_p), top_k, 1.0))
        assert p_first != theirs


def row(params: SamplingParams, prompt=(), out=()) -> SamplingRow:
    return SamplingRow(params, torch.Generator().manual_seed(0), list(prompt), list(out))


def test_logprobs_are_taken_before_penalties():
    # token 0 is in the prompt: repetition_penalty 2 turns its logit 2.0 into 1.0, so greedy picks
    # token 1 (1.9); its logprob is that of the model's own logits, penalties left out.
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0]])
    tokens, [lp] = Sampler()(logits.clone(), [row(SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=2),
                                                  prompt=[0])])
    raw = logits.double().log_softmax(-1)[0]
    assert tokens == [1]
    assert lp.token_id == 1 and lp.logprob == pytest.approx(raw[1].item(), abs=1e-6)
    assert lp.rank == 2, "rank within the model's own distribution (token 0 is likelier)"
    assert [t for t, _ in lp.top] == [0, 1]
    assert [v for _, v in lp.top] == pytest.approx([raw[0].item(), raw[1].item()], abs=1e-6)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.5, top_k=2, logprobs=1, seed=1),
    SamplingParams(temperature=1.3, presence_penalty=1.5, frequency_penalty=1.0, logprobs=1, seed=2),
])
def test_logprobs_ignore_temperature_masks_and_penalties(params):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 50, generator=gen)
    tokens, [lp] = Sampler()(logits.clone(), [row(params, prompt=[1, 2], out=[3, 3, 4])])
    raw = logits.double().log_softmax(-1)[0]
    assert lp.token_id == tokens[0]
    assert lp.logprob == pytest.approx(raw[tokens[0]].item(), abs=1e-5)
    assert lp.top[0][0] == int(raw.argmax()) and lp.top[0][1] == pytest.approx(raw.max().item(), abs=1e-5)


# -- edges the mutation run found untested (tests/MUTATION.md) --------------------------------------

def test_penalties_apply_to_every_row_that_asks():
    from heterollm.sampling.sampler import apply_penalties

    logits = torch.tensor([[0.5, 2.0, -1.0, 0.0]]).repeat(4, 1)
    rows = [row(SamplingParams()),                                          # no penalty: untouched
            row(SamplingParams(repetition_penalty=2.0), prompt=[0, 2]),     # 0.5 -> 0.25, -1 -> -2
            row(SamplingParams(presence_penalty=0.5), out=[1, 1]),          # presence alone: 2 - 0.5
            row(SamplingParams(frequency_penalty=0.25), out=[1, 1, 3])]     # frequency alone: 2 - 0.5, 0 - 0.25
    out = apply_penalties(logits.clone(), rows)
    assert out.tolist() == [[0.5, 2.0, -1.0, 0.0], [0.25, 2.0, -2.0, 0.0], [0.5, 1.5, -1.0, 0.0],
                            [0.5, 1.5, -1.0, -0.25]]


def test_top_p_boundary_is_inclusive():
    # float64 p = [0.5, 0.25, 0.125, 0.125] exactly: the smallest set holding >= top_p of the mass
    logits = torch.tensor([[0.0, -math.log(2), -2 * math.log(2), -2 * math.log(2)]], dtype=torch.float64)
    assert logits.softmax(-1).tolist() == [[0.5, 0.25, 0.125, 0.125]]
    assert kept(mask(logits, 0, 0.5)) == [[0]]
    assert kept(mask(logits, 0, 0.75)) == [[0, 1]]
    assert kept(hf_mask(logits, 0, 0.5, 0.0)) == [[0]] and kept(hf_mask(logits, 0, 0.75, 0.0)) == [[0, 1]]


def test_disabled_masks_leave_the_logits_untouched():
    # -200 underflows to probability 0 in float32: a nucleus of "everything" must still keep it
    logits = torch.tensor([[0.0, -200.0, 1.0, -50.0]])
    assert torch.equal(mask(logits, 0, 1.0, 0.0), logits)


def test_ranks_and_alternatives_per_row():
    # row 0: repetition_penalty 10 on tokens 0 and 2 makes greedy pick token 3, third in the
    # model's own order; row 1 asks for no alternatives; row 2 for one
    logits = torch.tensor([[5.0, 1.0, 4.0, 3.0], [0.0, 2.0, 1.0, 3.0], [1.0, 0.0, 3.0, 2.0]])
    rows = [row(SamplingParams(temperature=0, repetition_penalty=10.0, logprobs=2), prompt=[0, 2]),
            row(SamplingParams(temperature=0, logprobs=0)),
            row(SamplingParams(temperature=0, logprobs=1))]
    tokens, lps = Sampler()(logits.clone(), rows)
    raw = logits.double().log_softmax(-1)
    assert tokens == [3, 3, 2]
    assert [lp.rank for lp in lps] == [3, 1, 1]
    assert [[t for t, _ in lp.top] for lp in lps] == [[0, 2], [], [2]]
    assert [lp.logprob for lp in lps] == pytest.approx([raw[0, 3].item(), raw[1, 3].item(), raw[2, 2].item()],
                                                       abs=1e-6)
