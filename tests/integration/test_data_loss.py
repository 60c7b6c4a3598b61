"""Redis losing its data under a fleet of worker processes (issue 11's invariants, kept
when the loss comes with a kill -9 and a worker that stalls past its leases): every
job's log read from its first entry has seq 0..n-1, exactly one terminal event,
attempts that never go backwards, token texts that reassemble to `finished.text`, and
the same outcome as the durable results topic. And a job whose log Redis no longer has
(finished long before the loss) is still answered by `result()` from the results topic."""

from __future__ import annotations

import asyncio
import random
import signal
import time

from schemas.params import SamplingParams
from schemas.wire import Finished, Token
from tests.integration.conftest import worker_config
from tests.integration.helpers import (
    read_whole_log,
    slow_null_engine,
    start_worker,
    stop_worker,
    wait_group_members,
)
from tests.integration.processes import spawn_worker, wait_started
from worker.client import InflightClient, text_of


def check_whole(log: list, job_id: str, recorded: Finished) -> Finished:
    """The invariants of a job's log after data loss (module docstring)."""
    assert log, f"{job_id}: empty log"
    assert [e.seq for e in log] == list(range(len(log))), (job_id, [(type(e).__name__, e.seq) for e in log][:8])
    terminals = [e for e in log if isinstance(e, Finished)]
    assert len(terminals) == 1 and log[-1] is terminals[0], (job_id, [(e.seq, e.attempt) for e in terminals])
    attempts = [e.attempt for e in log]
    assert attempts == sorted(attempts), (job_id, attempts)
    fin = terminals[0]
    assert text_of(log) == fin.text, (job_id, len(text_of(log)), len(fin.text))
    assert sum(len(e.token_ids) for e in log if isinstance(e, Token) and e.attempt == fin.attempt) \
        == fin.usage.completion_tokens
    assert (recorded.seq, recorded.attempt, recorded.text) == (fin.seq, fin.attempt, fin.text), job_id
    return fin


def test_redis_losing_its_data_under_kill_9_and_a_hand_back_keeps_every_log_whole(
        services, prefix, own_redis, tmp_path):
    cfg = worker_config((services[0], own_redis.url), prefix, tuning={"max_running_requests": 8},
                        worker={"max_local_jobs": 12})
    rng = random.Random(25)
    lengths = {f"d-{i}": rng.randint(150, 400) for i in range(48)}
    command = ("tests.integration.null_worker",)
    procs = {w: spawn_worker(tmp_path, cfg, w, command=command, extra=("--step-delay", "0.01"))
             for w in ("worker-a", "worker-b", "worker-c")}
    try:
        async def produce(client):  # jobs keep arriving through every fault, as in production
            for j, n in lengths.items():
                await client.submit(j, params=SamplingParams(max_tokens=n, ignore_eos=True), job_id=j)
                await asyncio.sleep(0.25)

        async def main():
            await asyncio.gather(*(wait_started(log, p) for p, log in procs.values()))
            await wait_group_members(services[0], cfg.kafka.group_id, 3)
            async with InflightClient(services[0], own_redis.url, topic_prefix=prefix, key_prefix=prefix,
                                      results_fallback_s=2.0) as client:
                producer = asyncio.create_task(produce(client))
                await asyncio.sleep(3)  # every worker streams
                stalled = procs["worker-c"][0]
                stalled.send_signal(signal.SIGSTOP)  # past its leases and its session: its jobs move
                await asyncio.sleep(2)
                own_redis.stop(keep_data=False)
                await asyncio.sleep(1.5)
                own_redis.start()  # empty, while jobs stream and arrive
                await asyncio.sleep(8)
                stalled.send_signal(signal.SIGCONT)  # finds its claims taken: hands those jobs back
                await asyncio.sleep(2)
                procs["worker-a"][0].kill()  # kill -9 around it all
                await producer
                deadline = time.monotonic() + 240
                found = {}
                while len(found) < len(lengths) and time.monotonic() < deadline:
                    found = await client.lookup_results(list(lengths))
                    await asyncio.sleep(1)
            logs = {j: await read_whole_log(own_redis.url, prefix, j) for j in lengths}
            return found, logs

        found, logs = asyncio.run(main())
    finally:
        for p, _ in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()
    worker_logs = {w: log.read_text() for w, (_, log) in procs.items()}
    assert sorted(found) == sorted(lengths), sorted(set(lengths) - set(found))
    assert any("claims and logs restored" in text for text in worker_logs.values())
    for j, n in lengths.items():
        fin = check_whole(logs[j], j, found[j])
        assert fin.finish_reason == "length" and fin.usage.completion_tokens == n


def test_a_job_finished_long_before_a_loss_is_answered_by_the_results_topic(services, prefix, own_redis,
                                                                             monkeypatch):
    from worker.serve import history

    cfg = worker_config((services[0], own_redis.url), prefix)
    monkeypatch.setattr(history, "RECENT_MAX_AGE_S", 4.0)  # stands for "finished 3 minutes before the loss"

    async def main():
        w, task = await start_worker(cfg, slow_null_engine(0.0))
        async with InflightClient(services[0], own_redis.url, topic_prefix=prefix, key_prefix=prefix,
                                  results_fallback_s=1.0) as client:
            await client.submit("old", params=SamplingParams(max_tokens=5, ignore_eos=True), job_id="old")
            before = await client.result("old", 30)
            await asyncio.sleep(4.5)
            await client.submit("recent", params=SamplingParams(max_tokens=5, ignore_eos=True), job_id="recent")
            recent = await client.result("recent", 30)
            own_redis.stop(keep_data=False)
            own_redis.start()  # empty; the worker lives and restores what it still keeps
            deadline = time.monotonic() + 20
            while w.publisher.num_restores == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            old_log = await client.read_log("old")
            recent_log = await client.read_log("recent")
            after = await client.result("old", 30)
        await stop_worker(w, task)
        return before, recent, after, old_log, recent_log, w.publisher.num_restores

    before, recent, after, old_log, recent_log, restores = asyncio.run(main())
    assert restores >= 1
    assert old_log == [] and [e.seq for e in recent_log] == list(range(recent.seq + 1))
    assert (after.text, after.seq, after.finish_reason) == (before.text, before.seq, before.finish_reason)


def test_a_cancel_outlives_redis_losing_its_data(services, prefix, own_redis):
    cfg = worker_config((services[0], own_redis.url), prefix)

    async def main():
        async with InflightClient(services[0], own_redis.url, topic_prefix=prefix, key_prefix=prefix,
                                  results_fallback_s=60.0) as client:
            await client.submit("x", params=SamplingParams(max_tokens=50, ignore_eos=True), job_id="gone")
            await client.cancel("gone")  # acknowledged by Kafka (and the tombstone set) before any worker runs
            own_redis.stop(keep_data=False)
            own_redis.start()  # the tombstone is lost
            w, task = await start_worker(cfg, slow_null_engine(0.0))
            fin = await client.result("gone", 30)
            events = await client.read_log("gone")
            index = len(w.cancels._index), w.cancels.replay_s
        await stop_worker(w, task)
        return fin, events, index

    fin, events, (num_cancelled, replay_s) = asyncio.run(main())
    assert fin.finish_reason == "cancelled" and fin.usage.completion_tokens == 0
    assert [type(e).__name__ for e in events] == ["Finished"]  # no started, no token
    assert num_cancelled == 1 and replay_s is not None
