"""The step's inputs built from arrays, not per token: a persistent block table updated by
diffs, and positions, slot mapping and sample rows computed with numpy from each request's
(start, length).

Packing a step per token from Python lists costs host time that grows with the batch and
its context (a padded list of lists for the tables, a generator per token for the slots),
and a fast device waits on it. vLLM V1's `InputBatch` keeps the block tables of the
running requests in preallocated arrays updated by what changed since the last step;
`BlockTableBuffer` is that idea for our runner's contract (it still receives each step's
`ScheduledRequest`s, so nothing else changes): a request keeps its row while it runs, and
a step writes into it only the block ids appended since (a row is rewritten whole when
its table is a different list: after a preemption, or when the scheduler hands out
copies).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockTableBuffer:
    """Block tables of the requests the runner has seen, one row each, int64
    `[num_rows, width]`, padded with 0.

    Rows grow with the number of requests in one step and the width with the longest
    table; a row is reused for another request once its request was missing from a step
    (rows are read only for the step being built, so nothing else can hold one). The
    runner's forward thread is the only user.

    Args:
        num_rows: rows to start with (doubled when a step needs more).
        width: block ids per row to start with (doubled when a table is longer).
    """

    def __init__(self, num_rows: int = 64, width: int = 64) -> None:
        self.table = np.zeros((num_rows, width), dtype=np.int64)
        self._row_of: dict[str, int] = {}  # request id -> row
        self._source: list[list[int] | None] = [None] * num_rows  # the list each row was written from
        self._written = np.zeros(num_rows, dtype=np.int64)  # entries of `_source` written so far
        self._free: list[int] = list(range(num_rows - 1, -1, -1))

    @property
    def num_rows(self) -> int:
        return self.table.shape[0]

    def rows(self, request_ids: Sequence[str], tables: Sequence[list[int]]) -> np.ndarray:
        """The rows of one step's requests (int64 `[len(request_ids)]`, in their order),
        each holding its request's `tables` entry: written where it changed since the
        last step (the ids appended to the same list; the whole row for a new list).

        A table is the scheduler's list for the request (or a copy of it): appended to
        while the request runs, replaced when it is preempted and admitted again, and
        read here as it is at this call."""
        row_of = self._row_of
        source = self._source
        written = self._written
        out = np.empty(len(request_ids), dtype=np.int64)
        for i, (rid, blocks) in enumerate(zip(request_ids, tables)):
            row = row_of.get(rid)
            if row is None:
                row = self._new_row(rid, request_ids)
                source, written = self._source, self._written
            n = len(blocks)
            if n > self.table.shape[1]:
                self._widen(n)
            if source[row] is blocks:
                done = written[row]
                if n > done:  # the usual change: a decode crossed into a new block
                    self.table[row, done:n] = blocks[done:n]
                    written[row] = n
            else:  # a new request, a new table after a preemption, or a copy
                old = written[row]
                self.table[row, :n] = blocks
                if old > n:
                    self.table[row, n:old] = 0
                source[row] = blocks
                written[row] = n
            out[i] = row
        return out

    def gather(self, rows: np.ndarray, width: int) -> np.ndarray:
        """A copy of `rows`' first `width` entries, int64 `[len(rows), width]` (the step's
        own array: the buffer may change before the device has read it)."""
        return self.table[rows, :width]

    def num_blocks(self, rows: np.ndarray) -> np.ndarray:
        """Block-table lengths of `rows` (int64)."""
        return self._written[rows]

    def _new_row(self, request_id: str, step_ids: Sequence[str]) -> int:
        if not self._free:
            self._reclaim(step_ids)
        row = self._free.pop()
        self._row_of[request_id] = row
        self._source[row] = None  # written whole next, its old tail (`_written` of the last owner) zeroed
        return row

    def _reclaim(self, step_ids: Sequence[str]) -> None:
        """Free the rows of requests not in this step (they finished, were preempted or
        sat the step out: a row only caches its request's table), then grow to twice the
        step's requests if there are fewer rows (so this stays rare)."""
        in_step = set(step_ids)
        for rid, row in list(self._row_of.items()):
            if rid not in in_step:
                del self._row_of[rid]
                self._source[row] = None
                self._free.append(row)
        if 2 * len(in_step) > self.num_rows:
            self._grow(max(2 * self.num_rows, 2 * len(in_step)))

    def _grow(self, num_rows: int) -> None:
        old = self.num_rows
        self.table = np.concatenate([self.table, np.zeros((num_rows - old, self.table.shape[1]), np.int64)])
        self._source.extend([None] * (num_rows - old))
        self._written = np.concatenate([self._written, np.zeros(num_rows - old, np.int64)])
        self._free = list(range(num_rows - 1, old - 1, -1)) + self._free

    def _widen(self, width: int) -> None:
        new = max(2 * self.table.shape[1], width)
        self.table = np.concatenate([self.table, np.zeros((self.num_rows, new - self.table.shape[1]), np.int64)], axis=1)


def step_positions(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-token positions and owning request index of a packed step whose request i has
    `lengths[i]` tokens at positions `starts[i] ...` (int64 arrays `[num_reqs]`).

    Returns:
        (positions `[num_tokens]`, request index `[num_tokens]`), both int64.
    """
    owner = np.repeat(np.arange(len(lengths)), lengths)
    first = np.cumsum(lengths) - lengths  # each request's first flat index
    positions = np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(starts - first, lengths)
    return positions, owner
