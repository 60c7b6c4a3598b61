"""The invariants every job's outcome keeps (the README's delivery promise), checked on one
job's Redis log and its record in the results topic: what `inflight jobs audit` runs over
a time window and the fault soak (`tools/soak.py`) over its run.

Defect kinds (a job can have several):

    missing_outcome     no record in the results topic, although the log has its terminal
                        event or the job is older than the audit's pending limit
    log_mid_way         the log does not start at seq 0 (read from its first entry)
    seq_gap             seqs not consecutive
    terminals_not_1     two terminal events, or events after none (a log with a recorded
                        outcome but no terminal)
    text_mismatch       the last attempt's token texts do not concatenate to finished.text
    attempt_backwards   attempts decrease along the log
    log_vs_results      the log's terminal event differs from the recorded outcome (seq, text,
                        finish reason)

Not defects: a job with no log but a recorded outcome (its log expired, `redis.log_ttl_s`:
the outcome stays in the results topic), and a job with neither yet, younger than the
pending limit (queued or running).
"""

from __future__ import annotations

from collections.abc import Sequence

from schemas.wire import Event, Finished
from worker.client.events import text_of

DEFECT_KINDS = ("missing_outcome", "log_mid_way", "seq_gap", "terminals_not_1", "text_mismatch",
                "attempt_backwards", "log_vs_results")


def log_defects(log: Sequence[Event], recorded: Finished | None) -> list[str]:
    """The defect kinds of one job's log (non-empty, read from its first entry) against its
    recorded outcome (None: not recorded). `missing_outcome` is judged here only from the
    log (a terminal event that was never recorded); the caller judges a job without either."""
    out: list[str] = []
    seqs = [e.seq for e in log]
    if seqs[0] != 0:
        out.append("log_mid_way")
    if seqs != list(range(seqs[0], seqs[0] + len(seqs))):
        out.append("seq_gap")
    terminals = [e for e in log if isinstance(e, Finished)]
    if len(terminals) > 1 or (not terminals and recorded is not None):
        out.append("terminals_not_1")
    attempts = [e.attempt for e in log]
    if attempts != sorted(attempts):
        out.append("attempt_backwards")
    if terminals and seqs[0] == 0 and text_of(list(log)) != terminals[-1].text:
        out.append("text_mismatch")
    if terminals and recorded is None:
        out.append("missing_outcome")
    if terminals and recorded is not None and (
            (terminals[-1].seq, terminals[-1].text, terminals[-1].finish_reason)
            != (recorded.seq, recorded.text, recorded.finish_reason)):
        out.append("log_vs_results")
    return out


def job_status(log: Sequence[Event], recorded: Finished | None, age_s: float, pending_after_s: float
               ) -> tuple[str, list[str]]:
    """One job's audit: (`finished` | `log_expired` | `pending`, its defects).

    Args:
        log: its events from the first entry (empty: no log in Redis).
        recorded: its terminal event in the results topic, or None.
        age_s: seconds since the job was produced.
        pending_after_s: a job with no outcome and no terminal event older than this is a
            `missing_outcome` defect, not pending.
    """
    if not log:
        if recorded is not None:
            return "log_expired", []
        return ("pending", []) if age_s < pending_after_s else ("pending", ["missing_outcome"])
    defects = log_defects(log, recorded)
    ended = recorded is not None or any(isinstance(e, Finished) for e in log)
    if not ended and age_s >= pending_after_s:
        defects.append("missing_outcome")
    return ("finished" if ended else "pending"), defects
