"""Stop conditions on a tiny model, checked against the same prompt's unstopped greedy run: every
one of several stop strings is watched (whichever completes first wins, wherever it sits in the
list), stop_reason names it, and min_tokens masks stop tokens until it is reached (vLLM's rule,
checked against transformers' min_new_tokens)."""
from __future__ import annotations

import pytest

from helpers import hf_generate
from heterollm import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8], [300, 301, 302], [1000, 20, 4000, 50, 6000]]
MAX = 24


@pytest.fixture(scope="module")
def llm(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", block_size=8, num_gpu_blocks_override=128, max_model_len=128)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def unstopped(llm):
    """(text, token ids) of each prompt's greedy run with no stop condition at all."""
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX, temperature=0, ignore_eos=True))
    return [(o.outputs[0].text, o.outputs[0].token_ids) for o in outs]


def first_occurrence(text: str, start: int, width: int = 3) -> tuple[int, str]:
    """The first position >= start whose `width` characters occur nowhere earlier in `text`."""
    for i in range(start, len(text) - width + 1):
        piece = text[i:i + width]
        if text.find(piece) == i and piece.strip():
            return i, piece
    pytest.skip("the tiny model's text has no fresh substring here")


@pytest.mark.parametrize("k", range(len(PROMPTS)))
def test_the_stop_string_that_completes_first_wins_wherever_it_is_listed(llm, unstopped, k):
    text, _ = unstopped[k]
    early_at, early = first_occurrence(text, 2)
    late_at, late = first_occurrence(text, early_at + 6)
    assert late_at > early_at + len(early)
    for stops in (["\x01never\x01", late, early], [early, "\x01never\x01", late], ["\x01never\x01", late]):
        want_at, want = (early_at, early) if early in stops else (late_at, late)
        [out] = llm.generate([PROMPTS[k]], SamplingParams(max_tokens=MAX, temperature=0, ignore_eos=True, stop=stops))
        c = out.outputs[0]
        assert (c.text, c.finish_reason, c.stop_reason) == (text[:want_at], "stop", want), stops
        [kept] = llm.generate([PROMPTS[k]], SamplingParams(max_tokens=MAX, temperature=0, ignore_eos=True, stop=stops,
                                                           include_stop_str_in_output=True))
        assert kept.outputs[0].text == text[:want_at + len(want)]


@pytest.mark.parametrize("min_tokens", [0, 3, 8, MAX])
@pytest.mark.parametrize("k", range(len(PROMPTS)))
def test_min_tokens_masks_stop_tokens(llm, tiny_llama, unstopped, k, min_tokens):
    _, tokens = unstopped[k]
    stop = tokens[1]
    # transformers masks its eos_token_id until min_new_tokens are out, as vLLM masks stop tokens
    want = hf_generate(tiny_llama, PROMPTS[k], MAX, min_new_tokens=min_tokens, eos_token_id=stop)
    assert stop not in want[:min_tokens]
    [out] = llm.generate([PROMPTS[k]], SamplingParams(max_tokens=MAX, temperature=0, ignore_eos=True,
                                                      stop_token_ids=[stop], min_tokens=min_tokens))
    c = out.outputs[0]
    assert c.token_ids == want
    assert len(c.token_ids) >= min_tokens
    if len(want) < MAX or want[-1] == stop:
        assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    else:
        assert c.finish_reason == "length"


def test_several_prompts_and_n_choices_are_indexed_per_prompt(llm):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=3, ignore_eos=True)
    outs = llm.generate(PROMPTS[:2], params)
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt_token_ids == prompt
        assert [c.index for c in out.outputs] == [0, 1, 2]
        [alone] = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=3, ignore_eos=True))
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in alone.outputs], "choice i samples with seed + i"
