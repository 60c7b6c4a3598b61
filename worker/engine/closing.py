"""Budget-aware closing of constrained outputs: as a constrained request's remaining
output tokens (`max_tokens` minus what it generated) fall to what its grammar still
needs to reach an end, its mask is narrowed to the next token of a short way to that end,
so a JSON answer or tool call that hits the limit still parses instead of being cut in
the middle of a string.

The way to an end is found greedily on a copy of the request's llguidance matcher: from
the tokens the grammar allows, prefer those made only of closing characters (`"`, `}`,
`]`; the longest first), then one holding a `,` (ends a number or a value), then the
longest other token (where only a key, an enum value or a closing tag may follow, it
spells the most of it), tokens that open an object or array, and blanks last; stop when the
grammar accepts (then EOS is allowed). The first step is chosen with one token of
look-ahead (`first_step`), and the way is planned again at every step. Greedy is not the
shortest way in general, but it only narrows rows already at their limit, and every token it picks is one the
grammar allows, so it never makes an output invalid. The search runs only for rows within `LOOKAHEAD` tokens of their
limit, on the mask's thread.

vLLM, SGLang and TensorRT-LLM cut constrained outputs at `max_tokens` wherever they are
(`finish_reason: "length"`, not parseable).
"""

from __future__ import annotations

from typing import Any

import numpy as np

LOOKAHEAD = 48  # tokens: rows further from their limit are not searched
_CLOSERS = frozenset('"}]')


class ClosingTable:
    """The preference of every token id when closing (lower first), from its text.

    Args:
        texts: each token id's text (None: a special or unknown token, never picked).
        eos_token_ids: ends of generation (picked only when the grammar accepts).
    """

    def __init__(self, texts: list[str | None], eos_token_ids: frozenset[int]) -> None:
        rank = np.full(len(texts), 1 << 30, dtype=np.int64)
        self.length = np.array([len(t) if t else 0 for t in texts], dtype=np.int64)
        for i, t in enumerate(texts):
            if not t or i in eos_token_ids:
                continue
            if set(t) <= _CLOSERS:
                rank[i] = -len(t)  # closes the most at once
            elif not t.strip():
                rank[i] = 4000 + len(t)  # blanks make no progress (where a grammar allows them anywhere)
            elif "{" in t or "[" in t:
                rank[i] = 3000 + len(t)
            elif "," in t:
                rank[i] = 1000 + len(t)
            else:
                rank[i] = 2000 + max(0, 100 - len(t))  # the longest: spells a key, a value or a tag fastest
        self.rank = rank
        self.eos_token_ids = eos_token_ids

    @classmethod
    def of_tokenizer(cls, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> ClosingTable:
        """From a transformers tokenizer (each id decoded once; special tokens left out)."""
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        n = min(vocab_size, len(tokenizer))
        texts: list[str | None] = [None if i in special else tokenizer.decode([i]) for i in range(n)]
        return cls(texts + [None] * (vocab_size - n), eos_token_ids)


def _allowed(m: Any, bitmask: np.ndarray, vocab: int) -> np.ndarray:
    import llguidance.numpy as lln

    lln.fill_next_token_bitmask(m, bitmask, 0)
    return np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab].astype(bool)


def closing_path(matcher: Any, table: ClosingTable, limit: int) -> list[int] | None:
    """Greedy tokens from `matcher`'s state (an llguidance `LLMatcher`, left unchanged) to
    a state its grammar accepts: [] when it accepts already, None when `limit` tokens do
    not get there. A token after which the grammar allows exactly what it allowed before
    made no progress (a `}` inside a string, one more digit): it is taken back and the
    next best is tried at that position."""
    if matcher.is_accepting():
        return []
    m = matcher.deep_copy()
    vocab = len(table.rank)
    bitmask = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)
    path: list[int] = []
    masks = [_allowed(m, bitmask, vocab)]  # masks[k]: what the state before path[k] allows
    banned: list[set[int]] = [set()]
    for _ in range(3 * limit):
        allowed = masks[-1].copy()
        if banned[-1]:
            allowed[list(banned[-1])] = False
        ids = np.flatnonzero(allowed)
        if ids.size == 0:
            return None
        token = int(ids[np.argmin(table.rank[ids])])
        if token in table.eos_token_ids or not m.consume_token(token):
            return None
        if m.is_accepting():
            return path + [token]
        after = _allowed(m, bitmask, vocab)
        if np.array_equal(after, masks[-1]):  # no progress: take it back, try the next
            m.rollback(1)
            banned[-1].add(token)
            continue
        path.append(token)
        if len(path) >= limit:
            return None
        masks.append(after)
        banned.append(set())
    return None


def first_step(matcher: Any, table: ClosingTable, limit: int, candidates: int = 8) -> tuple[int, int] | None:
    """(token, tokens to an end through it) of the best first step: the greedy way's first
    token against the `candidates` best-ranked allowed tokens, each followed by the greedy
    way from there (greedy alone cannot tell a `]` that closes an array from one inside a
    string: this one-token look-ahead can); None when no way within `limit` is found."""
    base = closing_path(matcher, table, limit)
    if base == []:
        return None  # accepting: nothing to close
    best = (len(base), base[0]) if base else None
    vocab = len(table.rank)
    ids = np.flatnonzero(_allowed(matcher, np.zeros((1, (vocab + 31) // 32), dtype=np.int32), vocab))
    ids = ids[np.argsort(table.rank[ids], kind="stable")][:candidates]
    for token in ids.tolist():
        if token in table.eos_token_ids or (best is not None and token == best[1]):
            continue
        m = matcher.deep_copy()
        if not m.consume_token(token):
            continue
        rest = closing_path(m, table, best[0] if best else limit - 1)
        if rest is None:
            continue
        # fewer tokens to the end, then less text: of two tokens that both end it (`>` and
        # `>,` after a closing tag), the one that adds nothing the answer did not need
        if best is None or (1 + len(rest), table.length[token]) < (best[0], table.length[best[1]]):
            best = (1 + len(rest), token)
    return None if best is None else (best[1], best[0])


def narrow(matcher: Any, table: ClosingTable, remaining: int, bitmask: np.ndarray, row: int,
           plan: list[int] | None = None) -> bool:
    """Narrow `bitmask[row]` (the grammar's allowed tokens, already filled) to the first
    token of the way to an end when that way needs every token left (`remaining`: output
    tokens the request may still generate, this one included; its EOS counts as one) or
    more. Returns True when it narrowed.

    `plan`: a one-item list holding the `remaining` at which to look again (kept on the
    request's `Matcher`): a look finding room to spare waits until the remaining tokens
    come within 3 of the way it found, or 8 fewer, whichever comes first, so a request is
    searched every step only while it is being closed (an accepting state costs one
    check per step: a call may open at any token)."""
    if remaining > LOOKAHEAD or (plan is not None and remaining > plan[0]):
        return False
    if matcher.is_accepting():
        return False  # EOS is allowed now (looked at again next step: a call may open)
    base = closing_path(matcher, table, remaining + 8)
    if base is None or len(base) + 1 < remaining:  # no way found, or room to spare
        if plan is not None:
            plan[0] = max(len(base) + 3, remaining - 8) if base else remaining - 4
        return False
    step = first_step(matcher, table, remaining + 8)
    if step is None:
        return False
    token = step[0]
    bitmask[row, :] = 0
    bitmask[row, token // 32] = np.int32(np.uint32(1 << (token % 32)).view(np.int32))
    return True
