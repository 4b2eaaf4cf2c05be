"""The prefix cache end to end on a tiny model: identical greedy output with it on and off over
shared system prompts, multi-turn chats, preemption while blocks are shared, and in-batch sharing."""
from __future__ import annotations

import random

import pytest

from helpers import ADMIT_ALL, build_tiny_model
from heterollm import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def make(tiny, cache: bool, blocks: int = 256, **kw) -> LLM:
    return LLM(str(tiny), dtype="float32", block_size=8, num_gpu_blocks_override=blocks, max_model_len=256,
               enable_prefix_cache=cache, **kw)


@pytest.fixture(scope="module")
def off(tiny):
    return make(tiny, False)


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
rng = random.Random(0)
SYSTEM = [rng.randrange(100, 20000) for _ in range(45)]
QUESTIONS = [[rng.randrange(100, 20000) for _ in range(rng.randrange(3, 20))] for _ in range(6)]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def assert_same(a, b, atol=2e-3):
    assert tokens(a) == tokens(b)
    for x, y in zip(a, b):
        for p, q in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert p.logprob == pytest.approx(q.logprob, abs=atol)


def test_shared_system_prompt_reuses_blocks_with_identical_output(tiny, off):
    on = make(tiny, True)
    prompts = [SYSTEM + q for q in QUESTIONS]
    first = on.generate(prompts[:1], GREEDY)
    assert first[0].metrics.num_cached_tokens == 0
    rest = on.generate(prompts[1:], GREEDY)
    assert_same(first + rest, off.generate(prompts, GREEDY))
    # 45 shared tokens = 5 full blocks of 8, found by every later request
    assert [o.metrics.num_cached_tokens for o in rest] == [40] * 5
    kv = on.engine.kv
    assert kv.hits >= 200 and kv.queries == sum(len(p) for p in prompts)
    assert kv.num_free_blocks == on.engine.num_blocks, "every reference is returned"
    # the same prompts again: everything but the last token's block comes from the cache
    again = on.generate(prompts, GREEDY)
    assert_same(again, first + rest)
    assert all(o.metrics.num_cached_tokens == (len(p) - 1) // 8 * 8 for o, p in zip(again, prompts))


def test_multi_turn_chat_reuses_the_previous_turn(tiny, off):
    on = make(tiny, True)
    history = list(SYSTEM)
    for turn, q in enumerate(QUESTIONS[:4]):
        history += q
        [a] = on.generate([history], GREEDY)
        [b] = off.generate([history], GREEDY)
        assert_same([a], [b])
        if turn:
            # the previous prompt and the answer generated to it (the last sampled token was never fed back)
            assert a.metrics.num_cached_tokens >= (len(history) - len(q) - 1) // 8 * 8 - 8
        history += a.outputs[0].token_ids


def test_preemption_while_blocks_are_shared(tiny, off):
    # 24 blocks of 8 for 6 requests of ~55 + 12 tokens: they cannot all run at once
    on = make(tiny, True, blocks=24, **ADMIT_ALL)
    prompts = [SYSTEM + q for q in QUESTIONS]
    outs = on.generate(prompts, GREEDY)
    assert on.engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    assert_same(outs, off.generate(prompts, GREEDY))
    assert on.engine.kv.num_free_blocks == 24
    assert all(r == 0 for r in on.engine.kv.pool.ref)


def test_in_batch_sharing_within_one_step(tiny, off):
    prompts = [SYSTEM + q for q in QUESTIONS[:3]]
    later = make(tiny, True)
    now = make(tiny, True, enable_in_batch_prefix_cache=True)
    a, b = later.generate(prompts, GREEDY), now.generate(prompts, GREEDY)
    assert [o.metrics.num_cached_tokens for o in a] == [0, 0, 0], "admitted in one step: nothing to share yet"
    assert [o.metrics.num_cached_tokens for o in b] == [0, 40, 40], "the first prefill's blocks serve the others"
    ref = off.generate(prompts, GREEDY)
    assert_same(a, ref)
    assert_same(b, ref)


def test_chunked_prefill_commits_chunk_by_chunk(tiny, off):
    on = make(tiny, True, max_tokens_per_chunk_for_prefill=16)
    long = SYSTEM + QUESTIONS[0] + QUESTIONS[1]
    engine = on.engine
    rid = engine.add_request(long, GREEDY)
    cached_after = []  # blocks findable after each prefill step: 16-token chunks of 8-token blocks
    final = None
    while engine.has_unfinished():
        outs = engine.step()
        if len(cached_after) < len(long) // 16:
            cached_after.append(engine.kv.pool.num_cached)
        final = next((o for o in outs if o.request_id == rid and o.finished), final)
    assert cached_after == [2 * (i + 1) for i in range(len(long) // 16)], "two more blocks after every chunk"
    [ref] = off.generate([long], GREEDY)
    [again] = on.generate([long], GREEDY)
    assert final.outputs[0].token_ids == again.outputs[0].token_ids == ref.outputs[0].token_ids
    assert again.metrics.num_cached_tokens == (len(long) - 1) // 8 * 8, "every full prompt block but the last token's"


def test_prompt_logprobs_requests_compute_every_position(tiny, off):
    on = make(tiny, True)
    prompt = SYSTEM + QUESTIONS[0]
    on.generate([prompt], GREEDY)
    p = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0)
    [a] = on.generate([prompt], p)
    [b] = off.generate([prompt], p)
    assert a.metrics.num_cached_tokens == 0
    assert len(a.prompt_logprobs) == len(prompt)
    for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


@pytest.mark.parametrize("frequency", [1, 1000])
def test_chunked_prefill_adopts_blocks_cached_since_admission(tiny, off, frequency):
    # one step's budget of 40 tokens: A takes a 32-token chunk, B the remaining 8; from then on A runs ahead
    on = make(tiny, True, max_tokens_per_chunk_for_prefill=32, max_tokens_per_batch=40,
              chunked_match_frequency=frequency, max_num_partial_prefills=2, max_long_partial_prefills=2)
    prompt = SYSTEM + QUESTIONS[0] + QUESTIONS[1] + QUESTIONS[2]
    outs = on.generate([prompt, prompt], GREEDY)
    assert_same(outs, off.generate([prompt, prompt], GREEDY))
    b = outs[1].metrics.num_cached_tokens
    assert (b >= 24) if frequency == 1 else (b == 0)
