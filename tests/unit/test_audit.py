"""The delivery invariants one job's log and recorded outcome keep (`worker.client.audit`,
run by `inflight jobs audit` and the fault soak), each defect kind planted on a clean log."""

from __future__ import annotations

from schemas.wire import Finished, FinishReason, Restarted, Started, Token
from worker.cli.jobs import describe_log
from worker.client.audit import DEFECT_KINDS, job_status, log_defects

J = "job-1"


def clean(text_parts=("Hel", "lo", "!"), attempt=1, start_seq=0):
    log = [Started(job_id=J, seq=start_seq, attempt=attempt, worker_id="w1")]
    for i, t in enumerate(text_parts):
        log.append(Token(job_id=J, seq=start_seq + 1 + i, attempt=attempt, text=t, token_ids=[i]))
    log.append(Finished(job_id=J, seq=start_seq + 1 + len(text_parts), attempt=attempt,
                        finish_reason=FinishReason.LENGTH, text="".join(text_parts)))
    return log


def test_a_clean_log_has_no_defect_and_a_restart_is_fine():
    log = clean()
    assert log_defects(log, log[-1]) == []
    assert job_status(log, log[-1], 10.0, 600.0) == ("finished", [])
    first = clean(("x",))[:2]  # attempt 1 streamed one token, then the job restarted elsewhere
    restarted = [*first, Restarted(job_id=J, seq=2, attempt=2, reason="worker lost"),
                 *[e.__class__(**{**{f: getattr(e, f) for f in e.__struct_fields__}, "seq": e.seq + 3})
                   for e in clean(attempt=2)]]
    assert log_defects(restarted, restarted[-1]) == []  # the text is the last attempt's


def test_each_planted_defect_is_found():
    log = clean()
    rec = log[-1]
    planted = {
        "seq_gap": ([*log[:2], *log[3:]], rec),
        "log_mid_way": ([e.__class__(**{**{f: getattr(e, f) for f in e.__struct_fields__}, "seq": e.seq + 5})
                         for e in log], Finished(job_id=J, seq=rec.seq + 5, attempt=1,
                                                 finish_reason=FinishReason.LENGTH, text=rec.text)),
        "terminals_not_1": ([*log, Finished(job_id=J, seq=rec.seq + 1, attempt=1, finish_reason=FinishReason.STOP,
                                            text=rec.text)], rec),
        "text_mismatch": ([*log[:-1], Finished(job_id=J, seq=rec.seq, attempt=1, finish_reason=FinishReason.LENGTH,
                                               text="Hello?")], None),
        "attempt_backwards": ([log[0], Token(job_id=J, seq=1, attempt=2, text="Hel", token_ids=[0]), *log[2:]], rec),
        "log_vs_results": (log, Finished(job_id=J, seq=rec.seq, attempt=1, finish_reason=FinishReason.STOP,
                                         text=rec.text)),
        "missing_outcome": (log, None),
    }
    for kind, (events, recorded) in planted.items():
        assert kind in log_defects(events, recorded), (kind, log_defects(events, recorded))
    assert set(planted) == set(DEFECT_KINDS)
    # a log with an outcome but no terminal event
    assert "terminals_not_1" in log_defects(log[:-1], rec)


def test_pending_expired_and_lost_jobs():
    log = clean()
    assert job_status([], log[-1], 5.0, 600.0) == ("log_expired", [])  # the outcome stays in the results topic
    assert job_status([], None, 5.0, 600.0) == ("pending", [])  # queued
    assert job_status([], None, 601.0, 600.0) == ("pending", ["missing_outcome"])  # lost
    assert job_status(log[:2], None, 5.0, 600.0) == ("pending", [])  # running
    assert job_status(log[:2], None, 601.0, 600.0) == ("pending", ["missing_outcome"])  # stuck
    assert job_status(log, None, 5.0, 600.0) == ("finished", ["missing_outcome"])  # ended, never recorded


def test_job_show_codes_the_log_by_runs():
    runs = describe_log(clean())
    assert [r["event"] for r in runs] == ["started", "token", "finished"]
    assert runs[1] == {"event": "token", "seq": 1, "attempt": 1, "seq_last": 3, "tokens": 3, "chars": 6}
    assert runs[2]["finish_reason"] == "length" and runs[0]["worker_id"] == "w1"
