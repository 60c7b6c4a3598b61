"""The worker's job table without Kafka or Redis: hand-made engine outputs in, numbered
wire events out (seq numbering, `started` before the first token, token coalescing,
exactly one terminal event, nothing after a cancel or a hand-back)."""

from __future__ import annotations

import pytest

from schemas.replay import LogEntry, expand
from schemas.wire import ErrorInfo, Finished, FinishReason, Job, Restarted, Started, Token
from worker.engine import RequestOutput, Usage
from worker.serve.claims import Claimed
from worker.serve.jobs import JobState, JobTable
from worker.serve.read_ahead import JobRecord


def out(rid: str, ids: list[int], text: str, reason: str | None = None) -> RequestOutput:
    if reason is None:
        return RequestOutput(rid, ids, text)
    return RequestOutput(rid, ids, text, finished=True, finish_reason=reason, usage=Usage(prompt_tokens=3, completion_tokens=2))


def open_job(table: JobTable, job_id: str = "j", attempt: int = 1, next_seq: int = 0):
    return table.open(JobRecord(Job(job_id=job_id, prompt="hi", metadata={"m": 1}), "high", "tp", 7, 100.0, None, None),
                      Claimed("token", attempt, next_seq, 0, False))


def kinds(events) -> list[str]:
    return [type(e).__name__ for e in events]


def test_started_precedes_tokens_and_seq_continues_the_log():
    t = JobTable("w1", clock=lambda: 101.0)
    held = open_job(t, next_seq=5)
    t.accepted("j")
    t.apply_outputs([out("j", [1], "a")])
    r = t.drain()
    assert kinds(r.events) == ["Started", "Token"]
    assert [e.seq for e in r.events] == [5, 6]
    assert isinstance(r.events[0], Started) and r.events[0].worker_id == "w1" and r.events[0].metadata == {"m": 1}
    assert r.events[0].queue_time_s == pytest.approx(1.0)
    t.apply_outputs([out("j", [2], "b", "length")])
    r = t.drain()
    assert kinds(r.events) == ["Token", "Finished"] and [e.seq for e in r.events] == [7, 8]
    fin = r.events[-1]
    assert fin.text == "ab" and fin.finish_reason == FinishReason.LENGTH and r.finished == [held]
    assert held.state == JobState.FINISHING
    t.done(held)
    assert len(t) == 0 and held.state == JobState.DONE


def test_a_second_record_of_a_held_job_is_attached_to_it_not_opened():
    """Two records of one job in one fetched batch (a producer that sent it twice): the
    second is answered by the first's terminal event, never run as a second job."""
    t = JobTable("w1")
    first = open_job(t)
    again = JobRecord(first.job, "high", "tp", 9, 101.0, None, None)
    assert t.open(again, Claimed("token", 1, 0, 0, False)) is None
    assert len(t) == 1 and [o.offset for o in first.offsets] == [7, 9]
    assert t.num_unfinished == 1 and t.held_by_tenant() == {"": 1}


def test_output_overtaking_accepted_still_opens_with_started_once():
    t = JobTable("w1")
    open_job(t)
    t.apply_outputs([out("j", [1], "a")])  # the engine's first output arrived before `accepted`
    t.accepted("j")
    assert kinds(t.drain().events) == ["Started", "Token"]


def test_a_publisher_behind_gets_one_merged_token_event_with_the_same_text():
    t = JobTable("w1")
    open_job(t)
    t.accepted("j")
    for i, ch in enumerate("hello"):
        t.apply_outputs([out("j", [i], ch)])
    r = t.drain()
    assert kinds(r.events) == ["Started", "Token"]
    tok = r.events[1]
    assert isinstance(tok, Token) and tok.text == "hello" and tok.token_ids == [0, 1, 2, 3, 4]


def test_exactly_one_terminal_event_and_nothing_after_it():
    t = JobTable("w1")
    open_job(t)
    t.accepted("j")
    t.apply_outputs([out("j", [1], "a", "stop")])
    t.apply_outputs([out("j", [2], "b"), out("j", [], "", "cancelled")])  # late outputs are ignored
    assert t.finish_local("j", FinishReason.CANCELLED) is None
    events = t.drain().events
    assert kinds(events) == ["Started", "Token", "Finished"]
    assert not t.drain()


def test_hand_back_drops_drafts_and_emits_nothing():
    t = JobTable("w1")
    held = open_job(t)
    t.accepted("j")
    t.apply_outputs([out("j", [1], "a")])
    assert t.hand_back("j") is held and held.state == JobState.HANDED_BACK
    t.apply_outputs([out("j", [2], "b", "length")])
    assert not t.drain() and "j" not in t


def test_a_later_attempt_opens_with_restarted():
    t = JobTable("w1")
    open_job(t, attempt=2, next_seq=9)
    t.accepted("j")
    r = t.drain()
    assert kinds(r.events) == ["Restarted", "Started"] and [e.seq for e in r.events] == [9, 10]
    assert all(e.attempt == 2 for e in r.events) and isinstance(r.events[0], Restarted)


def test_jobs_that_never_run_get_only_their_terminal_event():
    t = JobTable("w1")
    open_job(t, "c")
    open_job(t, "r", attempt=3, next_seq=4)
    t.finish_local("c", FinishReason.CANCELLED)
    t.finish_local("r", FinishReason.REJECTED, ErrorInfo(code="prompt_too_long", message="x"),
                   dead_letter=("prompt_too_long", "x"))
    events = t.drain().events
    c = [e for e in events if e.job_id == "c"]
    r = [e for e in events if e.job_id == "r"]
    assert kinds(c) == ["Finished"] and kinds(r) == ["Restarted", "Finished"]
    assert c[0].finish_reason == "cancelled" and c[0].seq == 0
    assert r[1].error.code == "prompt_too_long" and r[1].seq == 5
    assert t.get("r").dead_letter == ("prompt_too_long", "x")
    t.accepted("c")  # the engine's answer for a job already ended is ignored
    assert not t.drain()


def test_cancel_is_noted_once_and_only_for_running_jobs():
    t = JobTable("w1")
    held = open_job(t)
    assert t.request_cancel("j", now_mono=5.0) is held and held.cancel_time_mono == 5.0
    assert t.request_cancel("j", now_mono=9.0) is held and held.cancel_time_mono == 5.0
    t.finish_local("j", FinishReason.CANCELLED)
    assert t.request_cancel("j") is None and t.request_cancel("unknown") is None


def test_histories_hold_what_redis_must_hold_after_data_loss():
    now = [1000.0]
    t = JobTable("w1", clock=lambda: now[0])
    done = open_job(t, "done")
    old = open_job(t, "old")
    open_job(t, "running")
    prior = (LogEntry(0, 1, b"started"), LogEntry(1, 1, b"token"))  # attempt 1's entries, found at the claim
    t.open(JobRecord(Job(job_id="finishing", prompt="hi"), "high", "tp", 7, 100.0, None, None), Claimed("token", 2, 5, 0, False, prior))
    for jid in ("done", "old", "running", "finishing"):
        t.accepted(jid)
        t.apply_outputs([out(jid, [1], "x")])
    t.apply_outputs([out("done", [], "", "stop"), out("old", [], "", "length"), out("finishing", [], "", "stop")])
    rnd = t.drain()
    assert rnd.tokens == ["token"] * len(rnd.events)  # each event with its job's claim token
    t.done(old)
    now[0] += 121  # older than the restore keeps (its outcome is in the results topic)
    t.done(done)
    hist = {jid: (attempt, token, h, reason) for jid, attempt, token, h, reason, _ in t.histories()}
    assert sorted(hist) == ["done", "finishing", "running"]
    assert [e.seq for e in hist["running"][2]] == [0, 1] and hist["running"][3] is None
    assert [e.seq for e in hist["done"][2]] == [0, 1, 2] and hist["done"][:2] == (1, "token")
    assert hist["done"][3] == "stop"
    # a held job whose terminal event is numbered: restored with its done mark
    assert [e.seq for e in hist["finishing"][2]] == [5, 6, 7, 8] and hist["finishing"][0] == 2
    assert hist["finishing"][3] == "stop"
    assert {jid: p for jid, *_, p in t.histories()}["finishing"] == prior  # restored before its own


def test_a_lost_finishing_job_publishes_and_records_nothing():
    t = JobTable("w1")
    open_job(t, "a")
    t.accepted("a")
    t.apply_outputs([out("a", [1], "x", "stop")])
    assert t.hand_back("a") is None  # finishing: hand_back keeps it...
    held = t.disown("a")  # ...another worker holds it now: gone, terminal draft dropped
    assert held is not None and held.state == JobState.HANDED_BACK
    assert "a" not in t and not t.drain() and t.num_unfinished == 0 and list(t.histories()) == []


def test_first_tokens_and_token_counts_are_reported_for_metrics():
    t = JobTable("w1", clock=lambda: 103.0)
    open_job(t, "a")
    open_job(t, "b")
    applied = t.apply_outputs([out("a", [1, 2], "xy"), out("b", [], ""), out("gone", [3], "z")])
    assert [j.job_id for j in applied.first_tokens] == ["a"] and applied.num_tokens == 2
    assert t.get("a").first_token_time == 103.0 and t.get("b").first_token_time is None


def test_terminal_event_carries_usage_timings_and_error():
    t = JobTable("w1", clock=lambda: 110.0)
    open_job(t)
    t.accepted("j")
    o = RequestOutput("j", [], "", finished=True, finish_reason="error", usage=Usage(prompt_tokens=3, completion_tokens=0), error_code="internal",
                      error_message="RuntimeError: boom")
    t.apply_outputs([o])
    fin = t.drain().events[-1]
    assert isinstance(fin, Finished) and fin.finish_reason == FinishReason.ERROR
    assert fin.error.code == "internal" and fin.usage.prompt_tokens == 3 and fin.timings.e2e_s == pytest.approx(10.0)


def test_jobs_held_per_tenant_count_until_the_terminal_event():
    t = JobTable("w1", clock=lambda: 101.0)
    jobs = [t.open(JobRecord(Job(job_id=f"j{i}", prompt="hi", tenant=tenant), "normal", "tp", i, 100.0, None, None), Claimed("tok", 1, 0, 0, False))
            for i, tenant in enumerate(["a", "a", "b", None, "b"])]
    assert t.held_by_tenant() == {"a": 2, "b": 2, "": 1}
    t.hand_back("j0")
    t.accepted("j2")
    t.apply_outputs([out("j2", [1], "x", "length")])  # terminal event drafted: FINISHING
    t.finish_local("j4", FinishReason.CANCELLED)
    assert t.held_by_tenant() == {"a": 1, "": 1} and len(t) == 4  # still held, no longer counted
    t.drain()
    t.done(jobs[2])
    t.done(jobs[2])  # a second done of the same job changes nothing
    assert t.held_by_tenant() == {"a": 1, "": 1} and len(t) == 3
    assert t.num_unfinished == 2  # j1 and j3: the slots `max_local_jobs` bounds


def test_finishing_jobs_hold_no_slot_but_are_bounded_by_as_many_again():
    from types import SimpleNamespace

    from worker.serve.starter import JobStarter

    t = JobTable("w1")
    starter = SimpleNamespace(table=t, max_local_jobs=4, host=SimpleNamespace(intake_paused=lambda: False))
    free = lambda: JobStarter.free_slots(starter)  # noqa: E731
    jobs = [open_job(t, f"j{i}") for i in range(4)]
    assert free() == 0
    for held in jobs:  # all four end: their terminal events wait for the publisher
        t.accepted(held.job_id)
        t.apply_outputs([out(held.job_id, [1], "x", "length")])
    assert t.num_unfinished == 0 and len(t) == 4 and free() == 4  # the engine may take four more
    more = [open_job(t, f"k{i}") for i in range(4)]
    assert free() == 0
    for held in more:
        t.accepted(held.job_id)
        t.apply_outputs([out(held.job_id, [1], "x", "length")])
    assert t.num_unfinished == 0 and len(t) == 8 and free() == 0  # 2 x max_local_jobs held: intake waits
    t.drain()
    t.done(jobs[0])
    assert free() == 1
    starter.host.intake_paused = lambda: True
    assert free() == 0


def run_rounds(t: JobTable, job_id: str, deltas: list[tuple[list[int], str]], reason: str = "stop"):
    """Each delta in a round of its own, then the end: the rounds' events and the last round."""
    t.accepted(job_id)
    events = []
    for ids, text in deltas:
        t.apply_outputs([out(job_id, ids, text)])
        events += t.drain().events
    t.apply_outputs([out(job_id, [], "", reason)])
    last = t.drain()
    return events + last.events, last


def test_an_ending_job_gets_its_log_compacted_to_the_same_events():
    t = JobTable("w1")
    held = open_job(t)
    deltas = [([5], "Hé"), ([6, 7], "llo"), ([8], " wörld"), ([], "!"), ([9], "")]
    events, last = run_rounds(t, "j", deltas)
    assert kinds(events) == ["Started"] + ["Token"] * 5 + ["Finished"]
    entries = last.compacted["j"]
    assert [e.seq for e in entries] == [0, 5] and entries[0].splits == "" and entries[1].splits == "3,3:2,7,1:0,0"
    replayed = [ev for e in entries for ev in expand(e)]
    assert replayed == events[:-1]  # seq for seq, text, ids
    # what a restore re-appends is the compacted log with the terminal event
    assert held.history[:-1] == entries and isinstance(expand(held.history[-1])[0], Finished)
    assert last.encoded[-1] == held.history[-1].data


def test_compaction_keeps_attempts_apart_and_can_be_turned_off():
    t = JobTable("w1")
    prior_events = [Started(job_id="j", seq=0, attempt=1, worker_id="w0"),
                    Token(job_id="j", seq=1, attempt=1, text="a", token_ids=[1]),
                    Token(job_id="j", seq=2, attempt=1, text="b", token_ids=[2])]
    from schemas.codec import encode
    prior = tuple(LogEntry(e.seq, 1, encode(e)) for e in prior_events)
    t.open(JobRecord(Job(job_id="j", prompt="hi"), "high", "tp", 7, 100.0, None, None),
           Claimed("token", 2, 3, 0, False, prior))
    events, last = run_rounds(t, "j", [([3], "x"), ([4], "y")])
    entries = last.compacted["j"]
    # attempt 1's run, then attempt 2's restarted and started, then its own run
    assert [(e.seq, e.attempt, e.splits) for e in entries] == [(0, 1, ""), (2, 1, "1,1"), (3, 2, ""), (4, 2, ""),
                                                                (6, 2, "1,1")]
    assert [ev for e in entries for ev in expand(e)] == prior_events + events[:-1]
    off = JobTable("w1", compact_logs=False)
    open_job(off)
    _, last = run_rounds(off, "j", [([3], "x"), ([4], "y")])
    assert last.compacted == {}
