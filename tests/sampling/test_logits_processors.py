"""logit_bias, allowed_token_ids, bad_words and min_tokens in the sampler (issue 20), on hand-built
logits whose expected outcome is derived by hand; and the SamplingParams rules of those fields."""
from __future__ import annotations

import math

import pytest
import torch

from heterollm.sampling import SamplingParams, SamplingParamsError
from heterollm.sampling.sampler import Sampler, SamplingRow, apply_logits_processors
from heterollm.testing.devices import DeviceMixingDetector

INF = float("-inf")


def params(bad_words_token_ids=(), all_stop_token_ids=None, **kwargs) -> SamplingParams:
    """SamplingParams as the engine leaves them after admission (bad words tokenized, EOS known)."""
    p = SamplingParams(**kwargs)
    p.bad_words_token_ids = [list(w) for w in bad_words_token_ids]
    if all_stop_token_ids is not None:
        p.all_stop_token_ids = list(all_stop_token_ids)
    return p


def row(p: SamplingParams, out=(), gen=None) -> SamplingRow:
    return SamplingRow(p, gen, [1, 2], list(out))


def draws(logits: torch.Tensor, p: SamplingParams, num: int, seed: int = 0, out=()) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    tokens, _ = Sampler()(logits.repeat(num, 1), [row(p, out, gen) for _ in range(num)])
    return tokens


# -- logit_bias -----------------------------------------------------------------------------
def test_a_bias_is_added_to_its_tokens_logit_and_flips_the_argmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = params(temperature=0, logit_bias={2: 3.0, 3: -0.5})
    assert apply_logits_processors(logits.clone(), [row(p)]).tolist() == [[2.0, 1.0, 3.0, -1.5]]
    tokens, lps = Sampler()(logits.clone(), [row(params(temperature=0, logit_bias={2: 3.0}, logprobs=1))])
    assert tokens == [2]
    # the reported logprob is the model's own (before the bias): log(e^0 / (e^2 + e^1 + e^0 + e^-1))
    expected = -math.log(math.exp(2) + math.exp(1) + 1 + math.exp(-1))
    assert lps[0].logprob == pytest.approx(expected, rel=1e-6) and lps[0].rank == 3


def test_sampling_follows_the_biased_distribution():
    # equal logits, token 1 biased by ln 3: p = (1, 3, 1) / 5
    p = params(temperature=1.0, logit_bias={1: math.log(3)})
    tokens = draws(torch.zeros(1, 3), p, 4000)
    freq = torch.bincount(torch.tensor(tokens), minlength=3).double() / 4000
    assert torch.allclose(freq, torch.tensor([0.2, 0.6, 0.2], dtype=torch.float64), atol=0.03)


# -- allowed_token_ids ----------------------------------------------------------------------
def test_only_allowed_tokens_are_sampled():
    logits = torch.tensor([[5.0, 0.0, 4.0, 0.0, 1.0]])
    p = params(temperature=1.0, allowed_token_ids=[1, 3])
    tokens = draws(logits, p, 2000)
    assert set(tokens) == {1, 3}  # both, and nothing else, though tokens 0 and 2 dominate
    greedy, _ = Sampler()(logits.clone(), [row(params(temperature=0, allowed_token_ids=[3, 4]))])
    assert greedy == [4]


# -- bad_words ------------------------------------------------------------------------------
def test_a_one_token_bad_word_is_never_sampled():
    logits = torch.tensor([[0.0, 3.0, 0.5, 0.0]])  # token 1 has p ~ 0.86
    tokens = draws(logits, params(temperature=1.0, bad_words_token_ids=[[1]]), 3000)
    assert 1 not in tokens and set(tokens) == {0, 2, 3}
    greedy, _ = Sampler()(logits.clone(), [row(params(temperature=0, bad_words_token_ids=[[1]]))])
    assert greedy == [2]


@pytest.mark.parametrize("word,out,banned", [
    ([5, 7], [], False),            # the prefix is not there yet: 7 may start the output
    ([5, 7], [9, 5], True),         # the output ends with the prefix: 7 would complete the word
    ([5, 7], [5, 9], False),        # the prefix is in the output, but not at its end
    ([4, 5, 7], [4, 5], True),
    ([4, 5, 7], [3, 5], False),     # only part of the prefix matches
    ([4, 5, 7], [5], False),        # shorter than the prefix
])
def test_a_multi_token_bad_word_bans_its_last_token_only_after_its_prefix(word, out, banned):
    logits = torch.zeros(1, 10)
    logits[0, 7] = 5.0
    p = params(temperature=0, bad_words_token_ids=[word])
    got = apply_logits_processors(logits.clone(), [row(p, out)])
    assert (got[0, 7].item() == INF) == banned
    assert torch.isfinite(torch.cat([got[0, :7], got[0, 8:]])).all()  # nothing else touched
    assert Sampler()(logits.clone(), [row(p, out)])[0] == ([0] if banned else [7])


# -- min_tokens -----------------------------------------------------------------------------
def generate(logits: torch.Tensor, p: SamplingParams, steps: int) -> list[int]:
    """Greedy decoding on fixed logits until a token of `ends` (a stand-in for the engine's stop)."""
    out: list[int] = []
    for _ in range(steps):
        token = Sampler()(logits.clone(), [row(p, out)])[0][0]
        out.append(token)
        if token in p.all_stop_token_ids:
            break
    return out


def test_min_tokens_masks_eos_until_reached():
    logits = torch.tensor([[9.0, 1.0, 2.0, 0.0]])  # EOS (0) is the argmax at every step
    p = params(temperature=0, min_tokens=3, all_stop_token_ids=[0])
    assert generate(logits, p, 10) == [2, 2, 2, 0]  # exactly min_tokens tokens, then EOS
    assert generate(logits, params(temperature=0, all_stop_token_ids=[0]), 10) == [0]


def test_min_tokens_masks_stop_token_ids_too():
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0]])
    p = params(temperature=0, min_tokens=2, stop_token_ids=[2])  # no EOS known: stop_token_ids alone
    assert p.all_stop_token_ids == [2]
    assert generate(logits, p, 10) == [3, 3, 2]
    p = params(temperature=0, min_tokens=2, stop_token_ids=[2], all_stop_token_ids=[2, 3])
    assert generate(logits, p, 10) == [1, 1, 2]


def test_bad_words_stay_banned_while_min_tokens_masks_the_stop_tokens():
    logits = torch.tensor([[9.0, 1.0, 8.0, 7.0]])  # EOS 0, then the bad word 2, then 3
    p = params(temperature=0, min_tokens=2, all_stop_token_ids=[0], bad_words_token_ids=[[2]])
    masked = apply_logits_processors(logits.clone(), [row(p)])
    assert masked.tolist() == [[INF, 1.0, INF, 7.0]]  # both bans at once, neither replaces the other
    assert generate(logits, p, 10) == [3, 3, 0]


def test_a_stop_token_outside_the_logits_is_not_masked():
    # an EOS id the model's vocabulary does not reach (tokenizers can add tokens past it): no index error,
    # the in-range stop token is still masked
    logits = torch.tensor([[1.0, 9.0, 2.0]])
    p = params(temperature=0, min_tokens=1, all_stop_token_ids=[1, 3, 4])
    assert apply_logits_processors(logits.clone(), [row(p)]).tolist() == [[1.0, INF, 2.0]]


def test_a_row_without_processors_is_left_alone_beside_one_with_them():
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    rows = [row(params(temperature=0, bad_words_token_ids=[[2]], logit_bias={0: 5.0})), row(params(temperature=0))]
    before = logits.clone()
    assert apply_logits_processors(logits, rows).tolist() == [[6.0, 2.0, INF], [1.0, 2.0, 3.0]]
    assert torch.equal(logits, before)  # a new tensor; the input is not modified
    assert Sampler()(logits, rows)[0] == [0, 2]


def test_processors_build_every_tensor_on_the_logits_device():
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    ps = [params(temperature=0.8, logit_bias={3: 2.0}, allowed_token_ids=[1, 3, 5], seed=1),
          params(temperature=0, min_tokens=2, all_stop_token_ids=[4], bad_words_token_ids=[[7], [2, 9]]),
          params(temperature=0)]

    def run(x):
        return Sampler()(x, [SamplingRow(p, torch.Generator().manual_seed(i), [1], [2]) for i, p in enumerate(ps)])

    expected = run(logits.clone())
    with DeviceMixingDetector(fake="meta") as dev:
        got = run(dev.place(logits.clone()))
    assert got == expected
    assert {"aten.index_put_.default", "aten.masked_fill.Scalar"} <= set(dev.ops)  # the masks really ran


def test_best_of_gets_the_chosen_tokens_logprob_without_asking():
    logits = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    tokens, lps = Sampler()(logits, [row(params(temperature=0, n=1, best_of=2)), row(params(temperature=0))])
    assert tokens == [1, 1]
    assert lps[0].logprob == pytest.approx(-math.log(1 + math.exp(-1)), rel=1e-6) and lps[0].top == []
    assert lps[1] is None


# -- SamplingParams -------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,field", [
    ({"logit_bias": {"3": 1.0}}, "logit_bias"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {3: math.nan}}, "logit_bias"), ({"logit_bias": {3: math.inf}}, "logit_bias"),
    ({"logit_bias": [3]}, "logit_bias"), ({"logit_bias": {True: 1.0}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": [1.0]}, "allowed_token_ids"),
    ({"bad_words": "word"}, "bad_words"), ({"bad_words": [" "]}, "bad_words"), ({"bad_words": [3]}, "bad_words"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"), ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 1.5}, "truncate_prompt_tokens"),
    ({"best_of": 1, "n": 2}, "best_of"), ({"best_of": 0}, "best_of"), ({"best_of": 2.0}, "best_of"),
    ({"best_of": 3, "seed": 2**63 - 2}, "seed"),  # sequence i samples with seed + i, up to best_of
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field and str(info.value).startswith(f"{field}: ")


def test_good_values_are_kept():
    p = SamplingParams(logit_bias={0: -100, 5: 100.0}, allowed_token_ids=[0], bad_words=["x"],
                       truncate_prompt_tokens=-1, best_of=3, n=2, seed=2**63 - 3)
    assert (p.num_sequences, p.needs_cumulative_logprob, p.has_logits_processors) == (3, True, True)
    assert SamplingParams(truncate_prompt_tokens=1).truncate_prompt_tokens == 1
    assert SamplingParams(n=2).num_sequences == 2 and not SamplingParams(n=2, best_of=2).needs_cumulative_logprob
    assert not SamplingParams(min_tokens=3).has_logits_processors  # nothing to mask until the engine adds EOS
