"""Suffix decoding (Oliaro et al., "SuffixDecoding: Extreme Speculative Decoding for Emerging AI
Applications"): drafts come from bounded-depth suffix trees of token ids, no model involved.

A suffix tree here is a trie of every suffix of the inserted sequences, each truncated to
`max_depth` tokens; a node's `count` is how many times its path occurs. Two kinds are kept:

- per request: its prompt + output so far, extended by each token as it arrives (O(max_depth): the
  request keeps the nodes where its last `max_depth` suffixes end, and each moves one child down);
- global: the outputs of finished requests (the `max_cached_requests` most recently finished; -1
  keeps all, 0 keeps no tree). Evicting a request decrements the counts along the paths it
  inserted and drops nodes that reach 0, so the tree is what it would be had it never been added.
  A request also keeps where its suffixes end in the global tree, followed token by token like its
  own and walked afresh (O(max_depth^2)) only after the global tree changed.

Drafting from a node (the end of a suffix of length m of the context that occurs in the tree):
follow the child with the highest count (ties: the smaller token id) while the path's probability,
the product of count(child) / out(node) where out(node) is the sum of the node's children's counts
(the occurrences of the node's path that are followed by a token, so the context's own latest
occurrence, which has nothing after it yet, never counts), stays >= `min_token_prob`, for at most
min(k, floor(max_spec_factor * m + max_spec_offset)) tokens. A draft's score is the sum of its
tokens' path probabilities (the expected number of accepted tokens). Every match length m that
occurs (at most max_depth - 1, leaving room for one token) is tried, in each tree; the best score
wins, ties going to the longer match and then to the per-request tree. Trying only the longest
match would starve the draft: a match of length max_depth - 1 leaves room for a single token.

Tree drafting (`propose_tree`, xLLM's --speculative_suffix_use_tree_spec; arctic-inference's tree
mode) shares the matching, the candidates, the bookkeeping and the choice among candidates; only
the draft from a node differs. Below it, with the same probabilities and the same node budget
(min(k, floor(max_spec_factor * m + max_spec_offset))), nodes are taken best first: the most
probable node of the frontier (the children of the taken nodes, starting from the node's own),
ties going to the higher count, then the smaller token id, then the frontier node found first,
while it is >= `min_token_prob` (it is the frontier's best, so nothing after it is). Each node's
probability is no more than its parent's, so these are the budget's most probable nodes whose
ancestors are all taken; the depth is bounded by the trees' (match + draft <= max_depth) as a
path's is. A candidate's score is again the sum of its nodes' probabilities. The chosen nodes are
emitted depth first, each node's children most probable first (the order they were taken in), so
any prefix of the list is a tree and the first path (each node's first child) is the greedy path
below the node, cut where the budget ran out. Path and tree mode agree when the tree is a single
chain; otherwise the tree may spend the budget on a sibling branch before finishing the greedy
path, and its larger score may pick a different candidate (see tests/spec_decode/test_suffix.py).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from heapq import heappop, heappush
from typing import Any

_EPS = 1e-9  # floor(max_spec_factor * m + max_spec_offset) must not lose 1 to rounding (0.29 * 100)


class _Node:
    """One trie node: children by token, occurrences of its path, and the sum of its children's counts."""

    __slots__ = ("children", "count", "out")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0
        self.out = 0


def _extend(root: _Node, ends: list[_Node], token: int, max_depth: int) -> list[_Node]:
    """Append `token` to a sequence whose suffixes of length 1, 2, ... end at `ends` (at most
    `max_depth` of them): the returned list is the same for the longer sequence. O(max_depth)."""
    new_ends = []
    append = new_ends.append
    for parent in (root, *ends[:max_depth - 1]):
        children = parent.children
        child = children.get(token)
        if child is None:
            child = children[token] = _Node()
        child.count += 1
        parent.out += 1
        append(child)
    return new_ends


def _follow(root: _Node, ends: list[_Node], token: int, max_len: int) -> list[_Node]:
    """Like `_extend` but read-only, for a sequence not in the tree: `ends` holds the nodes of its
    suffixes of length 1, 2, ... up to the first not in the tree, at most `max_len` of them."""
    new_ends = []
    for parent in (root, *ends[:max_len - 1]):
        child = parent.children.get(token)
        if child is None:
            break
        new_ends.append(child)
    return new_ends


def _insert(root: _Node, tokens: Sequence[int], max_depth: int) -> None:
    """Add every suffix of `tokens` (truncated to max_depth) to the tree at `root`."""
    ends: list[_Node] = []
    for token in tokens:
        ends = _extend(root, ends, token, max_depth)


def _remove(root: _Node, tokens: Sequence[int], max_depth: int) -> None:
    """Undo `_insert(root, tokens, max_depth)`: decrement along each suffix's path, dropping nodes
    whose count reaches 0 (their whole subtree came from this one occurrence)."""
    for start in range(len(tokens)):
        node = root
        for token in tokens[start:start + max_depth]:
            child = node.children[token]
            child.count -= 1
            node.out -= 1
            if child.count == 0:
                del node.children[token]
                break
            node = child


def _rank(item: tuple[int, _Node]) -> tuple[int, int]:
    """Children order for drafting: the highest count, then the smaller token id."""
    return item[1].count, -item[0]


def _draft(node: _Node, limit: int, min_token_prob: float) -> tuple[list[int], float]:
    """The greedy path below `node`: (tokens, sum of their path probabilities)."""
    tokens: list[int] = []
    prob, score = 1.0, 0.0
    while len(tokens) < limit and node.out:
        children = node.children
        if len(children) == 1:
            (token, child), = children.items()
        else:
            token, child = max(children.items(), key=_rank)
        prob *= child.count / node.out
        if prob < min_token_prob:
            break
        tokens.append(token)
        score += prob
        node = child
    return tokens, score


def _draft_tree(node: _Node, limit: int, min_token_prob: float) -> tuple[list[tuple[int, int]], float]:
    """The best-first tree below `node`: its nodes as (token, index of the parent in this list or
    -1) in the order taken, and the sum of their path probabilities."""
    taken: list[tuple[int, int]] = []
    score = 0.0
    # (-probability, -count, token, when pushed, node, parent's index in taken)
    frontier: list[tuple[float, int, int, int, _Node, int]] = []
    pushed = 0
    parent, prob, index = node, 1.0, -1  # the node whose children join the frontier next
    while True:
        out = parent.out
        for token, child in parent.children.items():
            child_prob = prob * (child.count / out)  # as `_draft` computes it: the same floats
            if child_prob >= min_token_prob:
                heappush(frontier, (-child_prob, -child.count, token, pushed, child, index))
                pushed += 1
        if not frontier:
            return taken, score
        neg_prob, _, token, _, parent, index = heappop(frontier)
        prob = -neg_prob
        taken.append((token, index))
        score += prob
        if len(taken) >= limit:
            return taken, score
        index = len(taken) - 1


def _depth_first(taken: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """`_draft_tree`'s nodes in depth-first order, each node's children in the order taken (the
    most probable first): (tokens, parents), parents as indices into the new order, -1 for none."""
    children: list[list[int]] = [[] for _ in range(len(taken) + 1)]  # by parent index + 1
    for i, (_, parent) in enumerate(taken):
        children[parent + 1].append(i)
    tokens: list[int] = []
    parents: list[int] = []
    position = [0] * len(taken)  # taken index -> emitted index (a parent is emitted before its children)
    stack = children[0][::-1]
    while stack:
        i = stack.pop()
        token, parent = taken[i]
        position[i] = len(tokens)
        tokens.append(token)
        parents.append(position[parent] if parent >= 0 else -1)
        stack.extend(reversed(children[i + 1]))
    return tokens, parents


class _Request:
    """A running request: its tokens so far, its own tree, where its suffixes end in that tree, and
    where they end in the global tree as of its version `global_version`."""

    __slots__ = ("tokens", "num_prompt_tokens", "root", "ends", "global_ends", "global_version")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.num_prompt_tokens = 0
        self.root = _Node()
        self.ends: list[_Node] = []
        self.global_ends: list[_Node] = []
        self.global_version = -1


class SuffixProposer:
    """Engine-side suffix-decoding proposer (see the module docstring for the semantics)."""

    def __init__(self, max_depth: int = 64, max_cached_requests: int = -1, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1, max_spec_offset: float = 0.0) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2 (a match plus one draft token), got {max_depth}")
        if max_cached_requests < -1:
            raise ValueError(f"max_cached_requests must be -1 (unlimited), 0 (off) or > 0, got {max_cached_requests}")
        if max_spec_factor < 0 or not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"need max_spec_factor >= 0 and 0 <= min_token_prob <= 1, got "
                             f"{max_spec_factor}, {min_token_prob}")
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.max_spec_offset = max_spec_offset
        self._requests: dict[str, _Request] = {}
        self._global: _Node | None = _Node() if max_cached_requests != 0 else None
        self._cached: deque[list[int]] = deque()  # outputs in the global tree, least recently finished first
        self._version = 0  # of the global tree: requests' global_ends are valid for the version they name

    @property
    def num_cached_requests(self) -> int:
        """How many finished requests' outputs the global tree holds."""
        return len(self._cached)

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int, k: int) -> list[int]:
        """Up to k draft tokens to follow `token_ids` (the request's prompt + output so far).

        Only the tokens past those seen by the previous call are added to the request's tree; a list
        that does not extend them (shorter, or a different last seen token) restarts the request."""
        return self._propose(request_id, token_ids, num_prompt_tokens, k, _draft)

    def propose_tree(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                     k: int) -> tuple[list[int], list[int]]:
        """Up to k draft tokens forming a tree after token_ids: (tokens, parents), parents[i] = -1 for a child of
        the sequence's last token, else the index (< i) of the draft node it follows. Nodes are in depth-first
        order with each node's children visited most probable first, so tokens[:L] along parents [-1, 0, 1, ...]
        is the most probable path (a prefix of the list is always itself a valid tree).

        That first path is path mode's greedy path below the chosen match, cut where the budget ran
        out (it is `propose`'s result whenever the tree is a chain). Updates the request exactly as
        `propose` does (the two may be mixed); see the module docstring."""
        return _depth_first(self._propose(request_id, token_ids, num_prompt_tokens, k, _draft_tree))

    def _propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int, k: int,
                 draft: Callable[[_Node, int, float], tuple[list[Any], float]]) -> list[Any]:
        """`propose` with the draft from a node given: the best of `draft`'s results over the candidates."""
        state = self._requests.get(request_id)
        seen = len(state.tokens) if state is not None else 0
        if state is None or len(token_ids) < seen or (seen and token_ids[seen - 1] != state.tokens[-1]):
            state = self._requests[request_id] = _Request()
            seen = 0
        state.num_prompt_tokens = num_prompt_tokens
        current = state.global_version == self._version
        for token in token_ids[seen:]:
            state.ends = _extend(state.root, state.ends, token, self.max_depth)
            state.tokens.append(token)
            if current:
                state.global_ends = _follow(self._global, state.global_ends, token, self.max_depth - 1)
        if k <= 0:
            return []
        tokens, score = self._best(state.ends, k, draft)
        if self._global is not None and self._global.out:
            if not current:  # new request, or the global tree changed since: walk it once
                state.global_ends = self._matches(self._global, state.tokens)
                state.global_version = self._version
            global_tokens, global_score = self._best(state.global_ends, k, draft)
            if global_score > score:
                tokens = global_tokens
        return tokens

    def finish(self, request_id: str) -> None:
        """Drop the request's state; its output (the tokens after its prompt, as last seen by
        `propose`) joins the global tree, evicting the least recently finished output past
        `max_cached_requests`. An empty output is not cached."""
        state = self._requests.pop(request_id, None)
        if state is None or self._global is None:
            return
        output = state.tokens[state.num_prompt_tokens:]
        if not output:
            return
        _insert(self._global, output, self.max_depth)
        self._cached.append(output)
        self._version += 1
        if self.max_cached_requests > 0 and len(self._cached) > self.max_cached_requests:
            _remove(self._global, self._cached.popleft(), self.max_depth)

    def _matches(self, root: _Node, tokens: list[int]) -> list[_Node]:
        """The nodes where the suffixes of `tokens` of length 1, 2, ... end in the tree at `root`,
        up to the first that is not in it (a suffix of one in the tree is in it too). O(max_depth^2)."""
        nodes: list[_Node] = []
        end = len(tokens)
        for m in range(1, min(end, self.max_depth - 1) + 1):
            node: _Node | None = root
            for token in tokens[end - m:]:
                node = node.children.get(token)
                if node is None:
                    return nodes
            nodes.append(node)
        return nodes

    def _best(self, ends: list[_Node], k: int,
              draft: Callable[[_Node, int, float], tuple[list[Any], float]]) -> tuple[list[Any], float]:
        """The best-scoring draft over the match lengths m = 1, 2, ... whose nodes are `ends`."""
        best: list[Any] = []
        best_score = 0.0
        for m, node in enumerate(ends, start=1):
            limit = min(k, int(self.max_spec_factor * m + self.max_spec_offset + _EPS))
            if limit <= 0 or not node.out:
                continue
            tokens, score = draft(node, limit, self.min_token_prob)
            if tokens and score >= best_score:
                best, best_score = tokens, score
        return best, best_score
