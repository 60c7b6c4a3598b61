"""A job's replay log (`inflight:job:<id>:log`, a Redis stream) and its compacted form.

While a job runs, each event is one log entry with fields `e` (the event JSON), `q` (its
`seq`) and `a` (its attempt): one entry per publish round, so about one per output token
when the publisher keeps up. When the job ends the worker rewrites its log in one step
(`redis.compact_logs`, on by default): every run of consecutive `token` events of one
attempt becomes **one** entry, a `token` event whose `seq` is the run's last, whose text
is the run's texts concatenated and whose `token_ids` (and `logprobs`) are theirs
concatenated, with a fourth field `s` listing the size of each event it replaced, in
order: the UTF-8 byte length of its text, followed by `:` and its number of token ids
when that is not 1 (`"3,5,0:2,4"`: four events, the third with no text and two token
ids). Other entries stay as they were. The first entry
keeps the log's first stream id (when the job's first event was written); the others get
the time of the rewrite (reading each entry's old id back would cost the rewrite a scan of
the whole log).

So a compacted run is exactly the events it replaced: `expand` gives them back, seq for
seq (seqs `q - n + 1 .. q` for n sizes), and `InflightClient.read_log` returns a
compacted log's events exactly as it returned the uncompacted one. A reader that reads
the log from its start and ignores `s` still gets the whole text in order (the run is a
coalesced delta, as a publisher that fell behind would have sent); only a reader that
resumes inside a run (it holds seqs up to k with `q - n < k < q`) needs the sizes, to
skip what it already has.

Why: a token event's JSON is ~140 bytes for ~4 bytes of text, kept for `redis.log_ttl_s`
(measured bytes per 1k tokens before and after: docs/benchmarks.md, "Redis memory").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

from schemas.codec import decode_event, encode
from schemas.wire import Event, Token, TokenLogprob


class LogEntry(NamedTuple):
    """One entry of a job's log: `seq`, `attempt`, `data` (the event JSON, field `e`) and
    `splits` (field `s`: "" for an entry that is one event)."""

    seq: int
    attempt: int
    data: bytes
    splits: str = ""


def entry_of(fields: Mapping[bytes, bytes]) -> LogEntry:
    """A log entry from the fields XRANGE returned for it (bytes keys and values).

    Raises:
        KeyError: no `e` field (not an entry Inflight wrote).
    """
    splits = fields.get(b"s", b"")
    return LogEntry(int(fields.get(b"q", b"-1")), int(fields.get(b"a", b"0")), fields[b"e"],
                    splits.decode() if isinstance(splits, bytes) else str(splits))


def parse_splits(splits: str) -> list[tuple[int, int]]:
    """(text bytes, token ids) of each event of a run, in order.

    Raises:
        ValueError: not a list of sizes as `Compactor` writes them.
    """
    out = []
    for part in splits.split(","):
        size, _, n = part.partition(":")
        out.append((int(size), int(n) if n else 1))
        if out[-1][0] < 0 or out[-1][1] < 0:
            raise ValueError(f"negative size in log splits {splits!r}")
    return out


def expand(entry: LogEntry) -> list[Event]:
    """The events a log entry stands for: itself, or each event of a compacted run.

    Raises:
        msgspec.DecodeError / ValidationError: `data` is not an event.
        ValueError: `splits` does not match the run's text, token ids or logprobs.
    """
    ev = decode_event(entry.data)
    if not entry.splits:
        return [ev]
    if not isinstance(ev, Token):
        raise ValueError(f"log entry seq {entry.seq} has splits but holds a {type(ev).__name__} event")
    sizes = parse_splits(entry.splits)
    text = ev.text.encode()
    if sum(b for b, _ in sizes) != len(text) or sum(n for _, n in sizes) != len(ev.token_ids) or (
            ev.logprobs is not None and len(ev.logprobs) != len(ev.token_ids)):
        raise ValueError(f"log entry seq {ev.seq}: splits {entry.splits!r} do not match its text and tokens")
    out: list[Event] = []
    seq, pos, tok = ev.seq - len(sizes) + 1, 0, 0
    for size, n in sizes:
        out.append(Token(job_id=ev.job_id, seq=seq, attempt=ev.attempt, text=text[pos:pos + size].decode(),
                         token_ids=ev.token_ids[tok:tok + n],
                         logprobs=ev.logprobs[tok:tok + n] if ev.logprobs is not None else None))
        seq, pos, tok = seq + 1, pos + size, tok + n
    return out


def compact(entries: Iterable[LogEntry]) -> list[LogEntry]:
    """The compacted form of a log's entries (in seq order): every run of two or more
    consecutive `token` events of one attempt (seqs without a gap, logprobs on all or
    none) merged into one entry with its splits; every other entry unchanged.

    Raises:
        msgspec.DecodeError / ValidationError, ValueError: as `expand`.
    """
    c = Compactor()
    for entry in entries:
        c.add(entry)
    return c.finish()


class Compactor:
    """`compact`, fed one entry at a time, so a writer that still holds each event (the
    worker's job table, as it numbers them) pays no decoding: `add(entry, event)`; then
    `finish()` once. Holds the open run as parts (texts, ids, sizes), not as events."""

    def __init__(self) -> None:
        self._out: list[LogEntry] = []
        self._first: LogEntry | None = None  # the open run's first entry (kept as is if alone)
        self._texts: list[str] = []
        self._ids: list[int] = []
        self._logprobs: list[TokenLogprob] | None = None
        self._sizes: list[int] = []  # UTF-8 bytes of each event's text
        self._counts: list[int] = []  # token ids of each event
        self._job_id = ""
        self._attempt = self._seq = -1

    def add(self, entry: LogEntry, event: Event | None = None) -> None:
        """The next entry of the log (`event`: its event, when the caller has it decoded).

        Raises:
            msgspec.DecodeError / ValidationError, ValueError: as `expand` (without `event`).
        """
        events = [event] if event is not None and not entry.splits else expand(entry)
        for ev in events:
            whole = entry if not entry.splits else LogEntry(ev.seq, ev.attempt, encode(ev))
            if not isinstance(ev, Token) or (ev.logprobs is not None and len(ev.logprobs) != len(ev.token_ids)):
                self._close()  # not a token event, or one whose logprobs a run could not split back
                self._out.append(whole)
                continue
            if self._first is not None and not (ev.attempt == self._attempt and ev.seq == self._seq + 1
                                                and (ev.logprobs is None) == (self._logprobs is None)):
                self._close()
            if self._first is None:
                self._first, self._job_id, self._attempt = whole, ev.job_id, ev.attempt
                self._logprobs = [] if ev.logprobs is not None else None
            self._seq = ev.seq
            self._texts.append(ev.text)
            self._ids += ev.token_ids
            if ev.logprobs is not None:
                self._logprobs += ev.logprobs
            self._sizes.append(len(ev.text.encode()))
            self._counts.append(len(ev.token_ids))

    def finish(self) -> list[LogEntry]:
        """The compacted entries of everything added."""
        self._close()
        return self._out

    def _close(self) -> None:
        if self._first is None:
            return
        if len(self._sizes) == 1:
            self._out.append(self._first)
        else:
            merged = Token(job_id=self._job_id, seq=self._seq, attempt=self._attempt, text="".join(self._texts),
                           token_ids=self._ids, logprobs=self._logprobs)
            splits = ",".join(str(b) if n == 1 else f"{b}:{n}" for b, n in zip(self._sizes, self._counts))
            self._out.append(LogEntry(self._seq, self._attempt, encode(merged), splits))
        self._first, self._texts, self._ids, self._logprobs, self._sizes, self._counts = None, [], [], None, [], []
