"""A stream's quiet waits (worker/client/stream.py, `JobStream`) with a stand-in source: the
log is read again after a quiet wait that doubles up to `MAX_QUIET_POLL_S` and falls back
to `poll_s` when an event arrives; a deadline ends a wait early; events come once, in seq
order."""

from __future__ import annotations

import asyncio
import time

import pytest

from schemas.codec import encode
from schemas.wire import Finished, FinishReason, Token
from worker.client import stream as stream_mod
from worker.client.stream import JobStream


class Subscriber:
    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    async def add(self, channel: bytes) -> asyncio.Queue:
        return self.queue

    async def remove(self, channel: bytes, queue: asyncio.Queue) -> None:
        pass


class Source:
    key_prefix = "p"
    redis_config = None
    reconnect_s = 5.0
    results_fallback_s = 60.0
    results_denied = False

    def __init__(self) -> None:
        self.subscriber = Subscriber()
        self.reads: list[float] = []  # when the log was read (monotonic)
        self.log: list = []

    async def read_log(self, job_id: str, after_seq: int = -1, *, tenant: str | None = None) -> list:
        self.reads.append(time.monotonic())
        return [ev for ev in self.log if ev.seq > after_seq]

    async def lookup_results(self, job_ids, timeout_s=30.0):
        return {}


def token(seq: int) -> Token:
    return Token(job_id="j1", seq=seq, attempt=1, text="x", token_ids=[seq])


def finished(seq: int) -> Finished:
    return Finished(job_id="j1", seq=seq, attempt=1, finish_reason=FinishReason.LENGTH)


CAP = 0.2  # MAX_QUIET_POLL_S here, seconds


@pytest.fixture
def short_waits(monkeypatch):
    monkeypatch.setattr(stream_mod, "MAX_QUIET_POLL_S", CAP)


def test_quiet_waits_double_up_to_the_cap_and_an_event_brings_them_back(short_waits):
    """poll_s 0.01 s, 2 s quiet, an event, then the end in the log: reads at 0.01, 0.03,
    0.07, 0.15, 0.31, then every 0.2 s (13 in the quiet 2 s; 200 with no doubling, 7 with
    no cap), and the first wait after the event is 0.01 s again. A loaded box only makes
    the waits longer, so the bounds below allow for that on the side it pushes."""
    source = Source()
    event_at: list[float] = []

    async def run() -> list:
        got = []

        async def feed() -> None:
            await asyncio.sleep(2.0)
            event_at.append(time.monotonic())
            source.log = [token(0), finished(1)]
            source.subscriber.queue.put_nowait(encode(token(0)))

        feeding = asyncio.ensure_future(feed())
        async for ev in JobStream(source, "j1", tenant=None, timeout_s=None, poll_s=0.01, fallback=False).events():
            got.append(ev)
        await feeding
        return got

    got = asyncio.run(run())
    assert [ev.seq for ev in got] == [0, 1] and isinstance(got[-1], Finished)
    quiet = [t for t in source.reads if t < event_at[0]]
    gaps = [b - a for a, b in zip(quiet, quiet[1:])]
    assert 10 <= len(quiet) <= 20, gaps
    assert all(g >= w - 0.002 for g, w in zip(gaps, (0.01, 0.02, 0.04, 0.08, 0.16))), gaps  # doubling
    assert all(g >= CAP - 0.002 for g in gaps[5:]), gaps  # then the cap
    after = [t - event_at[0] for t in source.reads if t >= event_at[0]]
    assert after and after[0] < CAP * 0.6, after  # poll_s again (the cap would be 0.2 s)


def test_a_deadline_ends_a_quiet_wait_early():
    source = Source()

    async def run() -> float:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="did not finish within 0.2 s"):
            async for _ in JobStream(source, "j1", tenant=None, timeout_s=0.2, poll_s=30.0, fallback=False).events():
                pass
        return time.monotonic() - t0

    took = asyncio.run(run())
    assert 0.19 <= took < 1.0  # not the 30 s quiet wait


def test_a_live_channel_that_brings_nothing_while_the_log_grows_is_read_at_poll_s(monkeypatch):
    """A silently broken pub/sub connection (until the pool's health check notices): the
    log has events the live channel never brought, so the waits go back to poll_s and the
    events come out about as they are written, not a capped wait (0.4 s here) later."""
    monkeypatch.setattr(stream_mod, "MAX_QUIET_POLL_S", 0.4)
    source = Source()
    written: dict[int, float] = {}
    yielded: dict[int, float] = {}

    async def run() -> None:
        async def write() -> None:
            await asyncio.sleep(1.0)  # quiet long enough for the waits to reach the cap
            for seq in range(8):
                written[seq] = time.monotonic()
                source.log = source.log + [token(seq)]
                await asyncio.sleep(0.1)
            source.log = source.log + [finished(8)]

        writing = asyncio.ensure_future(write())
        async for ev in JobStream(source, "j1", tenant=None, timeout_s=None, poll_s=0.01, fallback=False).events():
            yielded[ev.seq] = time.monotonic()
        await writing

    asyncio.run(run())
    lags = sorted(yielded[s] - written[s] for s in range(1, 8))  # the first may wait out a capped wait
    assert lags[len(lags) // 2] < 0.15, lags  # no reset: a 0.4 s wait between reads, 0.2 s lag on average
