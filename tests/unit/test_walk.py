"""The counting rules of `tools/walk.py` (issue 43's job walk) on made-up calls: what
holds the job, what a stop, a return and a helper are."""

from __future__ import annotations

from tools.walk import ROOT, Call, Segment, _holds


def test_counting_rules():
    job = "j-1"

    class Held:
        job_id = job

    class Record:
        job = Held()

    assert _holds(job, job) and _holds(Held(), job) and _holds(Record(), job) and _holds([1, Held()], job)
    assert _holds({"k": Held()}, job) and not _holds("j-2", job) and not _holds([[Held()]], job)
    a, b, c = (str(ROOT / "worker" / "serve" / f) for f in ("a.py", "b.py", "c.py"))
    seg = Segment()
    outer = Call(a, "Starter.take", ["records"], [])
    key = Call(c, "claim_key", ["job_id"], [])  # a module-level function that passes the job nowhere: a helper
    inner = Call(b, "Table.open", ["record"], ["claim", "now"], caller=a)
    outer.inner += [key, inner]
    seg.events += [("call", outer), ("call", key), ("return", key), ("call", inner), ("return", inner)]
    r = seg.report()
    assert r["walk"] == ["worker/serve/a.py", "worker/serve/b.py", "worker/serve/a.py"]
    assert (r["stops"], r["returns"], r["files"], r["helpers"]) == (3, 1, 2, 1)
    assert r["names"] == ["record", "records"] and r["most_values_beside_the_job"] == 2
