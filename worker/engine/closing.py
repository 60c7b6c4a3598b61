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
REACH = 8  # tokens: a search walks up to this many past the tokens left (greedy's slack over the shortest way)
RETIRED = -1  # a plan's `look_at` once its way was found longer than it can ever go
SCAN_FROM = 8192  # tokens: vocabularies larger than this are scanned in rank order (`_ranked`)
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
        self.order = np.argsort(rank, kind="stable")  # token ids best first (ties: the lower id)
        self.order_word = self.order >> 5  # each of them as its mask's word and bit
        self.order_bit = (self.order & 31).astype(np.uint32)
        self.eos_token_ids = eos_token_ids

    @classmethod
    def of_tokenizer(cls, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> ClosingTable:
        """From a transformers tokenizer (each id decoded once; special tokens left out)."""
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        n = min(vocab_size, len(tokenizer))
        texts: list[str | None] = [None if i in special else tokenizer.decode([i]) for i in range(n)]
        return cls(texts + [None] * (vocab_size - n), eos_token_ids)


def _packed(m: Any, words: int) -> np.ndarray:
    """What `m` allows next as its int32 bitmask `[1, words]` (bit j of word w: token 32w + j),
    filled by llguidance straight into the new array (its numpy wrapper's checks and
    slicing cost a third of a fill here, and a walk fills once per token)."""
    out = np.empty((1, words), dtype=np.int32)
    m.unsafe_compute_mask_ptr(out.__array_interface__["data"][0], words * 4)
    return out


def _ranked(packed: np.ndarray, table: ClosingTable, banned: set[int] | None = None,
            limit: int | None = None) -> np.ndarray:
    """The tokens `packed` allows, none of `banned`, best rank first (ties: the lower id);
    the first `limit` of them (None: all).

    A vocabulary of up to `SCAN_FROM` tokens is read whole (every bit unpacked: a few
    numpy calls). A larger one with a `limit` is read in rank order a stretch at a time
    (1024 tokens, then 8x more each time), each token's bit taken from its word of the
    mask, until `limit` are found: the best allowed token is most often among the first
    (a closing quote or bracket), so a walk step reads a thousand bits, not 128k (measured
    at 128k tokens: 7 against 110-280 us; at 2048, the whole read is the faster by 2 us)."""
    n = len(table.order)
    if limit is None or n <= SCAN_FROM:
        bits = np.unpackbits(packed.view(np.uint8), bitorder="little")
        if banned:
            bits[list(banned)] = 0
        out = table.order[bits[table.order].astype(bool)]
        return out if limit is None else out[:limit]
    words = packed.reshape(-1).view(np.uint32)
    found: list[np.ndarray] = []
    count, start, size = 0, 0, 1024
    while start < n and count < limit:
        stop = min(n, start + size)
        allowed = (words[table.order_word[start:stop]] >> table.order_bit[start:stop]) & 1
        ids = table.order[start:stop][allowed.astype(bool)]
        if banned and ids.size:
            ids = ids[~np.isin(ids, list(banned))]
        found.append(ids)
        count += ids.size
        start, size = stop, size * 8
    return np.concatenate(found)[:limit]


def _best(packed: np.ndarray, table: ClosingTable, banned: set[int]) -> int | None:
    """The allowed token of best rank (ties: the lower id), none of `banned`; None if none."""
    ranked = _ranked(packed, table, banned, limit=1)
    return int(ranked[0]) if ranked.size else None


def closing_path(matcher: Any, table: ClosingTable, limit: int) -> list[int] | None:
    """Greedy tokens from `matcher`'s state (an llguidance `LLMatcher`, left unchanged) to
    a state its grammar accepts: [] when it accepts already, None when `limit` tokens do
    not get there. A token after which the grammar allows exactly what it allowed before
    made no progress (a `}` inside a string, one more digit): it is taken back and the
    next best is tried at that position. The masks stay packed (a fill, a compare of
    vocab/32 words and one unpack per token: this runs for every row near its limit)."""
    return _greedy(matcher, table, limit)[0]


def _greedy(matcher: Any, table: ClosingTable, limit: int,
            allowed: np.ndarray | None = None) -> tuple[list[int] | None, bool]:
    """`closing_path`, and whether a None is because the way is longer than `limit` (not
    because the search got stuck: nothing allowed but EOS, or too many tokens that made
    no progress, as in the middle of a character's UTF-8 bytes). `allowed`: what
    `matcher` allows now, packed `[1, words]`, where the caller has it (one fill fewer)."""
    if matcher.is_accepting():
        return [], False
    m = matcher.deep_copy()
    words = (len(table.rank) + 31) // 32
    path: list[int] = []
    masks = [_packed(m, words) if allowed is None else allowed]  # masks[k]: what the state before path[k] allows
    banned: list[set[int]] = [set()]
    for _ in range(3 * limit):
        token = _best(masks[-1], table, banned[-1])
        if token is None or token in table.eos_token_ids or not m.consume_token(token):
            return None, False
        if m.is_accepting():
            return path + [token], False
        after = _packed(m, words)
        if np.array_equal(after, masks[-1]):  # no progress: take it back, try the next
            m.rollback(1)
            banned[-1].add(token)
            continue
        path.append(token)
        if len(path) >= limit:
            return None, True
        masks.append(after)
        banned.append(set())
    return None, False


def best_way(matcher: Any, table: ClosingTable, limit: int, candidates: int = 8,
             base: list[int] | None = None, allowed: np.ndarray | None = None) -> list[int] | None:
    """The way to an end through the best first step: the greedy way (`base`, searched
    when not given) against the `candidates` best-ranked allowed tokens, each followed by
    the greedy way from there (greedy alone cannot tell a `]` that closes an array from
    one inside a string: this one-token look-ahead can); None when no way within `limit`
    is found or the grammar accepts already. `allowed`: as `_greedy`'s."""
    if base is None:
        base = closing_path(matcher, table, limit)
    if base == []:
        return None  # accepting: nothing to close
    best = base
    if allowed is None:
        allowed = _packed(matcher, (len(table.rank) + 31) // 32)
    ids = _ranked(allowed, table, limit=candidates)
    for token in ids.tolist():
        if token in table.eos_token_ids or (best is not None and token == best[0]):
            continue
        m = matcher.deep_copy()
        if not m.consume_token(token):
            continue
        rest = closing_path(m, table, len(best) if best else limit - 1)
        if rest is None:
            continue
        # fewer tokens to the end, then less text: of two tokens that both end it (`>` and
        # `>,` after a closing tag), the one that adds nothing the answer did not need
        if best is None or (1 + len(rest), table.length[token]) < (len(best), table.length[best[0]]):
            best = [token, *rest]
    return best


def first_step(matcher: Any, table: ClosingTable, limit: int, candidates: int = 8) -> tuple[int, int] | None:
    """(token, tokens to an end through it) of `best_way`; None where it is None."""
    way = best_way(matcher, table, limit, candidates)
    return None if way is None else (way[0], len(way))


class ClosingPlan:
    """What closing knows of one request between steps (kept on its `Matcher`).

    Attributes:
        look_at: the `remaining` at which to look for a way again (`RETIRED`: not until
            the grammar reaches an end by itself).
        way: the rest of the way a narrowed step chose (its next token first), valid
            while the request follows it: at `way_at` remaining tokens.
        way_at: the `remaining` at which `way[0]` is due.
    """

    __slots__ = ("look_at", "way", "way_at")

    def __init__(self) -> None:
        self.look_at = LOOKAHEAD
        self.way: list[int] = []
        self.way_at = -1


def _allows(bitmask: np.ndarray, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def narrow(matcher: Any, table: ClosingTable, remaining: int, bitmask: np.ndarray, row: int,
           plan: ClosingPlan | None = None) -> bool:
    """Narrow `bitmask[row]` (the grammar's allowed tokens, already filled) to the first
    token of the way to an end when that way needs every token left (`remaining`: output
    tokens the request may still generate, this one included; its EOS counts as one) or
    more. Returns True when it narrowed.

    `plan`: the request's `ClosingPlan`. A look finding room to spare waits until the
    remaining tokens come within 3 of the way it found, or 8 fewer, whichever comes
    first (one that got stuck, 4 tokens). A look whose greedy walk passes its reach
    (`remaining + REACH` tokens) without an end retires the row: the shortest way to an
    end shrinks by at most one token per token written, so unless greedy overestimated it
    by more than `REACH` tokens, the way can never fit the tokens left, and every later
    look would walk its whole reach for nothing (most of closing's cost where outputs run
    long, docs/benchmarks.md). A waiting or retired row whose grammar reaches an end by
    itself starts over (a later tool call is a new way). So a request is searched only now
    and then while near its limit. Once narrowed onto a way that ends in time it follows
    it (a row narrowed to one token can only take it) without searching again, as long as
    its grammar allows the way's next token; a way within reach but too long for the
    tokens left is planned again at every step, where the one-token look-ahead may find a
    shorter one. An accepting state costs one check per step (a call may open at any
    token)."""
    if remaining > LOOKAHEAD:
        return False
    if plan is not None and remaining > plan.look_at:
        if matcher.is_accepting():
            plan.look_at = LOOKAHEAD
        return False
    if matcher.is_accepting():
        return False  # EOS is allowed now (looked at again next step: a call may open)
    if (plan is not None and plan.way and plan.way_at == remaining and len(plan.way) <= remaining
            and _allows(bitmask, row, plan.way[0])):
        token = plan.way.pop(0)  # the way chosen earlier still ends in time: its next token
    else:
        allowed = bitmask[row:row + 1].copy()  # the grammar's mask, before any narrowing
        base, too_long = _greedy(matcher, table, remaining + REACH, allowed)
        if base is None or len(base) + 1 < remaining:  # no way found, or room to spare
            if plan is not None:
                if base is not None:
                    plan.look_at = max(len(base) + 3, remaining - 8)
                elif too_long:  # cannot end in time from here, nor later (the docstring)
                    plan.look_at = RETIRED
                else:  # stuck where it is (inside a character's bytes): soon again
                    plan.look_at = remaining - 4
            return False
        way = best_way(matcher, table, remaining + REACH, base=base, allowed=allowed)
        if way is None:
            return False
        token = way[0]
        if plan is not None:
            plan.way = way[1:]
    if plan is not None:
        plan.way_at = remaining - 1
    bitmask[row, :] = 0
    bitmask[row, token // 32] = np.int32(np.uint32(1 << (token % 32)).view(np.int32))
    return True
