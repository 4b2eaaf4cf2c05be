"""Speculative decoding seen from outside: the OpenAI API streams the same text as without it, and
/metrics and --enable_profile_step_time report the acceptance figures."""
from __future__ import annotations

import json
import logging

import httpx

from conftest import make_engine, serving

PROMPT = "one two three four, one two three four, one two three four, one two"
FLAGS = dict(speculative_algorithm="Suffix", num_speculative_tokens=4)
"""Suffix decoding: the second request finds the first one's output in the global cache."""


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def _complete(url: str, stream: bool) -> str:
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stream": stream}
    if not stream:
        return httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    text = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


def test_server_text_and_metrics(tiny_llama, caplog):
    with serving(make_engine(tiny_llama)) as plain:
        want = _complete(plain.url, stream=False)
        off = httpx.get(plain.url + "/metrics").text
    assert _metric(off, "heterollm_spec_decode_num_draft_tokens_total") == 0
    caplog.set_level(logging.INFO, logger="heterollm.profile")
    with serving(make_engine(tiny_llama, enable_profile_step_time=True, **FLAGS)) as spec:
        assert _complete(spec.url, stream=False) == want
        assert _complete(spec.url, stream=True) == want
        text = httpx.get(spec.url + "/metrics").text
        spec.engine.profiler.flush()
    drafts = _metric(text, "heterollm_spec_decode_num_draft_tokens_total")
    accepted = _metric(text, "heterollm_spec_decode_num_accepted_tokens_total")
    checks = _metric(text, "heterollm_spec_decode_num_drafts_total")
    assert drafts > 0 and 0 < accepted <= drafts
    assert _metric(text, "heterollm_spec_decode_acceptance_rate") == accepted / drafts
    assert _metric(text, "heterollm_spec_decode_mean_accepted_length") == 1 + accepted / checks
    assert 'heterollm_spec_decode_num_accepted_tokens_per_pos_total{dp_rank="0",model_name="tiny-llama",position="0"}' in text
    assert any("speculative:" in r.getMessage() and "acceptance" in r.getMessage() for r in caplog.records)
