"""Speculative decoding on the real default model (SmolLM2-135M-Instruct), float32: greedy output
identical to decoding without it with every proposer (Suffix path and tree, n-gram, the model as
its own draft), for a copy-heavy and an open-ended chat prompt in one batch, with chunked prefill;
the copy-heavy one accepts drafts."""
from __future__ import annotations

import pytest

from heterollm import LLM, SamplingParams

PASSAGE = ("The library opens at nine in the morning and closes at six in the evening. Visitors must show a "
           "card at the entrance. Books can be borrowed for two weeks.")
CHATS = [[{"role": "user", "content": f"Repeat the following passage exactly:\n\n{PASSAGE}"}],
         [{"role": "user", "content": "Write a short poem about the sea at night."}],
         [{"role": "user", "content": "What is the capital of Japan?"}]]
FLAGS = dict(dtype="float32", num_gpu_blocks_override=64, block_size=16, max_tokens_per_chunk_for_prefill=32)
PARAMS = SamplingParams(max_tokens=48, temperature=0)

pytestmark = pytest.mark.slow


def _chat(**spec):
    llm = LLM("smollm2", **FLAGS, **spec)
    try:
        outs = [llm.chat(chat, PARAMS)[0] for chat in CHATS[:1]] + llm.chat(CHATS, PARAMS)
        return [o.outputs[0].token_ids for o in outs], llm.engine.spec_stats, outs
    finally:
        llm.shutdown()


def test_smollm2_greedy_identity_with_suffix_and_ngram():
    want, _, _ = _chat()
    for spec in (dict(speculative_algorithm="Suffix", num_speculative_tokens=8),
                 dict(speculative_algorithm="Suffix", num_speculative_tokens=8, speculative_suffix_use_tree_spec=True),
                 dict(speculative_algorithm="ngram", num_speculative_tokens=4)):
        got, stats, outs = _chat(**spec)
        assert got == want, spec
        assert outs[0].metrics.spec_num_accepted_tokens > 10, spec  # the passage is copied from the prompt
        assert stats.num_accepted_tokens <= stats.num_draft_tokens


def test_smollm2_as_its_own_draft_model():
    """The draft-model proposer on the real model, drafting for itself: every greedy draft is the
    target's own argmax, so all are accepted, and the output is the same."""
    want, _, _ = _chat()
    got, stats, _ = _chat(speculative_algorithm="draft_model", num_speculative_tokens=3, draft_model="smollm2")
    assert got == want
    assert stats.num_draft_tokens > 50 and stats.num_accepted_tokens == stats.num_draft_tokens
