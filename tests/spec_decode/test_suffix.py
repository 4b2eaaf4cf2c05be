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
            draft, score = brute_path(context, seqs, m, limit, max_depth, min_prob)
            draft = list(draft)
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


# ---- tree speculation (propose_tree) ----

E, F = 5, 6


def tree_run(outputs, context, k, **kw):
    """A proposer whose global tree holds `outputs` (each a finished request's output), then one
    propose_tree call for a new request whose whole `context` is prompt."""
    p = SuffixProposer(**kw)
    for i, out in enumerate(outputs):
        finished(p, f"o{i}", [], out)
    return p.propose_tree("r", context, len(context), k)


def first_path(tokens, parents):
    """The nodes reached by taking the first child at each step: the leading run of 0, 1, 2, ..."""
    n = 0
    while n < len(tokens) and parents[n] == n - 1:
        n += 1
    return tokens[:n]


def check_tree(tokens, parents, k):
    """The shape every propose_tree result has: at most k nodes, parents before children, and in
    depth-first (pre-)order: each node's parent is the previous node or one of its ancestors."""
    assert len(tokens) == len(parents) <= max(k, 0)
    for i, parent in enumerate(parents):
        assert -1 <= parent < i
        ancestors, j = [], i - 1
        while j >= 0:
            ancestors.append(j)
            j = parents[j]
        assert parent == -1 or parent in ancestors, (tokens, parents)
    # siblings are distinct tokens (a tree, not a multiset of paths)
    siblings = Counter((parent, token) for token, parent in zip(tokens, parents))
    assert max(siblings.values(), default=1) == 1


# "X A B" three times, "X A C" twice, as five finished outputs. The global tree below "X": A (count 5
# of 5: 1.0); below "X A": B 3/5 = 0.6, C 2/5 = 0.4; B and C are leaves. A context "7 X" matches
# only "X" (m = 1; "7" is nowhere): one candidate, budget min(k, floor(factor * 1 + offset)).
BRANCH = [[X, A, B]] * 3 + [[X, A, C]] * 2


def test_tree_branches_at_the_ambiguous_token():
    # best first: A (1.0), B (0.6), C (0.4); B and C are both children of A (index 0)
    assert tree_run(BRANCH, [7, X], k=5, max_spec_factor=4.0) == ([A, B, C], [-1, 0, 0])
    # path mode: A, then the more frequent B, and nothing after B
    p = SuffixProposer(max_spec_factor=4.0)
    for i, out in enumerate(BRANCH):
        finished(p, f"o{i}", [], out)
    assert p.propose("r", [7, X], 2, 5) == [A, B]
    # min_token_prob: 0.4 is not below 0.4 (kept); above 0.4 the C branch goes; above 0.6 so does B
    assert tree_run(BRANCH, [7, X], k=5, max_spec_factor=4.0, min_token_prob=0.4) == ([A, B, C], [-1, 0, 0])
    assert tree_run(BRANCH, [7, X], k=5, max_spec_factor=4.0, min_token_prob=0.41) == ([A, B], [-1, 0])
    assert tree_run(BRANCH, [7, X], k=5, max_spec_factor=4.0, min_token_prob=0.6) == ([A, B], [-1, 0])
    assert tree_run(BRANCH, [7, X], k=5, max_spec_factor=4.0, min_token_prob=0.61) == ([A], [-1])
    # the same history in the request's own tokens ("X A B" after 5, 6, 7; "X A C" after 8, 0, so no
    # context longer than "X" recurs): below "X" A is 5/5, below "X A" B 3/5 and C 2/5; below
    # "X A B" 5, 6, 7 once each (0.6 / 3 = 0.2 each), below "X A C" 8, 0 (0.4 / 2 = 0.2 each).
    own = [5, X, A, B, 6, X, A, B, 7, X, A, B, 8, X, A, C, 0, X, A, C, 1, X]
    got = SuffixProposer(max_spec_factor=3.0).propose_tree("r", own, len(own), 3)
    assert got == ([A, B, C], [-1, 0, 0])
    # budget 4: the fourth node is the best of five at 0.2, all of count 1: 0, the smallest token
    # (after C, index 2 in depth-first order); in floating point 3/5 * 1/3 falls just below 0.2 and
    # 2/5 * 1/2 does not, which picks among 8 and 0 alone: 0 again
    got = SuffixProposer(max_spec_factor=4.0).propose_tree("r", own, len(own), 4)
    assert got == ([A, B, C, 0], [-1, 0, 0, 2])
    got = SuffixProposer(max_spec_factor=4.0, min_token_prob=0.25).propose_tree("r", own, len(own), 4)
    assert got == ([A, B, C], [-1, 0, 0])


def test_tree_node_budget():
    kw = dict(max_spec_factor=4.0)
    assert tree_run(BRANCH, [7, X], k=3, **kw) == ([A, B, C], [-1, 0, 0])
    assert tree_run(BRANCH, [7, X], k=2, **kw) == ([A, B], [-1, 0])
    assert tree_run(BRANCH, [7, X], k=1, **kw) == ([A], [-1])
    assert tree_run(BRANCH, [7, X], k=0, **kw) == ([], [])
    # the length limit as in path mode: floor(factor * m + offset) with m = 1
    assert tree_run(BRANCH, [7, X], k=5) == ([A], [-1])  # factor 1
    assert tree_run(BRANCH, [7, X], k=5, max_spec_factor=2.0) == ([A, B], [-1, 0])
    assert tree_run(BRANCH, [7, X], k=5, max_spec_factor=2.9) == ([A, B], [-1, 0])
    assert tree_run(BRANCH, [7, X], k=5, max_spec_factor=0.0, max_spec_offset=3.0) == ([A, B, C], [-1, 0, 0])
    assert tree_run(BRANCH, [7, X], k=5, max_spec_factor=0.5) == ([], [])  # floor(0.5) = 0
    # depth: with max_depth 3 a match of m = 1 leaves 2 levels ("X A B" is the deepest path) and the
    # outputs' trees are cut there, so nothing changes; with max_depth 2 only A remains below "X"
    assert tree_run(BRANCH, [7, X], k=5, max_spec_factor=4.0, max_depth=3) == ([A, B, C], [-1, 0, 0])
    assert tree_run(BRANCH, [7, X], k=5, max_spec_factor=4.0, max_depth=2) == ([A], [-1])


# Outputs "X A B D" x3, "X A B E" x1, "X A C" x2. Below "X": A 6/6 = 1. Below "X A": B 4/6, C 2/6.
# Below "X A B": D 3/4 (2/3 * 3/4 = 0.5), E 1/4 (1/6). Best first: A 1, B 2/3, D 1/2, C 1/3, E 1/6.
# Depth first with children most probable first: A, B, D, E, C. (Breadth first would be A, B, C,
# D, E; the order taken A, B, D, C, E.)
DEEP = [[X, A, B, D]] * 3 + [[X, A, B, E]] + [[X, A, C]] * 2


def test_tree_is_depth_first_most_probable_child_first():
    kw = dict(max_spec_factor=10.0)
    assert tree_run(DEEP, [7, X], k=5, **kw) == ([A, B, D, E, C], [-1, 0, 1, 1, 0])
    # budget 4 drops the least probable node (E); then depth first is A, B, D, C
    assert tree_run(DEEP, [7, X], k=4, **kw) == ([A, B, D, C], [-1, 0, 1, 0])
    assert tree_run(DEEP, [7, X], k=5, min_token_prob=0.2, **kw) == ([A, B, D, C], [-1, 0, 1, 0])
    # budget 3: A, B, D (C at 1/3 is below D at 1/2): a chain, the same as path mode
    assert tree_run(DEEP, [7, X], k=3, **kw) == ([A, B, D], [-1, 0, 1])
    for k in range(6):  # any prefix of the list is a tree with the first path leading
        tokens, parents = tree_run(DEEP, [7, X], k=k, **kw)
        check_tree(tokens, parents, k)


def test_tree_ties_go_to_the_higher_count_then_the_smaller_token():
    # Outputs "X A B", "X A F", "X A" x2, "X C" x2: below "X" A 4/6, C 2/6; "X A" is followed only
    # twice (B, F: 2/3 * 1/2 = 1/3 each, count 1), so C (1/3, count 2) ties with B and F on
    # probability and goes first on count; B before F on token id.
    outputs = [[X, A, B], [X, A, F], [X, A], [X, A], [X, C], [X, C]]
    kw = dict(max_spec_factor=10.0)
    assert tree_run(outputs, [7, X], k=2, **kw) == ([A, C], [-1, -1])
    assert tree_run(outputs, [7, X], k=3, **kw) == ([A, B, C], [-1, 0, -1])
    assert tree_run(outputs, [7, X], k=4, **kw) == ([A, B, F, C], [-1, 0, 0, -1])
    # Outputs "X A B", "X C D": A and C 1/2 each (count 1; A first on token id), and B, D 1/2 each
    # below them: taken A, B (B = 2 before C = 3), C, D; depth first A, B, C, D
    outputs = [[X, A, B], [X, C, D]]
    assert tree_run(outputs, [7, X], k=3, **kw) == ([A, B, C], [-1, 0, -1])
    assert tree_run(outputs, [7, X], k=4, **kw) == ([A, B, C, D], [-1, 0, -1, 2])


def test_tree_first_path_can_differ_from_path_mode():
    """Best first is not greedy-path first: the two ways the first path and `propose` part."""
    # 1. the budget goes to a sibling branch first. Outputs "X A B D" x2, "X A B E" x2, "X A C" x3:
    # below "X A" B 4/7, C 3/7; below "X A B" D, E 2/7 each. Path mode, 3 tokens: A, B, D. The tree's
    # 3 nodes: A (1), B (4/7), C (3/7) beats D (2/7): first path A, B.
    outputs = [[X, A, B, D]] * 2 + [[X, A, B, E]] * 2 + [[X, A, C]] * 3
    p = SuffixProposer(max_spec_factor=10.0)
    for i, out in enumerate(outputs):
        finished(p, f"o{i}", [], out)
    assert p.propose("r", [7, X], 2, 3) == [A, B, D]
    assert p.propose_tree("r", [7, X], 2, 3) == ([A, B, C], [-1, 0, 0])
    # with one more node D fits: the first path is the path again
    assert p.propose_tree("r", [7, X], 2, 4) == ([A, B, D, C], [-1, 0, 1, 0])
    # 2. a bushier candidate scores higher as a tree. Context "X X": its own tree has X after "X"
    # (1 token, score 1, m = 1; "X X" is not followed). The global tree ("X A B", "X C D") below "X":
    # path A, B scores 1/2 + 1/2 = 1, a tie that the request's own tree wins; the tree A, B, C, D
    # scores 2 > 1 and wins.
    p = SuffixProposer(max_spec_factor=4.0)
    finished(p, "o1", [], [X, A, B])
    finished(p, "o2", [], [X, C, D])
    assert p.propose("r", [X, X], 2, 4) == [X]
    assert p.propose_tree("r", [X, X], 2, 4) == ([A, B, C, D], [-1, 0, -1, 2])
    # budget 2: the global tree is the chain A, B (score 1): a tie again, to the request's own tree
    assert p.propose_tree("r", [X, X], 2, 2) == ([X], [-1])


def brute_continuations(context, seqs, m, path, max_depth):
    """Counts of each token that follows context[-m:] + path somewhere in `seqs` (none past max_depth:
    the trees hold nothing deeper)."""
    full = list(context[-m:]) + list(path)
    if len(full) >= max_depth:
        return Counter()
    return Counter(seq[s + len(full)] for seq in seqs for s in range(len(seq) - len(full))
                   if seq[s:s + len(full)] == full)


def brute_path(context, seqs, m, limit, max_depth, min_prob):
    """The path draft below the match context[-m:]: (tokens, score), the most frequent continuation
    while the path's probability stays at min_prob or above."""
    path, prob, path_score = (), 1.0, 0.0
    while len(path) < limit:
        counts = brute_continuations(context, seqs, m, path, max_depth)
        if not counts:
            break
        token = min(counts, key=lambda t: (-counts[t], t))
        prob *= counts[token] / sum(counts.values())
        if prob < min_prob:
            break
        path, path_score = path + (token,), path_score + prob
    return path, path_score


def brute_candidate(context, seqs, m, limit, max_depth, min_prob):
    """Path and tree drafts below the match context[-m:] in `seqs`, by scanning the sequences for
    each continuation's count: (path tokens, path score, tree nodes as token tuples in the order
    taken, tree score)."""

    def continuations(path):
        return brute_continuations(context, seqs, m, path, max_depth)

    path, path_score = brute_path(context, seqs, m, limit, max_depth, min_prob)

    # best first: a list kept sorted by hand rather than a heap, ties by count, token, age
    frontier, taken, tree_score, age = [], [], 0.0, 0
    node, prob = (), 1.0
    while True:
        counts = continuations(node)
        for token, n in counts.items():
            q = prob * (n / sum(counts.values()))
            if q >= min_prob:
                frontier.append((-q, -n, token, age, node + (token,)))
                age += 1
        if not frontier or len(taken) == limit:
            break
        frontier.sort()
        neg_q, _, _, _, node = frontier.pop(0)
        prob = -neg_q
        taken.append(node)
        tree_score += prob
    return list(path), path_score, taken, tree_score


def brute_choice(context, outputs, k, max_depth, factor, offset, min_prob):
    """Every candidate ((tree, m) -> its limit and brute_candidate), and the keys path mode and tree
    mode choose (None: no draft): the best score, ties to the longer match, then the request's own
    tree."""
    cands, best = {}, {"path": None, "tree": None}
    for where, seqs in (("own", [context]), ("global", outputs)):
        for m in range(1, min(len(context), max_depth - 1) + 1):
            limit = min(k, int(factor * m + offset + 1e-9))
            if limit > 0:
                cands[where, m] = (limit, *brute_candidate(context, seqs, m, limit, max_depth, min_prob))
    for mode, draft, score in (("path", 1, 2), ("tree", 3, 4)):
        for where in ("own", "global"):
            mine = None
            for key, cand in cands.items():
                if key[0] == where and cand[draft] and (mine is None or cand[score] >= cands[mine][score]):
                    mine = key
            if mine is not None and (best[mode] is None or cands[mine][score] > cands[best[mode]][score]):
                best[mode] = mine
    return cands, best["path"], best["tree"]


def depth_first(nodes):
    """Token tuples (each with its parent path among them) in depth-first order, children in the
    order they come in `nodes`: (tokens, parents)."""
    tokens, parents, index = [], [], {}

    def visit(node, parent):
        index[node] = len(tokens)
        tokens.append(node[-1])
        parents.append(parent)
        for child in nodes:
            if len(child) == len(node) + 1 and child[:-1] == node:
                visit(child, index[node])

    for node in nodes:
        if len(node) == 1:
            visit(node, -1)
    return tokens, parents


@pytest.mark.parametrize("seed", range(4))
def test_tree_matches_brute_force_and_path_mode(seed):
    """Random requests, two identically fed proposers (one called through propose, one through
    propose_tree), against a brute-force scan of the token lists. With T the tree, P what propose
    returns, F the tree's first path and G the path-mode draft of the candidate the tree chose (its
    greedy path under the same length limit):
    - T is the brute-force best-first tree, depth first (and P the brute-force path);
    - F is a prefix of G; F == G when T did not use its whole budget (min_token_prob or the depth
      stopped it, and so they stop G) or T is a chain (nothing else took budget);
    - F == P when besides the tree chose the candidate path mode chose, which a chain always does:
      a chain T has T == P, parents [-1, 0, 1, ...].
    Not claimed: F == P whenever len(P) <= the budget. The tree may spend the budget on a sibling
    before the path's last node, or score a bushier candidate higher (test above)."""
    rng = random.Random(1000 + seed)
    seen = Counter()
    for _ in range(6):
        kw = dict(max_depth=rng.choice([3, 5, 64]), max_spec_factor=rng.choice([1.0, 2.0, 4.0]),
                  max_spec_offset=rng.choice([0.0, 1.0]), min_token_prob=rng.choice([0.0, 0.1, 0.3]))
        seq = [rng.randrange(3) for _ in range(20)]
        outputs = [[rng.randrange(3) for _ in range(rng.randrange(1, 10))] for _ in range(rng.randrange(4))]
        by_path, by_tree = SuffixProposer(**kw), SuffixProposer(**kw)
        for q in (by_path, by_tree):
            for i, out in enumerate(outputs):
                finished(q, f"o{i}", [], out)
        for n in range(1, len(seq) + 1):
            k = rng.randrange(1, 7)
            path = by_path.propose("r", seq[:n], n, k)
            tokens, parents = by_tree.propose_tree("r", seq[:n], n, k)
            check_tree(tokens, parents, k)

            cands, path_key, tree_key = brute_choice(seq[:n], outputs, k, kw["max_depth"], kw["max_spec_factor"],
                                                     kw["max_spec_offset"], kw["min_token_prob"])
            assert path == (cands[path_key][1] if path_key else []), (kw, outputs, seq[:n], k)
            assert (tokens, parents) == (depth_first(cands[tree_key][3]) if tree_key else ([], [])), \
                (kw, outputs, seq[:n], k)

            chain = parents == list(range(-1, len(tokens) - 1))
            f = first_path(tokens, parents)
            g = cands[tree_key][1] if tree_key else []
            assert f == g[:len(f)]
            if chain or len(tokens) < cands[tree_key][0]:
                assert f == g
                if tree_key == path_key:
                    assert f == path
            if chain:
                assert tokens == path and tree_key == path_key
            seen["chain" if chain else "branching"] += 1
            seen["first path == path" if f == path else "first path != path"] += 1
    # not vacuous: both shapes, and both outcomes of the comparison, occur
    assert min(seen.values()) >= 5 and len(seen) == 4, seen


@pytest.mark.parametrize("seed", range(3))
def test_tree_and_path_calls_leave_the_same_state(seed):
    """Two proposers fed the same calls, one through propose and one through propose_tree (other
    requests finishing and being evicted in between, k = 0 calls included), hold the same trees
    and matches, and propose the same afterwards."""
    rng = random.Random(2000 + seed)
    kw = dict(max_depth=rng.choice([3, 6]), max_cached_requests=2, max_spec_factor=2.0)
    by_path, by_tree = SuffixProposer(**kw), SuffixProposer(**kw)
    seq = [rng.randrange(3) for _ in range(30)]
    for n in range(1, len(seq) + 1):
        if rng.random() < 0.2:  # another request runs alongside and finishes
            prompt, out = [rng.randrange(3)], [rng.randrange(3) for _ in range(rng.randrange(6))]
            by_path.propose(f"o{n}", prompt + out, 1, 3)
            by_tree.propose_tree(f"o{n}", prompt + out, 1, 3)
            by_path.finish(f"o{n}")
            by_tree.finish(f"o{n}")
        if rng.random() < 0.1:
            n = max(1, n - 3)  # a rollback restarts the request
        k = rng.randrange(4)
        by_path.propose("r", seq[:n], 2, k)
        by_tree.propose_tree("r", seq[:n], 2, k)
        a, b = by_path._requests["r"], by_tree._requests["r"]
        assert (a.tokens, a.num_prompt_tokens, a.global_version) == (b.tokens, b.num_prompt_tokens, b.global_version)
        assert tree(a.root) == tree(b.root)
        assert tree(by_path._global) == tree(by_tree._global) and list(by_path._cached) == list(by_tree._cached)
        for x, y in ((a.ends, b.ends), (a.global_ends, b.global_ends)):
            assert [(e.count, e.out, tree(e)) for e in x] == [(e.count, e.out, tree(e)) for e in y]
    for probe in (seq, seq + [0], seq + [1, 2]):
        assert by_path.propose("r", probe, 2, 4) == by_tree.propose("r", probe, 2, 4)
        assert by_path.propose_tree("r", probe, 2, 4) == by_tree.propose_tree("r", probe, 2, 4)


def test_tree_probabilities_are_path_modes_to_the_last_bit():
    # Outputs "X A B" x4, "X A D", "X A", "X C" x2: below "X" A 6/8; "X A" is followed 5 times, B 4.
    # B's probability is the product of the ratios, 6/8 * 4/5 (0.6000000000000001 in floating point,
    # where 6/8 * 4 / 5 gives 0.6): with min_token_prob exactly that, both modes keep B.
    outputs = [[X, A, B]] * 4 + [[X, A, D], [X, A], [X, C], [X, C]]
    kw = dict(max_spec_factor=10.0, min_token_prob=(6 / 8) * (4 / 5))
    p = SuffixProposer(**kw)
    for i, out in enumerate(outputs):
        finished(p, f"o{i}", [], out)
    assert p.propose("r", [7, X], 2, 3) == [A, B]
    assert p.propose_tree("r", [7, X], 2, 3) == ([A, B], [-1, 0])
