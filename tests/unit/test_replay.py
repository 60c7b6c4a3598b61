"""A job's log compacted (`schemas.replay`): the same events back, seq for seq, for any
mix of attempts, multi-token and empty deltas, logprobs and non-ASCII text; a reader that
ignores the sizes still reads the whole text; a corrupt entry is an error, not a wrong
replay."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.codec import decode_event, encode
from schemas.replay import LogEntry, compact, entry_of, expand, parse_splits
from schemas.wire import Event, Finished, FinishReason, Restarted, Started, Token, TokenLogprob

J = "job-ü"

texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=6)


@st.composite
def logs(draw) -> list[Event]:
    """A job's events as a worker publishes them: per attempt `restarted` (after the
    first) and `started`, token events, the terminal event last."""
    events: list[Event] = []
    seq = 0
    with_logprobs = draw(st.booleans())
    attempts = draw(st.integers(1, 3))
    for attempt in range(1, attempts + 1):
        if attempt > 1:
            events.append(Restarted(job_id=J, seq=seq, attempt=attempt, reason="r"))
            seq += 1
        events.append(Started(job_id=J, seq=seq, attempt=attempt, worker_id="w"))
        seq += 1
        for _ in range(draw(st.integers(0, 12))):
            ids = draw(st.lists(st.integers(0, 200_000), max_size=3))
            lps = [TokenLogprob(token_id=i, logprob=-draw(st.floats(0, 30)), top_token_ids=[i],
                                top_logprobs=[-0.5]) for i in ids] if with_logprobs and ids else None
            events.append(Token(job_id=J, seq=seq, attempt=attempt, text=draw(texts), token_ids=ids, logprobs=lps))
            seq += 1
    events.append(Finished(job_id=J, seq=seq, attempt=attempts, finish_reason=FinishReason.STOP, text="t"))
    return events


def entries_of(events: list[Event]) -> list[LogEntry]:
    return [LogEntry(e.seq, e.attempt, encode(e)) for e in events]


@settings(max_examples=300, deadline=None)
@given(logs())
def test_a_compacted_log_replays_the_same_events(events):
    compacted = compact(entries_of(events))
    assert [ev for e in compacted for ev in expand(e)] == events
    assert compact(compacted) == compacted  # compacting again changes nothing
    # every run of tokens of one attempt is one entry: no two token entries in a row
    # (an empty delta of a job with logprobs has none: it starts a run of its own)
    if not any(isinstance(e, Token) and e.logprobs for e in events):
        kinds = [type(decode_event(e.data)).__name__ + str(e.attempt) for e in compacted]
        assert all(not (a == b and a.startswith("Token")) for a, b in zip(kinds, kinds[1:]))


@settings(max_examples=200, deadline=None)
@given(logs(), st.data())
def test_a_reader_resuming_inside_a_run_gets_exactly_the_rest(events, data):
    """What `read_log(after_seq=k)` does: expand, keep seq > k."""
    k = data.draw(st.integers(-1, events[-1].seq))
    compacted = compact(entries_of(events))
    rest = [ev for e in compacted for ev in expand(e) if ev.seq > k]
    assert rest == [e for e in events if e.seq > k]


@settings(max_examples=200, deadline=None)
@given(logs())
def test_a_reader_ignoring_the_sizes_still_reads_each_attempts_text(events):
    last = events[-1].attempt
    whole = "".join(e.text for e in events if isinstance(e, Token) and e.attempt == last)
    naive = "".join(ev.text for e in compact(entries_of(events))
                    if isinstance(ev := decode_event(e.data), Token) and ev.attempt == last)
    assert naive == whole


def test_the_sizes_are_utf8_bytes_and_counts_other_than_one():
    events = [Token(job_id=J, seq=1, attempt=1, text="é", token_ids=[1]),
              Token(job_id=J, seq=2, attempt=1, text="ab", token_ids=[2, 3]),
              Token(job_id=J, seq=3, attempt=1, text="", token_ids=[])]
    (run,) = compact(entries_of(events))
    assert run.seq == 3 and run.splits == "2,2:2,0:0"
    assert parse_splits(run.splits) == [(2, 1), (2, 2), (0, 0)]
    assert decode_event(run.data) == Token(job_id=J, seq=3, attempt=1, text="éab", token_ids=[1, 2, 3])


def test_entries_are_read_from_xrange_fields():
    ev = Token(job_id=J, seq=4, attempt=2, text="ab", token_ids=[1, 2])
    assert entry_of({b"e": encode(ev), b"q": b"4", b"a": b"2"}) == LogEntry(4, 2, encode(ev), "")
    assert entry_of({b"e": encode(ev), b"q": b"4", b"a": b"2", b"s": b"1,1"}).splits == "1,1"


@pytest.mark.parametrize("splits", ["1,2", "3", "1,1,1", "x", "-1,3"])
def test_sizes_that_do_not_match_the_run_are_an_error(splits):
    ev = Token(job_id=J, seq=4, attempt=1, text="ab", token_ids=[1, 2])
    with pytest.raises(ValueError):
        expand(LogEntry(4, 1, encode(ev), splits))


def test_sizes_on_an_event_that_is_not_a_token_are_an_error():
    ev = Started(job_id=J, seq=0, attempt=1, worker_id="w")
    with pytest.raises(ValueError, match="Started"):
        expand(LogEntry(0, 1, encode(ev), "1"))
