"""Publishing is idempotent per (job, seq) on the real Redis: a pipeline sent twice (what
redis-py's retry does after a connection error) or an event from a worker that lost the
job's lease neither duplicates nor reorders the replay log or the live channel."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from schemas import keys
from schemas.codec import decode_event
from worker.config import RedisConfig
from worker.publish import JobStream, Publisher


def test_resent_events_are_dropped(services, prefix):
    async def main():
        r = aioredis.from_url(services[1])
        await r.script_flush()  # the first publish must recover from NOSCRIPT
        pub = Publisher(r, RedisConfig(url=services[1], key_prefix=prefix))
        ps = r.pubsub()
        await ps.subscribe(keys.channel("j", prefix))
        await ps.get_message(timeout=1)  # subscribe confirmation
        s = JobStream("j", 1, 0, "claim")
        first = [s.started("w1", 0.0, None), s.token("a", [1]), s.token("b", [2])]
        await pub.publish(first)
        await pub.publish(first)  # re-sent whole
        await pub.publish(first[1:2] + [s.token("c", [3])])  # an old event, then a new one
        zombie = JobStream("j", 1, 1, "old-claim")  # a worker that lost the lease, behind
        await pub.publish([zombie.token("x", [9])])
        live = []
        while (m := await ps.get_message(timeout=0.5)) is not None:
            if m["type"] == "message":
                live.append(decode_event(m["data"]).seq)
        log = [decode_event(f[b"e"]).seq for _, f in await r.xrange(keys.log_key("j", prefix))]
        await ps.aclose()
        await r.aclose()
        return log, live

    log, live = asyncio.run(main())
    assert log == [0, 1, 2, 3]
    assert live == [0, 1, 2, 3]
