from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from worker.serve.offsets import OffsetTracker


def test_commit_point_never_passes_an_unfinished_offset():
    t = OffsetTracker()
    for o in range(40, 45):
        t.read("p0", o)
    assert t.commit_point("p0") == 40  # nothing done: the first offset itself
    t.mark_committed("p0", 40)
    assert t.commit_point("p0") is None
    t.done("p0", 41)
    t.done("p0", 43)
    assert t.commit_point("p0") is None  # 40 still running
    t.done("p0", 40)
    assert t.commit_point("p0") == 42
    t.mark_committed("p0", 42)
    t.done("p0", 42)
    t.done("p0", 44)
    assert t.commit_point("p0") == 45


def test_refetched_offsets_are_refused_and_drop_forgets():
    t = OffsetTracker()
    assert t.read("p", 5) and t.read("p", 6)
    t.done("p", 5)
    assert not t.read("p", 5)  # re-read after a rebalance: already finished
    assert not t.read("p", 6)  # re-read: still running here
    assert t.commit_point("p") == 6
    t.drop("p")
    t.done("p", 6)  # no-op after the partition is lost
    assert t.commit_point("p") is None
    assert t.read("p", 5)  # regained later: a fresh start


@given(st.lists(st.integers(1, 5), min_size=1, max_size=50), st.randoms())
def test_random_completion_order(gaps, rnd: random.Random):
    t = OffsetTracker()
    offsets = []
    o = 0
    for g in gaps:
        o += g
        offsets.append(o)
        t.read("p", o)
    order = offsets[:]
    rnd.shuffle(order)
    finished = set()
    committed = None
    for x in order:
        t.done("p", x)
        finished.add(x)
        point = t.commit_point("p")
        unfinished = [y for y in offsets if y not in finished]
        expected = unfinished[0] if unfinished else offsets[-1] + 1
        if point is None:
            assert expected == committed  # nothing new to commit
        else:
            assert point == expected
            t.mark_committed("p", point)
            committed = point
