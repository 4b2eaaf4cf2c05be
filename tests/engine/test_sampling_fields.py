"""Issue 20's sampling fields through the offline API on a tiny random llama, each checked against
transformers' own generate with the matching logits processor (sequence_bias, bad_words_ids,
prefix_allowed_tokens_fn, min_new_tokens) or a float64 reference; and the field-named refusals."""
from __future__ import annotations

import pytest

from helpers import hf_generate, hf_logprobs
from heterollm import LLM, SamplingParams
from heterollm.scheduler.request import RequestRejected

PROMPT = [5, 6, 7, 8]
MAX = 12


@pytest.fixture(scope="module")
def llm(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", block_size=8, num_gpu_blocks_override=128, max_model_len=64)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def greedy(tiny_llama):
    return hf_generate(tiny_llama, PROMPT, MAX, eos_token_id=None, min_new_tokens=MAX)


def run(llm, prompt=PROMPT, **kwargs):
    [out] = llm.generate([prompt], SamplingParams(**{"max_tokens": MAX, "temperature": 0, "ignore_eos": True,
                                                     **kwargs}))
    return out


def test_logit_bias_matches_transformers_sequence_bias(llm, tiny_llama, greedy):
    bias = {greedy[2]: -30.0, 1234: 4.5}
    want = hf_generate(tiny_llama, PROMPT, MAX, eos_token_id=None, min_new_tokens=MAX,
                       sequence_bias={(t,): b for t, b in bias.items()})
    assert want != greedy  # the bias changes the run
    out = run(llm, logit_bias=bias, logprobs=0)
    assert out.outputs[0].token_ids == want
    # logprobs stay the model's own: the first token's is transformers' unbiased log-softmax
    ref = hf_logprobs(tiny_llama, PROMPT)[-1].double()
    assert out.outputs[0].logprobs[0].logprob == pytest.approx(ref[want[0]].item(), abs=1e-4)


def test_allowed_token_ids_match_transformers_prefix_allowed_tokens(llm, tiny_llama, greedy):
    allowed = [greedy[0], 100, 200, 300, 7000]
    want = hf_generate(tiny_llama, PROMPT, MAX, eos_token_id=None, min_new_tokens=MAX,
                       prefix_allowed_tokens_fn=lambda _batch, _ids: allowed)
    assert set(want) <= set(allowed) and want != greedy
    assert run(llm, allowed_token_ids=allowed).outputs[0].token_ids == want


def vllm_bad_word_ids(tok, word: str) -> list[list[int]]:
    """vLLM's rule, by hand: the word as-is, and with a leading space when that is a different
    first token in as many tokens."""
    plain = tok.encode(word.lstrip(), add_special_tokens=False)
    spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
    return [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])


def test_a_one_token_bad_word_matches_transformers_bad_words_ids(llm, tiny_llama):
    tok = llm.get_tokenizer()
    ids = vllm_bad_word_ids(tok, "hello")
    spaced = tok.encode(" hello", add_special_tokens=False)
    assert len(ids) == 2 and ids[1] == spaced and len(spaced) == 1  # "hello" and " hello": one token each
    bias = {spaced[0]: 6.0}  # makes " hello" (mid-text) likely
    biased = hf_generate(tiny_llama, PROMPT, MAX, eos_token_id=None, min_new_tokens=MAX,
                         sequence_bias={(t,): b for t, b in bias.items()})
    assert spaced[0] in biased
    want = hf_generate(tiny_llama, PROMPT, MAX, eos_token_id=None, min_new_tokens=MAX, bad_words_ids=ids,
                       sequence_bias={(t,): b for t, b in bias.items()})
    assert not {w[0] for w in ids} & set(want)
    assert run(llm, bad_words=["hello"], logit_bias=bias).outputs[0].token_ids == want
    assert run(llm, bad_words=["  hello"], logit_bias=bias).outputs[0].token_ids == want  # leading spaces stripped


def test_a_multi_token_bad_word_is_banned_only_after_its_prefix(llm, tiny_llama, greedy):
    tok = llm.get_tokenizer()
    for i in range(1, MAX - 1):  # two generated tokens that spell a word which tokenizes back to them
        word = tok.decode(greedy[i:i + 2])
        if word.strip() == word and tok.encode(word, add_special_tokens=False) == greedy[i:i + 2]:
            break
    else:
        pytest.skip("no two-token word in this run")
    ids = vllm_bad_word_ids(tok, word)
    want = hf_generate(tiny_llama, PROMPT, MAX, eos_token_id=None, min_new_tokens=MAX, bad_words_ids=ids)
    assert want[:i + 1] == greedy[:i + 1] and want[i + 1] != greedy[i + 1]  # the prefix stays; the end is banned
    assert run(llm, bad_words=[word]).outputs[0].token_ids == want


def test_min_tokens_masks_eos_that_a_bias_made_the_argmax(llm, tiny_llama):
    eos = llm.get_tokenizer().eos_token_id
    want = hf_generate(tiny_llama, PROMPT, MAX, eos_token_id=eos, min_new_tokens=5, sequence_bias={(eos,): 50.0})
    assert len(want) == 6 and want[-1] == eos and eos not in want[:5]  # exactly min_tokens, then EOS
    out = run(llm, ignore_eos=False, min_tokens=5, logit_bias={eos: 50.0})
    assert out.outputs[0].token_ids == want and out.outputs[0].finish_reason == "stop"
    # ignore_eos: EOS is an ordinary token, not masked
    assert run(llm, ignore_eos=True, min_tokens=5, logit_bias={eos: 50.0}).outputs[0].token_ids == [eos] * MAX


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm, tiny_llama):
    long = list(range(100, 140))
    out = run(llm, prompt=long, truncate_prompt_tokens=6)
    assert out.prompt_token_ids == long[-6:]
    assert out.outputs[0].token_ids == hf_generate(tiny_llama, long[-6:], MAX, eos_token_id=None, min_new_tokens=MAX)
    assert run(llm, prompt=long, truncate_prompt_tokens=-1).prompt_token_ids == long  # -1: max_model_len (64)
    assert run(llm, prompt=long[:3], truncate_prompt_tokens=6).prompt_token_ids == long[:3]


def test_best_of_returns_the_n_sequences_with_the_highest_cumulative_logprob(llm, tiny_llama):
    kwargs = {"temperature": 1.0, "seed": 11, "max_tokens": 6}
    # sequence i samples with seed + i: these are the 4 candidates best_of=4 draws
    [every] = llm.generate([PROMPT], SamplingParams(n=4, **kwargs, ignore_eos=True))
    seqs = [c.token_ids for c in every.outputs]

    def cumulative(seq):  # float64, from transformers' log-softmax at each generated position
        lps = hf_logprobs(tiny_llama, PROMPT + seq).double()
        return sum(lps[len(PROMPT) - 1 + j, t].item() for j, t in enumerate(seq))

    scores = [cumulative(s) for s in seqs]
    assert len({round(s, 3) for s in scores}) == 4
    ranked = sorted(range(4), key=lambda i: -scores[i])
    [out] = llm.generate([PROMPT], SamplingParams(n=2, best_of=4, **kwargs, ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1]
    assert [c.token_ids for c in out.outputs] == [seqs[ranked[0]], seqs[ranked[1]]]
    assert [c.cumulative_logprob for c in out.outputs] == pytest.approx([scores[ranked[0]], scores[ranked[1]]],
                                                                        abs=1e-3)
    assert out.outputs[0].logprobs is None  # not asked for


def test_the_callers_params_are_not_changed_and_serve_each_prompt_alike(llm):
    sp = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True, bad_words=["hello"], min_tokens=1)
    long, short = list(range(200, 250)), [5, 6]
    outs = llm.generate([long, short], sp)
    # max_tokens None: each prompt runs to max_model_len (64), not to the first prompt's remainder
    assert [len(o.outputs[0].token_ids) for o in outs] == [64 - 50, 64 - 2]
    assert sp.max_tokens is None and sp.bad_words_token_ids == [] and sp.all_stop_token_ids == []


@pytest.mark.parametrize("kwargs,field", [
    ({"logit_bias": {10**6: 1.0}}, "logit_bias"),
    ({"allowed_token_ids": [5, 10**6]}, "allowed_token_ids"),
    ({"truncate_prompt_tokens": 65}, "truncate_prompt_tokens"),
])
def test_out_of_range_values_are_refused_naming_the_field_and_nothing_runs(llm, kwargs, field):
    good = SamplingParams(max_tokens=2)
    with pytest.raises(RequestRejected) as err:
        llm.generate([PROMPT, PROMPT], [good, SamplingParams(max_tokens=2, **kwargs)])
    assert err.value.field == field and field in str(err.value)
    assert not llm.engine.has_unfinished()
    assert len(run(llm).outputs[0].token_ids) == MAX  # the engine serves on


def test_a_field_changed_to_a_bad_value_after_construction_is_refused_at_admission(llm):
    sp = SamplingParams(max_tokens=2)
    sp.best_of = 0
    with pytest.raises(RequestRejected) as err:
        llm.generate([PROMPT], sp)
    assert err.value.field == "best_of" and str(err.value).startswith("best_of: ")


def test_best_of_keeps_the_n_highest_cumulative_logprobs_each_whole_in_its_delta():
    """vLLM v0's best_of, worked by hand: nothing until every sequence finished; then ranked by
    cumulative logprob (one never computed ranks last), re-indexed, each streamed whole at once."""
    from heterollm.engine.admission import best_of
    from heterollm.engine.outputs import CompletionOutput

    seqs = [CompletionOutput(0, "a", [1], finish_reason="stop", cumulative_logprob=-3.0),
            CompletionOutput(1, "bb", [2, 3], finish_reason="length", cumulative_logprob=None),
            CompletionOutput(2, "c", [4], finish_reason="stop", cumulative_logprob=-0.5, delta_text="", delta_token_ids=[]),
            CompletionOutput(3, "dd", [5, 6], finish_reason="stop", cumulative_logprob=-1.25, delta_text="d",
                             delta_token_ids=[6])]
    assert best_of(seqs, 2, finished=False) == []

    def view(outs):
        return [(c.index, c.text, c.cumulative_logprob, c.delta_text, c.delta_token_ids) for c in outs]

    assert view(best_of(seqs, 2, finished=True)) == [(0, "c", -0.5, "c", [4]), (1, "dd", -1.25, "dd", [5, 6])]
    assert view(best_of(seqs, 4, finished=True)) == [(0, "c", -0.5, "c", [4]), (1, "dd", -1.25, "dd", [5, 6]),
                                                     (2, "a", -3.0, "a", [1]), (3, "bb", None, "bb", [2, 3])]
