"""SuffixProposer: drafts from suffix trees of the request's own tokens and of finished outputs.

Expected drafts are worked out by hand in the comments (letters stand for token ids); the random
test compares against a brute-force scan of the token lists written here."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from heterollm.spec_decode import suffix
from heterollm.spec_decode.suffix import SuffixProposer

A, B, C, D, X = 1, 2, 3, 4, 9


def run(tokens, k, **kw):
    """One fresh proposer, one call (all of `tokens` is prompt)."""
    return SuffixProposer(**kw).propose("r", tokens, len(tokens), k)


def finished(p, rid, prompt, output):
    """Run a request that ends with `output` after `prompt` through p, then finish it."""
    p.propose(rid, prompt + output, len(prompt), 1)
    p.finish(rid)


def tree(node):
    """The tree below node as nested {token: (count, out, subtree)}."""
    return {t: (c.count, c.out, tree(c)) for t, c in node.children.items()}


def num_nodes(node):
    return sum(1 + num_nodes(c) for c in node.children.values())


def test_repeat_in_prompt_proposes_its_continuation():
    seq = [A, B, C, D, A, B, C]
    # "A B C" occurred before, followed by D A B C; "B C" and "C" too (the match lengths 2 and 1)
    assert run(seq, k=1) == [D]
    # limit = min(k, match length): m=3 gives D A B (score 3) beating m=2's D A and m=1's D
    assert run(seq, k=3) == [D, A, B]
    assert run(seq, k=10) == [D, A, B]  # capped by max_spec_factor * 3, not by k
    assert run(seq, k=2) == [D, A]
    # factor 2: m=3 allows 6, but the earlier occurrence is followed by only 4 tokens
    assert run(seq, k=10, max_spec_factor=2.0) == [D, A, B, C]
    assert run(seq, k=10, max_spec_factor=0.0, max_spec_offset=2.0) == [D, A]
    assert run(seq, k=10, max_spec_factor=0.5) == [D]  # floor(0.5 * 3) = 1 (m=2 gives 1 as well)
    # 0.3 * 3 + 0.1 is 1 (0.9999999999999999 in floating point): one token, from m = 3 only
    assert run(seq, k=10, max_spec_factor=0.3, max_spec_offset=0.1) == [D]
    # "A B C A B C A B": every length-m match continues with C A B ...; the longest earlier
    # occurrence ("A B C A B" at 0) is followed by C A B, which m = 3, 4, 5 all reach (score 3)
    assert run([A, B, C, A, B, C, A, B], k=10) == [C, A, B]
    assert run([A, B, C, A, B, C, A, B], k=2) == [C, A]


def test_context_does_not_match_itself():
    # every suffix of the context is a path of the request's tree, but nothing follows any of them
    assert run([A, B, C, D], k=4) == []
    assert run([A], k=4) == []
    assert run([], k=4) == []
    assert run([A, B, A, B], k=0) == []


def test_min_token_prob_stops_at_an_ambiguous_branch():
    # "X A" is followed by B twice and C twice, each time after a different token (5, 6, 7, 8), so
    # no longer context than "X A" recurs
    seq = [5, X, A, B, 6, X, A, C, 7, X, A, B, 8, X, A, C, 0, X, A]
    # B vs C: 2/4 = 0.5 < 0.6: nothing
    assert run(seq, k=5, max_spec_factor=10.0, min_token_prob=0.6) == []
    # 0.5 is not below 0.5: B (the tie goes to the smaller id); then "X A B" is followed by 6 once and
    # 8 once: 0.5 * 1/2 = 0.25 < 0.5 stops
    assert run(seq, k=5, max_spec_factor=10.0, min_token_prob=0.5) == [B]
    assert run(seq, k=5, max_spec_factor=10.0, min_token_prob=0.3) == [B]
    # default 0.1: B (0.5), then 6 (6 and 8 tie: 0.25), then X, A, C (each the only continuation:
    # 0.25) up to k = 5
    assert run(seq, k=5, max_spec_factor=10.0) == [B, 6, X, A, C]
    # denominators are the counts of continuations, not of occurrences: "X A" occurs 5 times (the
    # last at the end), 4 of them continued; with the occurrence count B would be 2/5 = 0.4 < 0.45
    assert run(seq, k=5, max_spec_factor=10.0, min_token_prob=0.45) == [B]


def reference(context, outputs, k, max_depth, factor, offset, min_prob):
    """Brute force: for each match length m, scan the sequences for each continuation's count."""

    def best(seqs):
        best_draft, best_score = [], 0.0
        for m in range(1, min(len(context), max_depth - 1) + 1):
            limit = min(k, int(factor * m + offset + 1e-9))
            path, draft, prob, score = list(context[-m:]), [], 1.0, 0.0
            while len(draft) < limit and len(path) < max_depth:
                counts = Counter(seq[s + len(path)] for seq in seqs for s in range(len(seq) - len(path))
                                 if seq[s:s + len(path)] == path)
                if not counts:
                    break
                token = min(counts, key=lambda t: (-counts[t], t))
                prob *= counts[token] / sum(counts.values())
                if prob < min_prob:
                    break
                draft.append(token)
                path.append(token)
                score += prob
            if draft and score >= best_score:
                best_draft, best_score = draft, score
        return best_draft, best_score

    own, own_score = best([context])
    other, other_score = best(outputs)
    return other if other_score > own_score else own


@pytest.mark.parametrize("seed", range(6))
def test_incremental_equals_fresh_and_brute_force(seed):
    """One request fed a token per call, while other requests finish (and get evicted) at random
    steps, proposes what a fresh proposer given the whole list and the same finished requests does,
    and what the brute-force scan gives."""
    rng = random.Random(seed)
    for _ in range(6):
        kw = dict(max_depth=rng.choice([2, 3, 5, 64]), max_spec_factor=rng.choice([0.5, 1.0, 2.0]),
                  max_spec_offset=rng.choice([0.0, 1.0]), min_token_prob=rng.choice([0.0, 0.1, 0.4]),
                  max_cached_requests=rng.choice([-1, 1, 2]))
        seq = [rng.randrange(3) for _ in range(24)]
        prompt_len = rng.randrange(len(seq))
        # other requests: (prompt, output, the step of seq at which each finishes), in finishing order
        others = [([rng.randrange(3) for _ in range(rng.randrange(3))],
                   [rng.randrange(3) for _ in range(rng.randrange(12))], rng.randrange(len(seq) + 1))
                  for _ in range(rng.randrange(5))]
        others.sort(key=lambda other: other[2])

        incremental = SuffixProposer(**kw)
        for i, (prompt, out, _) in enumerate(others):
            incremental.propose(f"o{i}", prompt + out, len(prompt), 1)  # running alongside
        for n in range(len(seq) + 1):
            done = [i for i, other in enumerate(others) if other[2] <= n]
            for i in done:
                incremental.finish(f"o{i}")  # a no-op after the first time
            k = rng.randrange(1, 7)
            got = incremental.propose("r", seq[:n], min(prompt_len, n), k)

            fresh = SuffixProposer(**kw)
            for i in done:
                finished(fresh, f"o{i}", others[i][0], others[i][1])
            assert fresh.propose("r", seq[:n], min(prompt_len, n), k) == got, (kw, others, seq[:n], k)

            outputs = [others[i][1] for i in done if others[i][1]]  # empty outputs are not cached
            if kw["max_cached_requests"] > 0:
                outputs = outputs[-kw["max_cached_requests"]:]  # the most recently finished
            assert reference(seq[:n], outputs, k, kw["max_depth"], kw["max_spec_factor"], kw["max_spec_offset"],
                             kw["min_token_prob"]) == got, (kw, others, seq[:n], k)


def test_each_call_adds_only_the_new_tokens(monkeypatch):
    calls = []
    real = suffix._extend
    monkeypatch.setattr(suffix, "_extend", lambda *a: calls.append(a[2]) or real(*a))
    p = SuffixProposer()
    seq = [A, B, C] * 10
    p.propose("r", seq[:5], 5, 3)
    root = p._requests["r"].root
    node = root.children[A]
    for n in range(6, len(seq) + 1):
        p.propose("r", seq[:n], 5, 3)
        p.propose("r", seq[:n], 5, 3)  # nothing new
    assert calls == seq  # each token once, in order
    assert p._requests["r"].root is root and root.children[A] is node  # extended, never rebuilt
    assert root.children[A].count == 10

    # a list that does not extend what was seen (a rollback) starts over: same as a fresh proposer
    assert p.propose("r", [A, B, C, D, A, B, C], 7, 3) == [D, A, B]
    assert p._requests["r"].root is not root
    assert p.propose("r", [A, B, C, A, B, D, A, B, C], 9, 3) == [A, B, D]  # "A B C" → A B (then D)


def test_global_tree_is_walked_only_when_it_changes(monkeypatch):
    walks = []
    real = SuffixProposer._matches
    monkeypatch.setattr(SuffixProposer, "_matches", lambda self, *a: walks.append(1) or real(self, *a))
    p = SuffixProposer()
    p.propose("r", [A], 1, 3)
    assert walks == []  # no global tree to walk yet
    finished(p, "o1", [], [5, 6, 7, 8, 9] * 2)
    assert walks == []  # o1's own call found the global tree empty
    seq = [0, 5, 6, 7, 8, 9, 5, 6]
    for n in range(2, len(seq) + 1):
        p.propose("r", seq[:n], 1, 3)
    assert len(walks) == 1  # r's first call after o1 finished; then followed token by token
    # own tokens: "5 6" → 7 8 (limit 2); cached: "9 5 6" (m=3 up to 7) → 7 8 9
    assert p.propose("r", seq, 1, 3) == [7, 8, 9]
    finished(p, "o2", [], [6, 1, 2, 3])
    p.propose("r", seq + [7], 1, 3)
    p.propose("r", seq + [7, 8], 1, 3)
    assert len(walks) == 3  # o2's own call, then r once after the tree changed


def test_global_cache_proposes_finished_outputs():
    p = SuffixProposer(max_spec_factor=2.0)
    finished(p, "r1", [100, 101], [A, B, C, D, 5])
    assert p.num_cached_requests == 1
    # a different prompt ending in "A B": its own tokens have no earlier "A B", the cache has C D 5
    # (m=2, limit min(3, 4) = 3)
    assert p.propose("r2", [200, 201, A, B], 4, 3) == [C, D, 5]
    # only the output is cached, not the prompt: "100" was never followed by anything in the cache
    assert p.propose("r3", [7, 100], 2, 3) == []


def test_global_cache_disabled():
    p = SuffixProposer(max_cached_requests=0, max_spec_factor=2.0)
    finished(p, "r1", [100, 101], [A, B, C, D, 5])
    assert p.num_cached_requests == 0 and p._global is None
    assert p.propose("r2", [200, 201, A, B], 4, 3) == []


def test_the_better_tree_wins_ties_to_the_request():
    p = SuffixProposer(max_spec_factor=2.0)
    finished(p, "r1", [], [5, 6, 7, 8, 9])
    # own tokens: "6" was followed by 0 5 (m=1, limit 2, score 2); the cache: "5 6" → 7 8 9 (m=2,
    # limit min(3, 4) = 3, score 3)
    assert p.propose("r2", [6, 0, 5, 6], 4, 3) == [7, 8, 9]
    # k=2: own 0 5 (score 2) and cached 7 8 (score 2) tie: the request's own
    assert p.propose("r3", [6, 0, 5, 6], 4, 2) == [0, 5]


def test_eviction_restores_the_tree_without_the_evicted_request():
    p = SuffixProposer(max_cached_requests=1)
    finished(p, "r1", [100], [A, B, C, D, 5])
    assert p.propose("q", [7, A, B], 3, 2) == [C, D]
    finished(p, "r2", [100], [6, 7, 8])
    assert p.num_cached_requests == 1
    assert p.propose("q2", [7, A, B], 3, 2) == []  # r1's continuation is gone
    assert p.propose("q3", [0, 6, 7], 3, 2) == [8]
    # 6 7 8 alone: the suffixes 6 7 8, 7 8, 8 give 6 nodes
    assert num_nodes(p._global) == 6

    # outputs that share paths: evicting the older decrements the shared nodes, not deletes them
    shared = SuffixProposer(max_cached_requests=2, max_depth=3)
    alone = SuffixProposer(max_depth=3)
    finished(shared, "r1", [], [A, B, C, A, B, D])
    for q in (shared, alone):
        finished(q, "r2", [], [A, B, C, 5])
        finished(q, "r3", [], [B, C, A])
    assert shared.num_cached_requests == 2
    assert tree(shared._global) == tree(alone._global)
    # by hand, depth 3: A B C 5 → ABC, BC5, C5, 5 and their prefixes; B C A → BCA, CA, A: the nodes
    # A, AB, ABC, B, BC, BC5, BCA, C, C5, CA, 5 = 11
    assert num_nodes(alone._global) == 11
    assert shared._global.children[B].count == 2 and shared._global.children[B].out == 2
    assert shared._global.children[B].children[C].out == 2  # B C followed by 5 once and A once


def test_max_depth_bounds_the_match_and_the_draft():
    seq = list(range(1, 11)) + list(range(1, 10))  # 1..10 1..9: "1..9" recurs, followed by 10 1..9
    assert run(seq, k=8) == [10, 1, 2, 3, 4, 5, 6, 7]  # m = 9, limit min(8, 9)
    # depth 4: match + draft <= 4 tokens, so m <= 3; with factor 1 the best is m=2: 10 1 (m=3 leaves
    # room for 1 token, m=1 is limited to 1)
    assert run(seq, k=8, max_depth=4) == [10, 1]
    # without the factor's limit: m=1 ("9") reaches 9 10 1 2, 3 tokens
    assert run(seq, k=8, max_depth=4, max_spec_factor=100.0) == [10, 1, 2]
    p = SuffixProposer(max_depth=4)
    p.propose("r", seq, len(seq), 1)
    depth = 0
    node = p._requests["r"].root
    while node.children:
        node = next(iter(node.children.values()))
        depth += 1
    assert depth == 4
    with pytest.raises(ValueError):
        SuffixProposer(max_depth=1)


def test_finish_drops_request_state():
    p = SuffixProposer(max_cached_requests=2)
    for i in range(5):
        p.propose(f"r{i}", [A, B, C, A, B], 2, 3)
    assert len(p._requests) == 5
    for i in range(5):
        p.finish(f"r{i}")
    p.finish("never-seen")
    assert len(p._requests) == 0
    assert p.num_cached_requests == 2 and len(p._cached) == 2
    finished(p, "empty", [A, B], [])  # nothing to cache (and nothing evicted for it)
    assert p.num_cached_requests == 2 and len(p._requests) == 0
    assert p.propose("q", [0, C, A], 1, 1) == [B]
    unlimited = SuffixProposer()
    finished(unlimited, "empty", [A, B], [])
    assert unlimited.num_cached_requests == 0 and num_nodes(unlimited._global) == 0
