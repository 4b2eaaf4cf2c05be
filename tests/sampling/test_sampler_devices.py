"""The sampler with its logits on a device other than the CPU (issue 18, defect 1): every tensor it
builds must live on the logits' device. Runs on the CPU through heterollm.testing.devices, which
presents CPU data as living on `meta` and fails any op that mixes the two."""
from __future__ import annotations

import pytest
import torch

from heterollm.sampling import SamplingParams
from heterollm.sampling.sampler import Sampler, SamplingRow
from heterollm.testing.devices import DeviceMixingDetector

LOGITS = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))

CASES = {
    "greedy": [SamplingParams(temperature=0), SamplingParams(temperature=0)],
    "temperature": [SamplingParams(temperature=0.7), SamplingParams(temperature=0)],
    "top_k": [SamplingParams(temperature=1.0, top_k=4), SamplingParams(temperature=0)],
    "top_p": [SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=1.0)],
    "min_p": [SamplingParams(temperature=1.0, min_p=0.1), SamplingParams(temperature=0)],
    "repetition_penalty": [SamplingParams(temperature=0, repetition_penalty=1.3), SamplingParams(temperature=0)],
    "presence_frequency": [SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.3),
                           SamplingParams(temperature=0)],
    "logprobs": [SamplingParams(temperature=0.9, logprobs=3), SamplingParams(temperature=0, logprobs=0)],
    "everything": [SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.02, repetition_penalty=1.2,
                                  presence_penalty=0.4, frequency_penalty=0.2, logprobs=2, seed=3),
                   SamplingParams(temperature=0, logprobs=1)],
}


def rows_for(params: list[SamplingParams]) -> list[SamplingRow]:
    """Three rows (the third repeats the first); generators seeded per row so runs compare."""
    params = [*params, params[0]]
    return [SamplingRow(p, torch.Generator().manual_seed(i), [1, 2, 3], [3, 5, 5]) for i, p in enumerate(params)]


@pytest.mark.parametrize("case", list(CASES))
def test_sampler_builds_every_tensor_on_the_logits_device(case):
    expected = Sampler()(LOGITS.clone(), rows_for(CASES[case]))
    with DeviceMixingDetector(fake="meta") as dev:
        logits = dev.place(LOGITS.clone())
        assert logits.device.type == "meta"
        got = Sampler()(logits, rows_for(CASES[case]))
    assert got == expected
    sampled = any(not p.greedy for p in CASES[case])
    assert ("aten.exponential_.default" in dev.ops) == sampled  # the sampling path really ran


def test_the_grammar_bitmask_is_applied_on_the_logits_device():
    # xgrammar fills its bitmask on the CPU; the sampler unpacks it next to the logits. Row 0 allows
    # tokens 1, 3 and 5 (bits 1, 3, 5 of word 0), row 1 everything (-1), row 2 only token 15.
    bitmask = torch.tensor([[0b101010], [-1], [1 << 15]], dtype=torch.int32)
    rows = rows_for([SamplingParams(temperature=0, logprobs=1), SamplingParams(temperature=0)])
    expected = Sampler()(LOGITS.clone(), rows, bitmask)
    assert expected[0][0] in (1, 3, 5) and expected[0][1] == int(LOGITS[1].argmax()) and expected[0][2] == 15
    with DeviceMixingDetector(fake="meta") as dev:
        got = Sampler()(dev.place(LOGITS.clone()), rows_for([SamplingParams(temperature=0, logprobs=1),
                                                             SamplingParams(temperature=0)]), bitmask)
    assert got == expected
    assert "aten.__rshift__.Tensor" in dev.ops or "aten.bitwise_right_shift.Tensor" in dev.ops
