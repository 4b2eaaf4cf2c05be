"""SamplingParams' limits at their exact boundaries, and the error that names the field (README:
"A bad value raises ValueError naming the field"). The ranges are the OpenAI / vLLM ones; the
message states the rule and echoes the value: "<field>: <rule>, got <value>"."""
from __future__ import annotations

import math

import pytest

from heterollm.sampling import SamplingParams, SamplingParamsError

INT = "must be an integer >= 1"
RANGE_20 = "must be an integer in [0, 20]"
PENALTY = "must be in [-2, 2]"
SEED = "must be an integer that fits in 64 bits (signed)"

# field, values accepted (boundaries included), values refused (just past them), the rule
LIMITS = [
    ("n", [1, 128], [0, -1, 1.5], INT),
    ("max_tokens", [None, 1], [0, 2.0], INT),
    ("min_tokens", [0, 3], [-1, 1.0], "must be an integer >= 0"),
    ("temperature", [0.0, 0, 2.0], [-1e-9, math.inf], "must be a finite number >= 0"),
    ("top_p", [1e-9, 1.0], [0.0, 1.0000001], "must be in (0, 1]"),
    ("top_k", [0, 1, 50], [-2, 1.5], "must be -1, 0 (disabled) or a positive integer"),
    ("min_p", [0.0, 1.0], [-1e-9, 1.0000001], "must be in [0, 1]"),
    ("repetition_penalty", [1e-9, 2.0], [0.0, -1.0, math.inf], "must be a finite number > 0"),
    ("presence_penalty", [-2.0, 2.0, -2, 2], [-2.0000001, 2.0000001, -3, 3], PENALTY),
    ("frequency_penalty", [-2.0, 2.0, -2, 2], [-2.0000001, 2.0000001, -3, 3], PENALTY),
    ("seed", [None, -2**63, 0, 2**63 - 1], [-2**63 - 1, 2**63, 2**64, 1.5], SEED),
    ("stop_token_ids", [[0], [0, 7]], [[-1], ["7"]], "must be non-negative integers"),
    ("logprobs", [None, 0, 20], [-1, 21, 1.0], RANGE_20),
    ("prompt_logprobs", [None, 0, 20], [-1, 21, 1.0], RANGE_20),
]


@pytest.mark.parametrize("field,ok,_,__", LIMITS, ids=[f[0] for f in LIMITS])
def test_boundary_values_are_accepted(field, ok, _, __):
    for value in ok:
        params = SamplingParams(**{field: value})
        assert getattr(params, field) == value


@pytest.mark.parametrize("field,_,bad,rule", LIMITS, ids=[f[0] for f in LIMITS])
def test_values_past_a_boundary_are_refused_naming_the_field(field, _, bad, rule):
    for value in bad:
        with pytest.raises(SamplingParamsError) as err:
            SamplingParams(**{field: value})
        assert isinstance(err.value, ValueError) and err.value.field == field
        assert str(err.value) == f"{field}: {rule}, got {value!r}"


def test_nan_temperature_is_refused():
    with pytest.raises(SamplingParamsError, match=r"^temperature: must be a finite number >= 0, got nan$"):
        SamplingParams(temperature=math.nan)


def test_seed_leaves_room_for_every_choice():
    # choice i samples with seed + i: the last one must still fit in 64 bits
    assert SamplingParams(seed=2**63 - 3, n=3).seed == 2**63 - 3
    with pytest.raises(SamplingParamsError, match=r"^seed: "):
        SamplingParams(seed=2**63 - 2, n=3)


def test_min_tokens_at_most_max_tokens():
    assert SamplingParams(min_tokens=5, max_tokens=5).min_tokens == 5
    assert SamplingParams(min_tokens=4000, max_tokens=None).min_tokens == 4000
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(min_tokens=6, max_tokens=5)
    assert err.value.field == "min_tokens" and str(err.value) == "min_tokens: must be <= max_tokens, got 6"


def test_stop_strings():
    assert SamplingParams(stop="end").stop == ["end"], "one string is a list of one"
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []
    for bad in ([""], [3]):
        with pytest.raises(SamplingParamsError) as err:
            SamplingParams(stop=bad)
        assert str(err.value) == f"stop: must be non-empty strings, got {bad!r}"


def test_top_k_minus_one_means_off_and_one_means_greedy():
    assert SamplingParams(top_k=-1).top_k == 0 and not SamplingParams(top_k=-1, temperature=1).greedy
    assert SamplingParams(top_k=1).top_k == 1 and SamplingParams(top_k=1, temperature=1).greedy
    assert SamplingParams(top_k=2).top_k == 2


def test_which_params_count_as_penalties():
    assert not SamplingParams().has_penalties
    for kw in ({"repetition_penalty": 1.1}, {"presence_penalty": -0.5}, {"frequency_penalty": 0.1}):
        assert SamplingParams(**kw).has_penalties, kw


@pytest.mark.parametrize("kwargs, message", [
    ({"n": 3, "best_of": 2}, "best_of: must be an integer >= n, got 2"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias: must map non-negative integer token ids to finite numbers, got {-1: 1.0}"),
    ({"logit_bias": {5: float("inf")}}, "logit_bias: must map non-negative integer token ids to finite numbers, "
                                        "got {5: inf}"),
    ({"allowed_token_ids": []}, "allowed_token_ids: must be a non-empty list of non-negative integers, got []"),
    ({"bad_words": [" "]}, "bad_words: must be a list of strings that are not blank, got [' ']"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens: must be -1 (max_model_len) or an integer >= 1, got 0"),
])
def test_the_sampling_surface_fields_say_what_is_wrong(kwargs, message):
    """The whole message (the field, the rule, the value), as the HTTP 400 and the CLI print it."""
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert str(info.value) == message and info.value.field == message.split(":")[0]
