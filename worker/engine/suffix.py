"""Suffix decoding's proposer (Oliaro et al., "SuffixDecoding: Extreme Speculative
Decoding for Emerging AI Applications", 2024; vLLM's `suffix` method): the request's last
tokens are matched, as long as they match (up to a depth), against its own tokens and
those of recently finished requests, and the guesses follow the continuation most of the
longest matches agree on. Across requests this predicts what agents and tools repeat
(the same call formats, the same boilerplate), which prompt lookup, confined to one
request, cannot.

The structure is a bounded index rather than a suffix tree: anchors (the
`min_match`-token n-grams) of the cached requests' tokens map to where they occur;
a lookup extends each occurrence's match backwards and walks the longest ones forwards.
Memory is bounded by `max_requests` cached requests (oldest dropped first) and
`MAX_OCCURRENCES` positions kept per anchor (the latest).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

MAX_OCCURRENCES = 32  # positions kept per anchor (the latest), and candidates searched per source


class SuffixCache:
    """Recently finished requests' tokens, indexed by anchor.

    Args:
        max_requests: requests kept (oldest dropped first); 0 keeps none.
        min_match: anchor length in tokens (the shortest match).
    """

    def __init__(self, max_requests: int, min_match: int) -> None:
        self.max_requests = max_requests
        self.n = min_match
        self.docs: OrderedDict[int, np.ndarray] = OrderedDict()  # doc id -> tokens [num_tokens]
        self.index: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # anchor -> [(doc id, position after it)]
        self._next_id = 0

    def __len__(self) -> int:
        return len(self.docs)

    def add(self, tokens: list[int]) -> None:
        """Cache a finished request's tokens (prompt + output); drops the oldest beyond
        `max_requests`."""
        if self.max_requests == 0 or len(tokens) <= self.n:
            return
        doc = self._next_id
        self._next_id += 1
        self.docs[doc] = np.asarray(tokens, dtype=np.int64)
        n = self.n
        index = self.index
        for end in range(n, len(tokens)):  # an anchor with a token after it
            occ = index.setdefault(tuple(tokens[end - n: end]), [])
            occ.append((doc, end))
            if len(occ) > MAX_OCCURRENCES:
                del occ[0]
        while len(self.docs) > self.max_requests:
            self._drop(next(iter(self.docs)))

    def _drop(self, doc: int) -> None:
        tokens = self.docs.pop(doc).tolist()
        n = self.n
        for end in range(n, len(tokens)):
            key = tuple(tokens[end - n: end])
            occ = self.index.get(key)
            if occ is None:
                continue
            occ[:] = [o for o in occ if o[0] != doc]
            if not occ:
                del self.index[key]

    def occurrences(self, anchor: tuple[int, ...]) -> list[tuple[np.ndarray, int]]:
        """Where `anchor` occurs in the cached requests: (tokens, position after it)."""
        return [(self.docs[d], end) for d, end in self.index.get(anchor, ())]


def match_length(a: np.ndarray, a_end: int, b: np.ndarray, b_end: int, limit: int) -> int:
    """How many tokens before `a_end` in `a` equal those before `b_end` in `b` (at most `limit`)."""
    m = min(limit, a_end, b_end)
    if m == 0:
        return 0
    diff = np.flatnonzero(a[a_end - m: a_end][::-1] != b[b_end - m: b_end][::-1])
    return int(diff[0]) if diff.size else m


def suffix_proposal(tokens: np.ndarray, cache: SuffixCache | None, min_match: int, max_depth: int, k: int,
                    min_prob: float) -> list[int]:
    """Up to `k` guesses for the request whose tokens so far are `tokens` `[num_tokens]`.

    The occurrences of its last `min_match` tokens, in its own earlier tokens and in
    `cache`, are ranked by how far the match extends backwards (up to `max_depth`); from
    the longest ones, each guess is the continuation most of them share, and the walk
    keeps only the occurrences that agree with it. It stops at `k` guesses, when no
    occurrence is left, or when the product of the guesses' shares falls below
    `min_prob`. [] when the last `min_match` tokens occur nowhere else."""
    n_tok = len(tokens)
    if n_tok <= min_match:
        return []
    anchor = tokens[n_tok - min_match:]
    # own earlier occurrences: positions where the anchor ends, before the request's end
    ends = np.flatnonzero(tokens[min_match - 1: n_tok - 1] == anchor[-1]) + min_match  # position after the anchor
    for i in range(1, min_match):
        if not ends.size:
            break
        ends = ends[tokens[ends - 1 - i] == anchor[-1 - i]]
    cands = [(tokens, int(e)) for e in ends[-MAX_OCCURRENCES:]]
    if cache is not None:
        cands += cache.occurrences(tuple(anchor.tolist()))
    if not cands:
        return []
    lengths = [match_length(src, end, tokens, n_tok, max_depth) for src, end in cands]
    best = max(lengths)
    live = [(src, end) for (src, end), m in zip(cands, lengths) if m == best]
    guesses: list[int] = []
    prob = 1.0
    while len(guesses) < k:
        nexts = [int(src[end]) for src, end in live if end < len(src)]
        if not nexts:
            break
        values, counts = np.unique(nexts, return_counts=True)
        top = int(counts.argmax())
        prob *= counts[top] / len(live)
        if prob < min_prob:
            break
        token = int(values[top])
        guesses.append(token)
        live = [(src, end + 1) for src, end in live if end < len(src) and src[end] == token]
    return guesses
