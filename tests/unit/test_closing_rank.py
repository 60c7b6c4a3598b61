"""Closing's ranked scan of a packed mask (`worker.engine.closing._ranked`) against the
plain reading of every bit (unpack the mask, keep the allowed tokens in rank order): same
tokens in the same order for random masks, vocabularies that are not whole words, banned
tokens and limits, including masks that allow nothing or only the worst-ranked tokens."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.engine import closing
from worker.engine.closing import ClosingTable, _best, _ranked


def plain(packed: np.ndarray, table: ClosingTable, banned: set[int]) -> np.ndarray:
    bits = np.unpackbits(packed.view(np.uint8), bitorder="little")
    if banned:
        bits[list(banned)] = 0
    return table.order[bits[table.order].astype(bool)]


def table_of(vocab: int, seed: int) -> ClosingTable:
    rng = np.random.default_rng(seed)
    pieces = ['"', "}", "]", '"}', ",", " ", "{", "[", "a", "bc", "def", "ghij", None]
    texts = [pieces[int(rng.integers(len(pieces)))] for _ in range(vocab)]
    return ClosingTable(texts, frozenset({0}))


@pytest.mark.parametrize("scan_from", [0, closing.SCAN_FROM])  # 0: every vocabulary scanned in stretches
@settings(max_examples=150, deadline=None)
@given(st.integers(1, 3000), st.integers(0, 2**31), st.floats(0.0, 1.0), st.sets(st.integers(0, 2999), max_size=20),
       st.one_of(st.none(), st.integers(1, 10)))
def test_the_scan_equals_reading_every_bit(scan_from, vocab, seed, density, banned, limit):
    saved, closing.SCAN_FROM = closing.SCAN_FROM, scan_from
    try:
        check(vocab, seed, density, banned, limit)
    finally:
        closing.SCAN_FROM = saved


def check(vocab: int, seed: int, density: float, banned: set[int], limit: int | None) -> None:
    table = table_of(vocab, seed)
    words = (vocab + 31) // 32
    rng = np.random.default_rng(seed + 1)
    allowed = rng.random(words * 32) < density
    allowed[vocab:] = False
    packed = np.packbits(allowed, bitorder="little").view(np.int32).reshape(1, words)
    banned = {b for b in banned if b < vocab}
    want = plain(packed, table, banned)
    got = _ranked(packed, table, banned, limit)
    assert got.tolist() == (want if limit is None else want[:limit]).tolist()
    best = _best(packed, table, banned)
    assert best == (int(want[0]) if want.size else None)


def test_only_the_worst_ranked_token_allowed_is_found_past_the_first_stretches():
    table = table_of(130_000, 7)
    worst = int(table.order[-1])
    allowed = np.zeros(((130_000 + 31) // 32) * 32, dtype=bool)
    allowed[worst] = True
    packed = np.packbits(allowed, bitorder="little").view(np.int32).reshape(1, -1)
    assert _best(packed, table, set()) == worst
    assert _ranked(packed, table, {worst}).size == 0
