"""Publishing is idempotent per (job, seq) on the real Redis: a round sent twice (what
redis-py's retry does after a connection error) neither duplicates nor reorders the
replay log or the live channel, and an event from a worker that lost the job's claim is
refused, behind or ahead of the holder's seq."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from schemas import keys
from schemas.codec import decode_event
from schemas.wire import Job
from worker.config import RedisConfig
from worker.engine import RequestOutput
from worker.serve.claims import Claimed, ClaimStore
from worker.serve.jobs import JobTable
from worker.serve.local_job import Round
from worker.serve.publish import Publisher
from worker.serve.read_ahead import JobRecord


async def publishing(services, prefix: str, job_id: str):
    """A worker's publishing parts on the real Redis (claims, job table, publisher), a
    subscriber on `job_id`'s channel and the job claimed: (redis, claims, table,
    publisher, pubsub, claim)."""
    r = aioredis.from_url(services[1])
    claims = ClaimStore(r, prefix, "w1", lease_ms=5000, ttl_s=60, tombstone_ttl_s=60)
    await claims.adopt_epoch()
    table = JobTable("w1")
    pub = Publisher(r, RedisConfig(url=services[1], key_prefix=prefix), claims, table)
    ps = r.pubsub()
    await ps.subscribe(keys.channel(job_id, prefix))
    await ps.get_message(timeout=1)  # subscribe confirmation
    (c,) = await claims.take([job_id])
    return r, claims, table, pub, ps, c


async def streamed(table: JobTable, pub: Publisher, c, job_id: str, texts: str) -> None:
    """Open `job_id` on the claim `c` and publish its started event and one token event per
    character of `texts`, one round each (seqs 0..len(texts))."""
    table.open(JobRecord(Job(job_id=job_id, prompt="x"), "normal", None, 0, 0.0, None, None),
               Claimed(c.token, c.attempt, c.next_seq, 0, False))
    table.accepted(job_id)
    for text in texts:
        table.apply_outputs([RequestOutput(job_id, [ord(text)], text)])
        await pub.send(table.drain())


def test_resent_events_are_dropped(services, prefix):
    async def main():
        r, claims, table, pub, ps, c = await publishing(services, prefix, "j")
        await r.script_flush()  # the first publish must recover from NOSCRIPT
        job = table.open(JobRecord(Job(job_id="j", prompt="x"), "normal", None, 0, 0.0, None, None), Claimed(c.token, c.attempt, c.next_seq, 0, False))
        table.accepted("j")
        table.apply_outputs([RequestOutput("j", [1], "a")])
        first = table.drain()  # started (seq 0), token (seq 1)
        table.apply_outputs([RequestOutput("j", [2], "b")])
        second = table.drain()  # token (seq 2)
        await pub.send(first)
        await pub.send(first)  # re-sent whole
        await pub.send(Round(first.events[1:] + second.events, first.encoded[1:] + second.encoded, [],
                             tokens=first.tokens[1:] + second.tokens))
        zombie = JobTable("w0")  # a worker that lost the claim, behind: its seq 1 is stale
        zombie.open(JobRecord(Job(job_id="j", prompt="x"), "normal", None, 0, 0.0, None, None), Claimed("old-claim", 1, 1, 0, False))
        zombie.apply_outputs([RequestOutput("j", [9], "x")])
        assert await pub.send(zombie.drain()) == {"j"}  # refused: it learns the job is another worker's
        ahead = JobTable("w0")  # ... and one ahead of the holder: refused
        ahead.open(JobRecord(Job(job_id="j", prompt="x"), "normal", None, 0, 0.0, None, None), Claimed("old-claim", 1, 3, 0, False))
        ahead.apply_outputs([RequestOutput("j", [9], "x", finished=True, finish_reason="stop")])
        assert await pub.send(ahead.drain()) == {"j"}
        assert await r.get(keys.done_key("j", prefix)) is None  # its terminal event ended nothing
        # "k" ends on its new holder; a round of the new holder sent twice is no refusal, the
        # stale holder's token + terminal events are (its terminal never counts)
        holder, stale = JobTable("w2"), JobTable("w1")
        (old,) = await claims.take(["k"])
        stale.open(JobRecord(Job(job_id="k", prompt="x"), "normal", None, 0, 0.0, None, None), Claimed(old.token, old.attempt, 0, 0, False))
        await r.delete(keys.claim_key("k", prefix))  # the stale holder's lease lapses...
        (new,) = await claims.take(["k"])  # ...and another worker claims the job
        holder.open(JobRecord(Job(job_id="k", prompt="x"), "normal", None, 0, 0.0, None, None), Claimed(new.token, new.attempt, 0, 0, False))
        for t in (holder, stale):
            t.accepted("k")
            t.apply_outputs([RequestOutput("k", [4, 5], "yz", finished=True, finish_reason="length")])
        ended = holder.drain()
        assert await pub.send(ended) == set() and await pub.send(ended) == set()
        late = stale.drain()
        assert await claims.renew({"k": (old.token, old.attempt)}) == {"k"}  # no re-acquiring an ended job
        assert await pub.send(late) == {"k"}
        # "m": claimed by another since, who handed it back: the first holder may not take it back
        (m1,) = await claims.take(["m"])
        await r.delete(keys.claim_key("m", prefix))
        (m2,) = await claims.take(["m"])
        await claims.release([("m", m2.token, m2.attempt)])
        assert await claims.renew({"m": (m1.token, m1.attempt)}) == {"m"}
        first_holder = JobTable("w1")
        first_holder.open(JobRecord(Job(job_id="m", prompt="x"), "normal", None, 0, 0.0, None, None), Claimed(m1.token, m1.attempt, 0, 0, False))
        first_holder.accepted("m")
        assert await pub.send(first_holder.drain()) == {"m"}
        k_log = [decode_event(f[b"e"]) for _, f in await r.xrange(keys.log_key("k", prefix))]
        live = []
        while (m := await ps.get_message(timeout=0.5)) is not None:
            if m["type"] == "message":
                live.append(decode_event(m["data"]).seq)
        log = [decode_event(f[b"e"]).seq for _, f in await r.xrange(keys.log_key("j", prefix))]
        text = "".join(getattr(decode_event(f[b"e"]), "text", "") for _, f in await r.xrange(keys.log_key("j", prefix)))
        await ps.aclose()
        await r.aclose()
        return log, live, text, job, k_log

    log, live, text, job, k_log = asyncio.run(main())
    assert [(e.seq, e.attempt) for e in k_log] == [(0, 2), (1, 2), (2, 2), (3, 2)]  # the holder's run alone
    assert log == [0, 1, 2]
    assert live == [0, 1, 2]
    assert text == "ab" and job.next_seq == 3


def test_an_ended_jobs_log_is_compacted_in_place_and_replays_the_same(services, prefix):
    """The terminal round rewrites the log (`redis.compact_logs`): started, one run,
    finished; the first stream id is kept; live readers saw every event and
    never the run; `read_log` from anywhere gives what it gave before; a re-sent terminal
    round changes nothing; a restore after data loss writes the compacted log back."""
    from worker.client import InflightClient

    async def main():
        out = {}
        r, claims, table, pub, ps, c = await publishing(services, prefix, "c")
        held = table.open(JobRecord(Job(job_id="c", prompt="x"), "normal", None, 0, 0.0, None, None),
                          Claimed(c.token, c.attempt, c.next_seq, 0, False))
        table.accepted("c")
        for ids, text in (([1], "Hé"), ([2, 3], "ll"), ([], "o"), ([4], " wö")):
            table.apply_outputs([RequestOutput("c", ids, text)])
            await pub.send(table.drain())
        log_key = keys.log_key("c", prefix)
        before = await r.xrange(log_key)
        async with InflightClient(services[0], services[1], key_prefix=prefix) as client:
            out["read_before"] = await client.read_log("c")
            table.apply_outputs([RequestOutput("c", [5], "rld", finished=True, finish_reason="stop")])
            end = table.drain()
            await pub.send(end)
            out["after"] = await r.xrange(log_key)
            out["read_after"] = await client.read_log("c")
            out["resume_inside_run"] = await client.read_log("c", after_seq=2)
            await pub.send(end)  # re-sent: nothing changes
            out["resent"] = await r.xrange(log_key)
            out["ttl"] = await r.ttl(log_key)
            live = []
            while (m := await ps.get_message(timeout=0.5)) is not None:
                if m["type"] == "message":
                    live.append(decode_event(m["data"]))
            out["live"] = live
            # Redis loses the log and the epoch: the restore writes the compacted log back
            table.done(held)
            await r.delete(log_key, keys.epoch_key(prefix), keys.done_key("c", prefix))
            await pub.restore(claims.epoch)
            out["restored"] = await r.xrange(log_key)
            out["read_restored"] = await client.read_log("c")
        out["before"] = before
        await ps.aclose()
        await r.aclose()
        return out

    out = asyncio.run(main())
    events = out["read_after"]
    assert [e.seq for e in events] == list(range(7))
    assert out["read_before"] == events[:-2]  # the same events, seq for seq (5 and 6: the last round)
    assert "".join(e.text for e in events[1:-1]) == "Héllo wörld" == events[-1].text
    assert out["resume_inside_run"] == events[3:]
    after = out["after"]
    assert [f.get(b"s") for _, f in after] == [None, b"3,2:2,1:0,4,3", None]
    # the first entry keeps its stream id; the others get the rewrite's time
    before_ids = {f[b"q"]: i for i, f in out["before"]}
    assert after[0][0] == before_ids[b"0"] and after[1][0] > before_ids[b"4"]
    assert out["resent"] == after and out["ttl"] > 0
    assert [e.seq for e in out["live"]] == list(range(7))  # live: every event, never the run
    assert [f for _, f in out["restored"]] == [f for _, f in after] and out["read_restored"] == events


def test_a_lost_tail_is_restored_before_the_next_round(services, prefix):
    """A failover to a replica that missed the last writes: the job's log lost its tail.
    The next live round would leave a gap; it is refused, the worker restores the log, and
    the round follows: seqs 0..n with nothing missing, published once more for readers."""
    async def main():
        r, claims, table, pub, ps, c = await publishing(services, prefix, "lt")
        await streamed(table, pub, c, "lt", "abc")  # started (0), then a, b, c (1..3)
        log_key = keys.log_key("lt", prefix)
        tail = await r.xrevrange(log_key, count=2)
        await r.xdel(log_key, *[entry_id for entry_id, _ in tail])  # the replica never got b, c
        table.apply_outputs([RequestOutput("lt", [ord("d")], "d")])
        assert await pub.send(table.drain()) == set()
        seqs = [int(f[b"q"]) for _, f in await r.xrange(log_key)]
        assert seqs == [0, 1, 2, 3, 4] and pub.num_restores == 1
        texts = [decode_event(f[b"e"]).text for _, f in (await r.xrange(log_key))[1:]]
        assert "".join(texts) == "abcd"
        await r.aclose()

    asyncio.run(main())


def test_an_epoch_made_on_another_server_is_a_data_loss(services, prefix):
    """The epoch names the server it was made on: a worker that finds the marker it holds
    on another server (a promoted replica has the marker, not the last writes) makes a new
    epoch with the restore window, once; the next worker adopts that one."""
    async def main():
        r = aioredis.from_url(services[1])
        a = ClaimStore(r, prefix, "wa", lease_ms=5000, ttl_s=60, tombstone_ttl_s=60)
        b = ClaimStore(r, prefix, "wb", lease_ms=5000, ttl_s=60, tombstone_ttl_s=60)
        await a.adopt_epoch()
        server = await a.server_id()
        assert server and a.epoch.endswith(f"@{server}") and await a.epoch_intact()
        replicated = "0123abcd@a-server-that-died"  # what the promoted replica holds
        await r.set(keys.epoch_key(prefix), replicated)
        a.epoch = b.epoch = replicated
        assert not await a.epoch_intact()  # the marker is the one held, the server is not
        assert await a.adopt_epoch() is True
        assert a.epoch != replicated and a.epoch.endswith(f"@{server}")
        assert await r.exists(keys.restore_window_key(prefix))
        assert await b.adopt_epoch() is True and b.epoch == a.epoch  # one new epoch, not two
        assert await a.epoch_intact() and await b.epoch_intact()
        await r.aclose()

    asyncio.run(main())


def test_a_restore_onto_a_log_that_kept_part_of_a_run_doubles_nothing(services, prefix):
    """The job ended and its history became the compacted log, but the terminal round never
    reached Redis, which then came back with its data (a restart from its files, a
    failover: the log kept the tokens one per entry). The restore rewrites the log from
    the compacted history instead of appending the run on top: every event once; the
    terminal round sent again afterwards changes nothing."""
    from tests.integration.helpers import read_whole_log
    from worker.client import text_of

    async def main():
        r, claims, table, pub, ps, c = await publishing(services, prefix, "rt")
        await streamed(table, pub, c, "rt", "abc")  # started (0), a, b, c (1..3), one entry each
        table.apply_outputs([RequestOutput("rt", [ord("d")], "d", finished=True, finish_reason="length")])
        final = table.drain()  # d (4), finished (5), and the compacted log: never sent
        await pub.restore(claims.epoch)
        after_restore = await read_whole_log(services[1], prefix, "rt")
        await pub.send(final)
        after_resend = await read_whole_log(services[1], prefix, "rt")
        await r.aclose()
        return after_restore, after_resend

    for log in asyncio.run(main()):
        assert [e.seq for e in log] == [0, 1, 2, 3, 4, 5], [(type(e).__name__, e.seq) for e in log]
        assert text_of(log) == "abcd" and type(log[-1]).__name__ == "Finished"
