"""The sampler on known logits: masks, penalties, seeds, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from heterollm.sampling import SamplingParams, SamplingParamsError
from heterollm.sampling.sampler import Sampler, SamplingRow, apply_penalties, apply_top_k_top_p_min_p


def row(params, out=(), prompt=(), gen=None):
    return SamplingRow(params, gen, list(prompt), list(out))


LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]]))


def kept(logits):
    return (logits[0] > float("-inf")).nonzero().squeeze(1).tolist()


def test_top_k_mask():
    out = apply_top_k_top_p_min_p(LOGITS.clone(), torch.tensor([2]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert kept(out) == [0, 1]


def test_top_p_mask_keeps_smallest_nucleus():
    # cumulative: 0.5, 0.75, 0.90, 0.97 -> top_p 0.7 keeps the first two (0.5 < 0.7 needs the second)
    out = apply_top_k_top_p_min_p(LOGITS.clone(), torch.tensor([0]), torch.tensor([0.7]), torch.tensor([0.0]))
    assert kept(out) == [0, 1]
    out = apply_top_k_top_p_min_p(LOGITS.clone(), torch.tensor([0]), torch.tensor([0.5]), torch.tensor([0.0]))
    assert kept(out) == [0]
    out = apply_top_k_top_p_min_p(LOGITS.clone(), torch.tensor([0]), torch.tensor([0.91]), torch.tensor([0.0]))
    assert kept(out) == [0, 1, 2, 3]


def test_min_p_mask():
    # min_p 0.3 * 0.5 = 0.15 -> keeps p >= 0.15
    out = apply_top_k_top_p_min_p(LOGITS.clone(), torch.tensor([0]), torch.tensor([1.0]), torch.tensor([0.3]))
    assert kept(out) == [0, 1, 2]


def test_row_wise_parameters():
    logits = LOGITS.repeat(2, 1)
    out = apply_top_k_top_p_min_p(logits, torch.tensor([1, 0]), torch.tensor([1.0, 0.7]), torch.tensor([0.0, 0.0]))
    assert (out[0] > float("-inf")).sum() == 1 and (out[1] > float("-inf")).sum() == 2


def test_repetition_penalty():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    out = apply_penalties(logits.clone(), [row(SamplingParams(repetition_penalty=2.0), out=[1], prompt=[0])])
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]


def test_presence_and_frequency_penalties():
    logits = torch.zeros(1, 4)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits.clone(), [row(p, out=[2, 2, 3], prompt=[0, 1])])
    assert out.tolist() == [[0.0, 0.0, -1.0, -0.75]]


def test_greedy_and_logprobs():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    tokens, lps = Sampler()(logits, [row(SamplingParams(temperature=0, logprobs=2)),
                                     row(SamplingParams(temperature=0))])
    assert tokens == [1, 0]
    expected = logits[0].log_softmax(-1)
    assert math.isclose(lps[0].logprob, expected[1].item(), rel_tol=1e-6)
    assert lps[0].rank == 1 and [t for t, _ in lps[0].top] == [1, 2]
    assert lps[1] is None


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().unsqueeze(0).repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)
    rows = [row(SamplingParams(temperature=1.0), gen=gen) for _ in range(4000)]
    tokens, _ = Sampler()(logits, rows)
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0]]).repeat(2000, 1)
    gen = torch.Generator().manual_seed(1)
    tokens, _ = Sampler()(logits, [row(SamplingParams(temperature=0.1), gen=gen) for _ in range(2000)])
    assert sum(tokens) < 5  # p(token 1) = 1 / (1 + e^10)


def test_seeded_rows_reproducible():
    logits = torch.randn(3, 50)
    def run():
        rows = [row(SamplingParams(temperature=1.0, seed=7), gen=torch.Generator().manual_seed(7 + i)) for i in range(3)]
        return Sampler()(logits, rows)[0]
    assert run() == run()


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -5}, "top_k"), ({"min_p": 2}, "min_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"), ({"repetition_penalty": 0}, "repetition_penalty"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"logprobs": 50}, "logprobs"), ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field and str(info.value).startswith(field)


def _spy_argmax(monkeypatch):
    from heterollm.model_executor import ops

    calls = []
    real = ops.get("argmax")

    def spy(logits):
        calls.append(logits.dtype)
        return real(logits)

    monkeypatch.setitem(ops._ACTIVE, "argmax", spy)
    return calls


def test_plain_greedy_rows_take_the_registry_argmax_on_the_raw_logits(monkeypatch):
    """A batch of plain greedy rows is one argmax of the op registry on the logits in their own dtype
    (no fp32 copy); it picks what the full path picks, ties and bf16 included."""
    calls = _spy_argmax(monkeypatch)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=g).to(torch.bfloat16)
    logits[2, [10, 200]] = 9.0  # a tie: the first
    rows = [row(SamplingParams(temperature=0)) for _ in range(5)] + [row(SamplingParams(top_k=1, temperature=0.8))]
    tokens, lps = Sampler()(logits, rows)
    assert calls == [torch.bfloat16] and lps == [None] * 6
    assert tokens == logits.float().argmax(-1).tolist() and tokens[2] == 10


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, logprobs=2),
    SamplingParams(temperature=0, repetition_penalty=1.5),
    SamplingParams(temperature=0, logit_bias={4: 100.0}),
    SamplingParams(temperature=0, allowed_token_ids=[2, 3]),
    SamplingParams(temperature=0.7, seed=1),
])
def test_rows_that_change_or_report_the_logits_leave_the_fast_path(monkeypatch, params):
    """One row with logprobs, a penalty, a bias, an allow list, or sampling sends the batch through the
    full path, and that row gets what it asked for."""
    calls = _spy_argmax(monkeypatch)
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, 0.5]] * 2)
    tokens, lps = Sampler()(logits, [row(SamplingParams(temperature=0)), row(params, out=[1], prompt=[1])])
    assert calls == [] and tokens[0] == 1
    if params.logit_bias:
        assert tokens[1] == 4
    if params.allowed_token_ids:
        assert tokens[1] == 3
    if params.logprobs:
        assert lps[1] is not None and lps[0] is None
