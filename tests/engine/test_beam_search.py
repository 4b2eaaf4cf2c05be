"""LLM.beam_search against a beam search written here from the spec on transformers' own forward of
the same tiny random model, plus the ranking rules (length_penalty, EOS) on hand-made logprobs."""
from __future__ import annotations

import pytest
import torch

from beam_reference import hf_beam_search
from helpers import build_tiny_model, hf_greedy
from heterollm import LLM
from heterollm.engine.beam_search import BeamSearch, BeamSearchParams
from heterollm.interfaces import TokenLogprobs

PROMPTS = [[1, 9038, 2057, 253], [19556, 905, 28, 1115, 314]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("beam"), "llama")


@pytest.fixture(scope="module")
def hf(tiny):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny):
    engine = LLM(str(tiny), dtype="float32", block_size=8, num_gpu_blocks_override=256, max_model_len=128)
    yield engine
    engine.shutdown()


def assert_matches(got, want):
    assert [s.tokens for s in got.sequences] == [w[0] for w in want]
    assert [s.finish_reason for s in got.sequences] == [w[2] for w in want]
    for s, w in zip(got.sequences, want):
        assert s.cum_logprob == pytest.approx(w[1], abs=1e-4)


@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_beams_match_the_reference_on_transformers(llm, hf, length_penalty):
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=4, length_penalty=length_penalty))
    assert len(outs) == 2
    for prompt, out in zip(PROMPTS, outs):
        assert len(out.sequences) == 3
        assert_matches(out, hf_beam_search(hf, prompt, 3, 4, length_penalty=length_penalty))
        for s in out.sequences:
            assert s.output_token_ids == s.tokens[len(prompt):] and len(s.output_token_ids) == 4
            assert s.output_text == llm.get_tokenizer().decode(s.output_token_ids, skip_special_tokens=True)
            assert s.text == llm.get_tokenizer().decode(s.tokens, skip_special_tokens=True)
            assert s.cum_logprob == pytest.approx(sum(lp.logprob for lp in s.logprobs), abs=1e-5)


def test_width_one_is_greedy(llm, tiny):
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=6))
    want = hf_greedy(tiny, PROMPTS, 6)
    assert [o.sequences[0].output_token_ids for o in outs] == want


def test_a_string_prompt_and_a_single_prompt(llm):
    text = llm.get_tokenizer().decode(PROMPTS[1], skip_special_tokens=True)
    by_text = llm.beam_search(text, BeamSearchParams(beam_width=2, max_tokens=3))
    by_ids = llm.beam_search([PROMPTS[1]], BeamSearchParams(beam_width=2, max_tokens=3))
    assert len(by_text) == 1 and [s.tokens for s in by_text[0].sequences] == [s.tokens for s in by_ids[0].sequences]


def test_eos_finishes_a_beam_and_the_rest_search_on(tmp_path, hf, tiny):
    """EOS is made the token the best beam picks second, so a beam finishes early at round 2."""
    first = hf_greedy(tiny, [PROMPTS[0]], 2)[0]
    eos = first[1]
    folder = build_tiny_model(tmp_path / "eos", "llama", eos_token_id=eos)
    llm = LLM(str(folder), dtype="float32", block_size=8, num_gpu_blocks_override=256, max_model_len=128)
    try:
        for keep in (False, True):
            out = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=3, max_tokens=4,
                                                                 include_stop_str_in_output=keep))[0]
            want = hf_beam_search(hf, PROMPTS[0], 3, 4, eos=eos)
            assert "stop" in [w[2] for w in want] and "length" in [w[2] for w in want]  # the case is exercised
            assert [s.finish_reason for s in out.sequences] == [w[2] for w in want]
            for s, w in zip(out.sequences, want):
                assert s.tokens == (w[0] + [eos] if keep and w[2] == "stop" else w[0])
                assert s.cum_logprob == pytest.approx(w[1], abs=1e-4)
                assert s.stop_reason == (eos if w[2] == "stop" else None)
                assert s.output_text == llm.get_tokenizer().decode(w[0][len(PROMPTS[0]):], skip_special_tokens=True)
        ignored = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True))[0]
        assert [s.tokens for s in ignored.sequences] == [w[0] for w in hf_beam_search(hf, PROMPTS[0], 3, 4)]
    finally:
        llm.shutdown()


# -- the ranking rules on hand-made logprobs -------------------------------------------------
EOS = 2


def step(*top: tuple[int, float]) -> TokenLogprobs:
    return TokenLogprobs(top[0][0], top[0][1], 1, list(top))


@pytest.mark.parametrize("keep_eos", [False, True])
@pytest.mark.parametrize("length_penalty, best", [(0.0, "short"), (1.0, "short"), (2.0, "long")])
def test_length_penalty_turns_the_ranking(length_penalty, best, keep_eos):
    """Prompt [7] (1 token), width 1, 2 rounds. Round 1: 5 at -1.0 beats 6 at -1.5. Round 2 after
    [7, 5]: EOS at -0.5 finishes "short" = [7, 5] (cum -1.5, len 2: a final EOS is not counted),
    4 at -2.0 lives on as "long" = [7, 5, 4] (cum -3.0, len 3).
    Scores: lp 0: -1.5 vs -3.0; lp 1: -0.75 vs -1.0; lp 2: -1.5/4 = -0.375 vs -3/9 = -0.333: long wins."""
    params = BeamSearchParams(beam_width=1, max_tokens=2, length_penalty=length_penalty,
                              include_stop_str_in_output=keep_eos)
    search = BeamSearch([[7]], params, {EOS})
    assert search.live_token_ids() == [[7]]
    search.advance([step((5, -1.0), (6, -1.5))])
    assert search.live_token_ids() == [[7, 5]]
    search.advance([step((EOS, -0.5), (4, -2.0))])
    assert search.done
    (out,) = search.outputs(lambda ids: " ".join(map(str, ids)))
    (seq,) = out.sequences
    short = [7, 5, EOS] if keep_eos else [7, 5]
    assert (seq.tokens, seq.cum_logprob, seq.finish_reason) == (
        (short, -1.5, "stop") if best == "short" else ([7, 5, 4], -3.0, "length"))
    assert seq.output_text == ("5" if best == "short" else "5 4")  # EOS never in the text


def test_every_eos_offer_finishes_and_survivors_are_the_best_others():
    """Width 2: both beams offer EOS; both finish. Survivors are the best 2 non-EOS offers over both
    beams by cumulative logprob, not per beam."""
    search = BeamSearch([[7]], BeamSearchParams(beam_width=2, max_tokens=3), {EOS})
    search.advance([step((5, -0.1), (6, -0.2), (EOS, -3.0), (8, -4.0))])
    assert search.live_token_ids() == [[7, 5], [7, 6]]
    search.advance([step((EOS, -0.3), (9, -0.4), (10, -5.0), (11, -6.0)),
                    step((12, -0.05), (EOS, -0.6), (13, -0.7), (14, -7.0))])
    assert search.live_token_ids() == [[7, 6, 12], [7, 5, 9]]  # -0.25 and -0.5; 13 (-0.9) is out
    search.advance([step((EOS, -9.0), (15, -0.1), (16, -0.2), (17, -0.3)),
                    step((18, -0.1), (19, -0.2), (20, -0.3), (21, -0.4))])
    (out,) = search.outputs(str)
    # finished: [7] -3.0/1, [7,5] -0.4/2, [7,6] -0.8/2, [7,6,12] -9.25/3; live: [7,6,12,15] -0.35/4,
    # [7,6,12,16] -0.45/4 (the best two of the last round)
    assert [(s.tokens, s.finish_reason) for s in out.sequences] == [([7, 6, 12, 15], "length"), ([7, 6, 12, 16],
                                                                                              "length")]
    assert [s.cum_logprob for s in out.sequences] == pytest.approx([-0.35, -0.45])


def test_bad_params_name_the_field():
    for kwargs, name in (({"beam_width": 0}, "beam_width"), ({"beam_width": 11}, "beam_width"),
                         ({"max_tokens": 0}, "max_tokens"), ({"temperature": 0.7}, "temperature"),
                         ({"length_penalty": float("nan")}, "length_penalty")):
        with pytest.raises(ValueError, match=f"^{name}:"):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})


def test_a_prompt_without_room_for_max_tokens_is_refused(llm):
    with pytest.raises(ValueError, match="^max_tokens:"):
        llm.beam_search([list(range(100, 200))], BeamSearchParams(beam_width=2, max_tokens=40))
