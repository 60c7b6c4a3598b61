"""The runner's persistent block table (worker/model/input_batch.py): what a step gathers
equals the scheduler's tables padded with 0, whatever happened to them since the last
step (appended, replaced after a preemption, copied, windowed, gone and back)."""

import random

import numpy as np

from worker.model.input_batch import BlockTableBuffer, step_positions


def _padded(tables: list[list[int]]) -> np.ndarray:
    width = max(len(t) for t in tables)
    return np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int64)


def _gather(buf: BlockTableBuffer, ids: list[str], tables: list[list[int]]) -> np.ndarray:
    rows = buf.rows(ids, tables)
    assert len(set(rows.tolist())) == len(ids)  # one row per request
    assert buf.num_blocks(rows).tolist() == [len(t) for t in tables]
    return buf.gather(rows, int(buf.num_blocks(rows).max()))


def test_appends_are_written_and_a_replaced_table_is_rewritten_whole():
    buf = BlockTableBuffer(num_rows=4, width=2)
    a, b = [1, 2], [7]
    assert _gather(buf, ["a", "b"], [a, b]).tolist() == [[1, 2], [7, 0]]
    a.append(3)  # a decode crossed into a new block (and past the buffer's width)
    assert _gather(buf, ["a", "b"], [a, b]).tolist() == [[1, 2, 3], [7, 0, 0]]
    a = [9]  # preempted and admitted again: a new, shorter list; the old tail must not show
    assert _gather(buf, ["b", "a"], [b, a]).tolist() == [[7], [9]]
    assert _gather(buf, ["a", "b"], [a, [7, 8]]).tolist() == [[9, 0], [7, 8]]


def test_a_copied_table_with_entries_changed_in_place_is_read_as_it_is_now():
    buf = BlockTableBuffer()
    t = [4, 5, 6]
    _gather(buf, ["w"], [t])
    t[0] = -1  # a sliding window freed the first block (the runner clamps -1 to block 0)
    assert _gather(buf, ["w"], [t[:]]).tolist() == [[-1, 5, 6]]  # asynchronous steps hand out copies


def test_rows_of_requests_gone_are_reused_and_the_buffer_grows_with_the_step():
    buf = BlockTableBuffer(num_rows=2, width=1)
    for step in range(5):  # each step new requests: rows of earlier ones are reclaimed
        ids = [f"s{step}-{i}" for i in range(3)]
        tables = [[step * 10 + i] for i in range(3)]
        assert _gather(buf, ids, tables).tolist() == _padded(tables).tolist()
    assert buf.num_rows >= 6  # grown to twice the step's requests


def test_random_steps_match_the_padded_tables():
    rng = random.Random(7)
    buf = BlockTableBuffer(num_rows=2, width=2)
    live: dict[str, list[int]] = {}
    next_id = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.15 or not live:  # a new request
            live[f"r{next_id}"] = [rng.randrange(1000) for _ in range(rng.randrange(1, 4))]
            next_id += 1
        elif op < 0.25:  # one finishes
            del live[rng.choice(list(live))]
        elif op < 0.3:  # one is preempted and comes back with a new table
            rid = rng.choice(list(live))
            live[rid] = [rng.randrange(1000) for _ in range(rng.randrange(1, 3))]
        if not live:
            continue
        for t in live.values():  # decodes crossing into new blocks
            if rng.random() < 0.3:
                t.append(rng.randrange(1000))
        ids = [rid for rid in live if rng.random() < 0.8] or list(live)  # some sit the step out
        tables = [live[rid] if rng.random() < 0.7 else live[rid][:] for rid in ids]
        assert _gather(buf, ids, tables).tolist() == _padded(tables).tolist()


def test_step_positions():
    positions, owner = step_positions(np.array([5, 0, 9]), np.array([1, 3, 2]))
    assert positions.tolist() == [5, 0, 1, 2, 9, 10]
    assert owner.tolist() == [0, 1, 1, 1, 2, 2]
    positions, owner = step_positions(np.array([], dtype=np.int64), np.array([], dtype=np.int64))
    assert positions.tolist() == [] and owner.tolist() == []
