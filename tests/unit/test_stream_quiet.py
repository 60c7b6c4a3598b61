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


@pytest.fixture
def short_waits(monkeypatch):
    monkeypatch.setattr(stream_mod, "MAX_QUIET_POLL_S", 0.08)


def test_quiet_waits_double_up_to_the_cap_and_an_event_brings_them_back(short_waits):
    source = Source()

    async def run() -> tuple[list, list[float]]:
        got = []
        events = JobStream(source, "j1", tenant=None, timeout_s=None, poll_s=0.01, fallback=False).events()

        async def feed() -> None:
            await asyncio.sleep(0.5)  # quiet: the waits grow to the cap
            source.subscriber.queue.put_nowait(encode(token(0)))
            await asyncio.sleep(0.1)  # quiet again: from poll_s
            source.log = [token(0), finished(1)]

        feeding = asyncio.ensure_future(feed())
        async for ev in events:
            got.append(ev)
        await feeding
        return got, source.reads

    got, reads = asyncio.run(run())
    assert [ev.seq for ev in got] == [0, 1] and isinstance(got[-1], Finished)
    gaps = [b - a for a, b in zip(reads, reads[1:])]
    # before the event: 0.01, 0.02, 0.04, then 0.08 each (a read a second would be 50 in 0.5 s)
    quiet = [g for g, t in zip(gaps, reads[1:]) if t - reads[0] < 0.45]
    assert 5 <= len(quiet) <= 10, gaps
    assert max(quiet) < 0.08 + 0.05 and sorted(quiet[:3]) == quiet[:3], gaps
    # after the event the next quiet wait is poll_s again: the log (with the end) is read within ~0.1 s
    assert reads[-1] - reads[0] < 0.5 + 0.1 + 0.08 + 0.1


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
