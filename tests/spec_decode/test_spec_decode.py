"""Speculative decoding end to end on tiny random models: greedy output identical to decoding without
it (every proposer, several families, batches, chunked prefill, prefix caching, preemption, stops,
logprobs, n > 1, tensor parallelism), no leaked KV blocks, the target's distribution kept at
temperature 1 (and a planted "accept every draft" bug caught), and bad configurations refused
naming the flag."""
from __future__ import annotations

import random

import torch

import pytest

from heterollm import LLM
from heterollm.config import ConfigError
from heterollm.plugins.resolver import LaunchError
from heterollm.sampling import SamplingParams

from helpers import ADMIT_ALL, build_tiny_model

BASE = dict(dtype="float32", block_size=8, num_gpu_blocks_override=256, max_model_len=256)


def _prompts(seed: int = 0) -> list[list[int]]:
    """Copy-heavy prompts (a phrase repeated: n-gram and suffix proposers find it) and random ones."""
    rng = random.Random(seed)
    repeated = [[rng.randrange(5, 300) for _ in range(rng.randrange(4, 9))] * 4 for _ in range(3)]
    plain = [[rng.randrange(5, 300) for _ in range(rng.randrange(5, 40))] for _ in range(2)]
    return repeated + plain


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    out = {f: build_tiny_model(root / f, f) for f in ("llama", "qwen2", "qwen3", "deepseek_v3")}
    # a draft for the llama target: one layer, other weights, the same vocabulary
    out["draft"] = build_tiny_model(root / "draft", "llama", seed=7, num_hidden_layers=1)
    return out


def _run(folder, prompts, params, **flags):
    llm = LLM(str(folder), **{**BASE, **flags})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        free = llm.engine.kv.num_free_blocks, llm.engine.num_blocks
        return outs, free, llm.engine.spec_stats if llm.engine.spec is not None else None
    finally:
        llm.shutdown()


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
METHODS = {
    "ngram": dict(speculative_algorithm="ngram", num_speculative_tokens=3),
    "suffix": dict(speculative_algorithm="Suffix", num_speculative_tokens=4),
    "draft": dict(speculative_algorithm="draft_model", num_speculative_tokens=3),
    "self-draft": dict(speculative_algorithm="draft_model", num_speculative_tokens=3),
    "suffix-tree": dict(speculative_algorithm="Suffix", num_speculative_tokens=6, speculative_suffix_use_tree_spec=True),
}


def _flags(method, models, target="llama"):
    flags = dict(METHODS[method])
    if method == "draft":
        flags["draft_model"] = str(models["draft"])
    if method == "self-draft":  # the target drafting for itself: every greedy draft is accepted
        flags["draft_model"] = str(models[target])
    return flags


@pytest.mark.parametrize("family,method", [
    *((f, m) for f in ("llama", "qwen2", "qwen3") for m in ("ngram", "suffix", "suffix-tree", "self-draft")),
    # MLA verifying drafts, in a chain and as a tree (its tiny model's greedy text repeats no n-gram of
    # the prompt, so the ngram proposer would draft nothing here)
    *(("deepseek_v3", m) for m in ("suffix", "suffix-tree", "self-draft"))])
def test_greedy_output_is_identical(models, family, method):
    prompts = _prompts()
    want, _, _ = _run(models[family], prompts, GREEDY)
    got, (free, total), stats = _run(models[family], prompts, GREEDY, **_flags(method, models, family))
    assert _tokens(got) == _tokens(want)
    assert free == total
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    if method == "self-draft":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    for o in got:
        assert o.metrics.spec_num_accepted_tokens <= o.metrics.spec_num_draft_tokens


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_chunked_prefill_prefix_cache_and_batch_one(models, method):
    """Prompts chunked in 8-token pieces, a shared prefix served from the cache, then one at a time."""
    shared = _prompts(1)[0]
    prompts = [shared + p for p in _prompts(2)]
    flags = dict(max_tokens_per_chunk_for_prefill=8, enable_prefix_cache=True)
    want, _, _ = _run(models["llama"], prompts, GREEDY, **flags)
    got, (free, total), stats = _run(models["llama"], prompts, GREEDY, **flags, **_flags(method, models))
    assert _tokens(got) == _tokens(want)
    assert free == total and stats.num_drafts > 0
    one, _, _ = _run(models["llama"], prompts[:1], GREEDY, max_seqs_per_batch=1, **_flags(method, models))
    assert _tokens(one) == _tokens(want[:1])


@pytest.mark.parametrize("method", ["ngram", "self-draft"])
def test_preemption_leaves_no_leak_and_same_tokens(models, method):
    """A cache too small for the batch: requests are preempted (recompute) mid-speculation."""
    prompts = _prompts(3) * 2
    small = dict(num_gpu_blocks_override=14, **ADMIT_ALL)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want, _, _ = _run(models["llama"], prompts, params)
    got, (free, total), stats = _run(models["llama"], prompts, params, **small, **_flags(method, models))
    assert _tokens(got) == _tokens(want)
    assert sum(o.metrics.num_preemptions for o in got) > 0
    assert free == total
    assert stats.num_accepted_tokens > 0


def test_abort_mid_speculation_frees_every_block(models):
    llm = LLM(str(models["llama"]), **BASE, **_flags("self-draft", models))
    try:
        engine = llm.engine
        start = engine.kv.num_free_blocks
        for i, p in enumerate(_prompts(4)):
            engine.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True),
                               request_id=f"r{i}")
        for _ in range(4):
            engine.step()
        assert engine.spec_stats.num_drafts > 0  # drafts were in flight
        for i in range(5):
            engine.abort(f"r{i}")
        assert not engine.has_unfinished()
        assert engine.kv.num_free_blocks == start
    finally:
        llm.shutdown()


def test_stops_logprobs_and_n(models):
    """A stop token inside an accepted run of drafts ends the output there; logprobs are the
    target's; n > 1 and max_tokens are kept exactly."""
    prompts = _prompts(5)
    want, _, _ = _run(models["llama"], prompts, GREEDY)
    stop_at = want[0].outputs[0].token_ids[9]
    cut = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, stop_token_ids=[stop_at], logprobs=2)
    base, _, _ = _run(models["llama"], prompts, cut)
    got, (free, total), stats = _run(models["llama"], prompts, cut, **_flags("self-draft", models))
    assert stats.num_accepted_tokens > 0
    assert _tokens(got) == _tokens(base)
    assert got[0].outputs[0].token_ids[-1] == stop_at and got[0].outputs[0].stop_reason == stop_at
    for g, b in zip(got, base):
        lg, lb = g.outputs[0].logprobs, b.outputs[0].logprobs
        assert len(lg) == len(lb) == len(g.outputs[0].token_ids)
        for x, y in zip(lg, lb):
            assert x.token_id == y.token_id and x.rank == y.rank
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
    n2 = SamplingParams(n=2, max_tokens=7, temperature=0, ignore_eos=True)
    got, _, _ = _run(models["llama"], prompts, n2, **_flags("ngram", models))
    want, _, _ = _run(models["llama"], prompts, n2)
    assert _tokens(got) == _tokens(want)
    assert all(len(c.token_ids) == 7 for o in got for c in o.outputs)


def test_stop_string_in_accepted_drafts(models):
    """Text after a stop string that speculation produced in the same step never shows."""
    llm = LLM(str(models["llama"]), **BASE)
    try:
        text = llm.generate([{"prompt_token_ids": _prompts(6)[0]}], GREEDY)[0].outputs[0].text
    finally:
        llm.shutdown()
    stop = text[len(text) // 2:len(text) // 2 + 3]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, stop=[stop])
    want, _, _ = _run(models["llama"], _prompts(6)[:1], params)
    got, _, stats = _run(models["llama"], _prompts(6)[:1], params, **_flags("self-draft", models))
    assert stats.num_accepted_tokens > 0
    assert got[0].outputs[0].text == want[0].outputs[0].text == text[:text.index(stop)]
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


@pytest.mark.slow  # two ranks spawned (7 s)
def test_tensor_parallel_draft_model(models):
    prompts = _prompts(7)[:3]
    want, _, _ = _run(models["llama"], prompts, GREEDY)
    got, (free, total), stats = _run(models["llama"], prompts, GREEDY, tp_size=2, **_flags("draft", models))
    assert _tokens(got) == _tokens(want)
    assert free == total and stats.num_drafts > 0


# -- bad configurations ----------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, named", [
    (dict(speculative_algorithm="Suffix"), "--speculative_algorithm=Suffix: has no effect without "
                                           "--num_speculative_tokens"),
    (dict(num_speculative_tokens=2, speculative_algorithm="DFlash"), "--speculative_algorithm=DFlash"),
    (dict(num_speculative_tokens=2), "--speculative_algorithm=MTP: needs multi-token-prediction heads"),
    (dict(num_speculative_tokens=2, speculative_algorithm="Eagle3"), "--speculative_algorithm=Eagle3"),
    (dict(num_speculative_tokens=2, speculative_algorithm="draft_model"), "needs --draft_model"),
    (dict(num_speculative_tokens=2, speculative_algorithm="ngram", speculative_suffix_use_tree_spec=True),
     "--speculative_suffix_use_tree_spec: tunes Suffix decoding"),
    (dict(num_speculative_tokens=2, speculative_algorithm="ngram", enable_probabilistic_draft=True),
     "--enable_probabilistic_draft"),
    (dict(num_speculative_tokens=2, speculative_algorithm="ngram", enable_schedule_overlap=True),
     "--enable_schedule_overlap"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 0}), "num_speculative_tokens must be"),
    (dict(speculative_config={"method": "medusa", "num_speculative_tokens": 2}), "--speculative_config: method"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}), "'lookahead'"),
    (dict(speculative_config={"method": "suffix", "num_speculative_tokens": 2}, num_speculative_tokens=2),
     "both configure"),
])
def test_bad_configuration_names_the_flag(models, flags, named):
    with pytest.raises((ConfigError, LaunchError, ValueError)) as err:
        LLM(str(models["llama"]), **BASE, **flags)
    assert named in str(err.value)


def test_unknown_algorithm_is_refused(models):
    with pytest.raises((ConfigError, LaunchError, ValueError)) as err:
        LLM(str(models["llama"]), **BASE, num_speculative_tokens=2, speculative_algorithm="medusa")
    assert "speculative_algorithm" in str(err.value)


def test_draft_with_another_vocabulary_is_refused(models, tmp_path):
    other = build_tiny_model(tmp_path / "other", "llama", vocab_size=1000)
    with pytest.raises(ConfigError) as err:
        LLM(str(models["llama"]), **BASE, speculative_algorithm="draft_model", num_speculative_tokens=2,
            draft_model=str(other))
    assert "--draft_model" in str(err.value) and "vocabulary" in str(err.value)


def test_fastdeploy_speculative_config_works(models):
    prompts = _prompts(8)
    want, _, _ = _run(models["llama"], prompts, GREEDY)
    got, _, stats = _run(models["llama"], prompts, GREEDY,
                         speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}')
    assert _tokens(got) == _tokens(want) and stats.num_drafts > 0


# -- the distribution at temperature 1 ---------------------------------------------------------------------
ALLOWED = [11, 22, 33, 44, 55, 66]
CHI2_CRITICAL_001 = {d: d * (1 - 2 / (9 * d) + 3.0902 * (2 / (9 * d)) ** 0.5) ** 3 for d in range(1, 200)}
"""Upper 0.1% points of chi-square (Wilson-Hilferty; z = 3.0902): a real difference, not chance."""


def _pair_counts(folder, max_tokens: int = 4, proposer=None, **flags):
    """(first, second) generated token of 400 seeded samples at temperature 1 over six allowed tokens
    (`proposer`: replaces the engine's own, e.g. a fixed draft tree)."""
    params = [SamplingParams(n=50, seed=1000 * i, temperature=1.0, max_tokens=max_tokens, ignore_eos=True,
                             allowed_token_ids=ALLOWED) for i in range(8)]
    llm = LLM(str(folder), **{**BASE, "num_gpu_blocks_override": 4096, **flags})
    try:
        if proposer is not None:
            llm.engine.proposer = proposer
        outs = llm.generate([{"prompt_token_ids": ALLOWED * 4}] * 8, params)
        stats = llm.engine.spec_stats
    finally:
        llm.shutdown()
    counts: dict[tuple[int, int], int] = {}
    for o in outs:
        for c in o.outputs:
            key = tuple(c.token_ids[:2])
            counts[key] = counts.get(key, 0) + 1
    return counts, stats


def _chi2(a: dict, b: dict) -> tuple[float, int]:
    """Two-sample chi-square of equal-size samples over their bins (bins under 10 in all pooled)."""
    keys = sorted(set(a) | set(b))
    big = [k for k in keys if a.get(k, 0) + b.get(k, 0) >= 10]
    pooled = (sum(a.get(k, 0) for k in keys if k not in big), sum(b.get(k, 0) for k in keys if k not in big))
    pairs = [(a.get(k, 0), b.get(k, 0)) for k in big] + ([pooled] if sum(pooled) else [])
    return sum((x - y) ** 2 / (x + y) for x, y in pairs), len(pairs) - 1


@pytest.fixture(scope="module")
def reference_pairs(models):
    return _pair_counts(models["llama"])[0]


NGRAM_EVERYWHERE = dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 3, '
                                           '"prompt_lookup_min": 1, "prompt_lookup_max": 2}')


@pytest.mark.slow  # ~13 s with its fixtures: thousands of draws for the chi-square test
def test_rejection_sampling_keeps_the_distribution(models, reference_pairs):
    """Deterministic drafts (n-gram, q one-hot) and sampled drafts of another model (q carried):
    the first two tokens are distributed as without speculation."""
    for flags in (NGRAM_EVERYWHERE, dict(speculative_algorithm="draft_model", num_speculative_tokens=3,
                                         draft_model=str(models["draft"]), enable_probabilistic_draft=True)):
        got, stats = _pair_counts(models["llama"], **flags)
        assert stats.num_draft_tokens > 400 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        stat, df = _chi2(got, reference_pairs)
        assert df >= 10
        assert stat < CHI2_CRITICAL_001[df], (flags, stat, df)


@pytest.mark.slow  # the check's own planted-bug test (it can fail): ~10 s, in CI's slow step
def test_skipping_rejection_is_caught(models, reference_pairs, monkeypatch):
    """The same check fails when every draft is accepted (the planted bug): it can fail."""
    import heterollm.model_executor.runner as runner
    from heterollm.spec_decode import rejection

    def accept_all(logits, drafts, params, generator, draft_probs=None):
        return list(drafts) + rejection.verify(logits[len(drafts):], [], params, generator)

    monkeypatch.setattr(runner, "verify", accept_all)
    got, _ = _pair_counts(models["llama"], **NGRAM_EVERYWHERE)
    stat, df = _chi2(got, reference_pairs)
    assert stat > CHI2_CRITICAL_001[df]


# -- tree speculation ------------------------------------------------------------------------------------
TREE = dict(speculative_algorithm="Suffix", num_speculative_tokens=6, speculative_suffix_use_tree_spec=True)


class OracleTree:
    """Draft trees built from the known greedy answer: the right continuation sits on the first
    path on even steps and in a second branch on odd ones (its K/V then lands in slots that are not
    its positions' and must be recomputed), with wrong siblings beside it."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]]) -> None:
        self.answers = answers
        self.side = 0

    def propose_tree(self, request_id, token_ids, num_prompt_tokens, k):
        answer = self.answers[tuple(token_ids[:num_prompt_tokens])]
        done = len(token_ids) - num_prompt_tokens
        right = answer[done:done + 3]
        if not right:
            return [], []
        wrong = 5 + (right[0] + 1) % 300
        self.side += 1
        if self.side % 2:  # wrong branch first: the right path is the second subtree
            tokens, parents = [wrong, wrong], [-1, 0]
        else:
            tokens, parents = [], []
        base = len(tokens)
        for j, t in enumerate(right):
            tokens.append(t)
            parents.append(-1 if j == 0 else base + j - 1)
        tokens.append(wrong)  # a wrong sibling of the right path's second node
        parents.append(base)
        return tokens[:k], parents[:k]

    def finish(self, request_id):
        pass


def test_tree_verification_keeps_greedy_output(models):
    prompts = _prompts(9)
    want, _, _ = _run(models["llama"], prompts, GREEDY)
    answers = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, want)}
    llm = LLM(str(models["llama"]), **BASE, **TREE)
    try:
        llm.engine.proposer = OracleTree(answers)
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        stats, free = llm.engine.spec_stats, llm.engine.kv.num_free_blocks
    finally:
        llm.shutdown()
    assert _tokens(got) == _tokens(want)
    assert free == 256
    # every step accepts the right path (3 drafts, or fewer near the end)
    assert stats.num_accepted_tokens >= 2 * stats.num_drafts


class FixedTree:
    """The same small tree after every token: children 11, 33 and 55 of the last token, 22 under 11,
    44 under 33 (allowed tokens of the distribution test)."""

    def propose_tree(self, request_id, token_ids, num_prompt_tokens, k):
        return [11, 22, 33, 44, 55][:k], [-1, 0, -1, 2, -1][:k]

    def finish(self, request_id):
        pass


def _tree_pairs(folder):
    # max_tokens 8: the second step has room for the whole tree (a step never drafts past max_tokens)
    return _pair_counts(folder, max_tokens=8, proposer=FixedTree(), **TREE)


def _second(pairs: dict) -> dict:
    """The second token's counts (where a tree's bias would sit: the first token has no drafts)."""
    out: dict[int, int] = {}
    for (_, second), n in pairs.items():
        out[second] = out.get(second, 0) + n
    return out


@pytest.mark.slow  # ~7 s: thousands of draws for the chi-square test
def test_tree_rejection_sampling_keeps_the_distribution(models, reference_pairs):
    got, stats = _tree_pairs(models["llama"])
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for a, b in ((got, reference_pairs), (_second(got), _second(reference_pairs))):
        stat, df = _chi2(a, b)
        assert stat < CHI2_CRITICAL_001[df], (stat, df)


@pytest.mark.slow  # the check's own planted-bug test (it can fail): ~10 s, in CI's slow step
def test_tree_rejection_without_residual_is_caught(models, reference_pairs, monkeypatch):
    """Planted bug: a rejected child's token is not taken out of the distribution that the next
    child is tried against and that the final token is drawn from. The same check fails."""
    import heterollm.model_executor.runner as runner
    from heterollm.spec_decode import rejection

    def verify_tree_planted(logits, drafts, parents, params, generator):
        children: dict[int, list[int]] = {}
        for i, parent in enumerate(parents):
            children.setdefault(parent, []).append(i)
        node, tokens, rows = -1, [], []
        while True:
            rows.append(node + 1)
            p = rejection.sampling_probs(logits[node + 1:node + 2], [params])[0]
            for c in children.get(node, []):
                if float(torch.rand(1, generator=generator)) < float(p[drafts[c]]):
                    tokens.append(drafts[c])
                    node = c
                    break
            else:
                tokens.append(int(rejection.draw(p.unsqueeze(0), [generator])[0]))
                return tokens, rows

    monkeypatch.setattr(runner, "verify_tree", verify_tree_planted)
    got, _ = _tree_pairs(models["llama"])
    stat, df = _chi2(_second(got), _second(reference_pairs))
    assert stat > CHI2_CRITICAL_001[df], (stat, df)


def test_tree_needs_an_attention_backend_with_tree_masks(models):
    """The example attention family (plugins/example_attention) has no tree masks: refused by name."""
    with pytest.raises(LaunchError) as err:
        LLM(str(models["llama"]), **BASE, **TREE, extension_impl="example")
    assert "--speculative_suffix_use_tree_spec" in str(err.value) and "tree" in str(err.value)
