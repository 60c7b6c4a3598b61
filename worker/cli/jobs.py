"""`inflight jobs audit` and `inflight job show`: the checks the fault soak runs, as an
operator tool.

`jobs audit --since T` reads every job produced to the job topics (every pool's, every
priority) in a time window, then each job's Redis log and its record in the results topic,
and checks the delivery invariants of `worker.client.audit` (exactly one terminal event,
seqs from 0 without a gap, the text equal to the tokens', the log equal to the recorded
outcome, an outcome for every job older than `--pending-after`). It prints the defects by
kind with the jobs that have them and exits 1 if there is any (0 for a clean window), so a
cron job or a post-incident check can run it. Records that are not jobs are counted (they
are in the DLQ: `inflight dlq list`); a job forwarded between pools is one job.

`job show ID` prints one job's whole story: where it was produced, its log (events run-
length coded by kind and attempt), its recorded outcome, its dead letters, and its audit.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from schemas import keys
from schemas.codec import decode_job
from schemas.wire import Event, Finished, Restarted, Started, Token
from worker.client.audit import DEFECT_KINDS, job_status

READ_CONCURRENCY = 32  # Redis log reads in flight at once


async def produced_jobs(kafka, pools, since_ms: int | None, until_ms: int | None = None
                        ) -> tuple[dict[str, dict[str, Any]], int]:
    """Jobs produced to the job topics in [since_ms, until_ms): {job_id: {tenant, topic,
    partition, offset, produced_ms}} (the first record of a job forwarded between pools),
    and the number of records that do not decode as jobs."""
    from worker.cli.scan import scan_topics

    topics = [t for name in pools.names for t in keys.job_topics(kafka.topic_prefix, name)]
    jobs: dict[str, dict[str, Any]] = {}
    invalid = 0
    for r in await scan_topics(kafka, topics, since_ms):
        if until_ms is not None and r.timestamp >= until_ms:
            continue
        try:
            job = decode_job(r.value or b"")
        except Exception:  # noqa: BLE001 - any record that is not a job: the worker dead-letters it
            invalid += 1
            continue
        seen = jobs.get(job.job_id)
        if seen is None or r.timestamp < seen["produced_ms"]:
            jobs[job.job_id] = {"tenant": job.tenant, "topic": r.topic, "partition": r.partition,
                                "offset": r.offset, "produced_ms": r.timestamp}
    return jobs, invalid


async def read_logs(client, jobs: dict[str, dict[str, Any]]) -> dict[str, list[Event]]:
    """Each job's Redis log from its first entry (empty when gone)."""
    gate = asyncio.Semaphore(READ_CONCURRENCY)

    async def one(job_id: str) -> tuple[str, list[Event]]:
        async with gate:
            return job_id, await client.read_log(job_id, tenant=jobs[job_id]["tenant"])

    return dict(await asyncio.gather(*(one(j) for j in jobs)))


async def audit(client, kafka, pools, *, since_ms: int | None, until_ms: int | None = None,
                pending_after_s: float = 600.0, now: float | None = None) -> dict[str, Any]:
    """The audit report of a window (module docstring): counts, finish reasons, and
    `defects` {kind: [job ids]} (empty lists for a clean window)."""
    now = time.time() if now is None else now
    jobs, invalid = await produced_jobs(kafka, pools, since_ms, until_ms)
    recorded = await client.lookup_results(list(jobs)) if jobs else {}
    logs = await read_logs(client, jobs)
    states: dict[str, int] = {"finished": 0, "log_expired": 0, "pending": 0}
    reasons: dict[str, int] = {}
    defects: dict[str, list[str]] = {k: [] for k in DEFECT_KINDS}
    for job_id, meta in sorted(jobs.items(), key=lambda kv: kv[1]["produced_ms"]):
        rec = recorded.get(job_id)
        state, found = job_status(logs[job_id], rec, now - meta["produced_ms"] / 1000, pending_after_s)
        states[state] += 1
        if rec is not None:
            reasons[rec.finish_reason.value] = reasons.get(rec.finish_reason.value, 0) + 1
        for kind in found:
            defects[kind].append(job_id)
    return {"since_ms": since_ms, "until_ms": until_ms, "jobs": len(jobs), **states, "invalid_records": invalid,
            "finish_reasons": dict(sorted(reasons.items())), "defects": defects}


def print_audit(report: dict[str, Any], out) -> int:
    """The report as text; returns the exit code (1: a defect)."""
    found = {k: v for k, v in report["defects"].items() if v}
    reasons = ", ".join(f"{k} {v}" for k, v in report["finish_reasons"].items()) or "none"
    print(f"{report['jobs']} job(s): {report['finished']} finished ({reasons}), {report['log_expired']} with their "
          f"log expired (outcome recorded), {report['pending']} pending; {report['invalid_records']} record(s) not "
          f"jobs (see `inflight dlq list`)", file=out)
    for kind, ids in found.items():
        print(f"DEFECT {kind}: {len(ids)} job(s): {' '.join(ids[:20])}{' ...' if len(ids) > 20 else ''}", file=out)
    print("no defects" if not found else f"{sum(len(v) for v in found.values())} defect(s)", file=out)
    return 1 if found else 0


def describe_log(log: list[Event]) -> list[dict[str, Any]]:
    """A log run-length coded: consecutive tokens of one attempt become one entry (seqs,
    count, characters); every other event one entry with what it says."""
    out: list[dict[str, Any]] = []
    for e in log:
        kind = type(e).__name__.lower()
        last = out[-1] if out else None
        if isinstance(e, Token) and last is not None and last["event"] == "token" and last["attempt"] == e.attempt:
            last["seq_last"], last["tokens"] = e.seq, last["tokens"] + len(e.token_ids)
            last["chars"] += len(e.text)
            continue
        entry: dict[str, Any] = {"event": kind, "seq": e.seq, "attempt": e.attempt}
        if isinstance(e, Token):
            entry.update(seq_last=e.seq, tokens=len(e.token_ids), chars=len(e.text))
        elif isinstance(e, Started):
            entry.update(worker_id=e.worker_id, queue_time_s=e.queue_time_s)
        elif isinstance(e, Restarted):
            entry.update(reason=e.reason)
        elif isinstance(e, Finished):
            entry.update(finish_reason=e.finish_reason.value, chars=len(e.text),
                         error=None if e.error is None else f"{e.error.code}: {e.error.message}")
        out.append(entry)
    return out


async def show(client, kafka, pools, job_id: str, *, tenant: str | None, since_ms: int | None,
               pending_after_s: float = 600.0) -> dict[str, Any]:
    """One job's story (module docstring) as a dict."""
    from worker.cli.dlq import read_dead_letters

    jobs, _ = await produced_jobs(kafka, pools, since_ms)
    produced = jobs.get(job_id)
    if tenant is None and produced is not None:
        tenant = produced["tenant"]
    log = await client.read_log(job_id, tenant=tenant)
    rec = (await client.lookup_results([job_id])).get(job_id)
    letters = await read_dead_letters(kafka, job_ids={job_id}, since_ms=since_ms)
    age = time.time() - produced["produced_ms"] / 1000 if produced is not None else 0.0
    state, defects = job_status(log, rec, age, pending_after_s)
    return {"job_id": job_id, "tenant": tenant, "produced": produced, "log": describe_log(log),
            "attempts": sorted({e.attempt for e in log}),
            "recorded": None if rec is None else {"finish_reason": rec.finish_reason.value, "seq": rec.seq,
                                                  "attempt": rec.attempt, "chars": len(rec.text)},
            "dead_letters": [d.summary() for d in letters], "state": state, "defects": defects}


def print_show(story: dict[str, Any], out) -> int:
    """`show`'s dict as text; returns the exit code (1: nothing knows the job, or a defect)."""
    p = story["produced"]
    print(f"job {story['job_id']}" + (f" (tenant {story['tenant']})" if story["tenant"] else ""), file=out)
    if p is not None:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(p["produced_ms"] / 1000))
        print(f"  produced: {p['topic']}:{p['partition']}:{p['offset']} at {when}", file=out)
    else:
        print("  produced: not found in the job topics of the window (--since)", file=out)
    print(f"  log: {len(story['log'])} entr{'y' if len(story['log']) == 1 else 'ies'} (run-length coded), attempts "
          f"{story['attempts'] or '-'}", file=out)
    for e in story["log"]:
        seqs = f"{e['seq']}" + (f"-{e['seq_last']}" if e.get("seq_last", e["seq"]) != e["seq"] else "")
        rest = {k: v for k, v in e.items() if k not in ("event", "seq", "seq_last", "attempt") and v is not None}
        print(f"    seq {seqs:<9} {e['event']:<9} attempt {e['attempt']}  "
              + " ".join(f"{k}={v}" for k, v in rest.items()), file=out)
    r = story["recorded"]
    print("  results topic: " + ("no record" if r is None else
                                 f"{r['finish_reason']}, seq {r['seq']}, attempt {r['attempt']}, {r['chars']} chars"),
          file=out)
    print(f"  dead letters: {len(story['dead_letters']) or 'none'}", file=out)
    for d in story["dead_letters"]:
        print(f"    {d['partition']}:{d['offset']}  {d['time']}  {d['reason']}  {(d['error'] or '')[:160]}", file=out)
    print(f"  state: {story['state']}; " + (f"DEFECTS: {', '.join(story['defects'])}" if story["defects"]
                                           else "no defects"), file=out)
    unknown = p is None and not story["log"] and r is None and not story["dead_letters"]
    return 1 if story["defects"] or unknown else 0
