"""Kafka outages against a broker this module starts and stops as a process (its own
ports and state, never the shared dev stack): a transient broker error in any part of
the worker (intake, cancel listener, results and DLQ writes, readiness check) is ridden
out while held jobs keep streaming through Redis, even when Redis loses its data
meanwhile; only an outage longer than `kafka.outage_limit_s` stops a worker, cleanly
(exit 1, one line, no traceback, no unclosed client), and its jobs then finish
elsewhere with exactly one terminal event."""

from __future__ import annotations

import asyncio
import signal
import time

from schemas.params import SamplingParams
from schemas.wire import Finished, Restarted, Token
from tests.integration.conftest import worker_config
from tests.integration.helpers import (
    assert_well_formed,
    committed_reaches_end,
    create_and_see_topics,
    read_whole_log,
    recorded_outcomes,
    slow_null_engine,
    start_worker,
    stop_worker,
)
from tests.integration.processes import spawn_worker, wait_started
from worker.client import InflightClient, text_of


def stack_config(stack, prefix, **over):
    return worker_config((stack.bootstrap, stack.redis_url), prefix, **over)


async def num_tokens(client, job_ids) -> int:
    n = 0
    for j in job_ids:
        n += sum(len(e.token_ids) for e in await client.read_log(j) if isinstance(e, Token))
    return n


async def submit_and_stream(client, ids, params, min_tokens: int) -> None:
    """Submit every job, then wait until `min_tokens` of theirs are in Redis."""
    for j in ids:
        await client.submit(j, params=params, job_id=j)
    while await num_tokens(client, ids) < min_tokens:
        await asyncio.sleep(0.2)


def whole(log: list, job_id: str) -> Finished:
    fin = assert_well_formed(log, job_id)
    assert text_of(log) == fin.text
    return fin


def test_a_90_s_broker_outage_is_ridden_out_while_jobs_stream(own_stack, prefix):
    asyncio.run(create_and_see_topics(own_stack.bootstrap, prefix))
    cfg = stack_config(own_stack, prefix, kafka={"outage_limit_s": 150.0})
    ids = [f"k-{i}" for i in range(4)]
    params = SamplingParams(max_tokens=2000, ignore_eos=True)  # 0.05 s steps: ~100 s each

    async def main():
        w, task = await start_worker(cfg, slow_null_engine(0.05))
        async with InflightClient(own_stack.bootstrap, own_stack.redis_url, topic_prefix=prefix,
                                  key_prefix=prefix) as client:
            await submit_and_stream(client, ids, params, 40)
            own_stack.stop_kafka()
            t0 = time.monotonic()
            await asyncio.sleep(10)
            early = await num_tokens(client, ids)
            gauge_during = w.metrics.kafka_outage._value.get()
            await asyncio.sleep(20)
            own_stack.restart_redis_empty()  # and Redis loses its data meanwhile
            await asyncio.sleep(90 - (time.monotonic() - t0) - 5)
            late = await num_tokens(client, ids)
            alive_during = not task.done()
            await asyncio.sleep(max(0.0, 90 - (time.monotonic() - t0)))
            own_stack.up()  # the broker is back after 90 s
            finals = await asyncio.gather(*(client.result(j, 120) for j in ids))
            recorded = await recorded_outcomes(client, ids, timeout_s=60)
            committed = await committed_reaches_end(own_stack.bootstrap, cfg.kafka.group_id, prefix, timeout=60)
            gauge_after = w.metrics.kafka_outage._value.get()
            episodes = w.kafka_outage.num_episodes
            restores = w.publisher.num_restores
        await stop_worker(w, task)
        logs = {j: await read_whole_log(own_stack.redis_url, prefix, j) for j in ids}
        return early, late, alive_during, gauge_during, gauge_after, episodes, restores, finals, recorded, \
            committed, logs

    early, late, alive, gauge_during, gauge_after, episodes, restores, finals, recorded, committed, logs = \
        asyncio.run(main())
    assert alive and episodes >= 1 and gauge_during == 1 and gauge_after == 0
    assert late > early + 500, (early, late)  # the streams went on during the outage
    assert restores >= 1
    for j, fin in zip(ids, finals):
        assert fin.finish_reason == "length" and fin.usage.completion_tokens == 2000 and fin.attempt == 1
        assert whole(logs[j], j).seq == fin.seq and recorded[j].text == fin.text
    assert all(c == e for c, e in committed.values()), committed


def test_an_outage_past_kafka_outage_limit_s_stops_the_worker_cleanly(own_stack, prefix, tmp_path):
    asyncio.run(create_and_see_topics(own_stack.bootstrap, prefix))
    cfg = stack_config(own_stack, prefix, kafka={"outage_limit_s": 8.0})
    ids = [f"s-{i}" for i in range(3)]
    params = SamplingParams(max_tokens=1500, ignore_eos=True)  # 0.02 s steps: ~30 s each
    proc, log = spawn_worker(tmp_path, cfg, "worker-a", command=("tests.integration.null_worker",),
                             extra=("--step-delay", "0.02"))
    try:
        async def main():
            await wait_started(log, proc)
            async with InflightClient(own_stack.bootstrap, own_stack.redis_url, topic_prefix=prefix,
                                      key_prefix=prefix) as client:
                await submit_and_stream(client, ids, params, 30)
                own_stack.stop_kafka()
                t0 = time.monotonic()
                while proc.poll() is None and time.monotonic() - t0 < 60:
                    await asyncio.sleep(0.2)
                exit_s = time.monotonic() - t0
                code = proc.poll()
                await asyncio.sleep(max(0.0, 20 - (time.monotonic() - t0)))
                own_stack.up()  # back after 20 s: another worker finishes the jobs
                w, task = await start_worker(cfg, slow_null_engine(0.001))
                finals = await asyncio.gather(*(client.result(j, 120) for j in ids))
                await stop_worker(w, task)
            logs = {j: await read_whole_log(own_stack.redis_url, prefix, j) for j in ids}
            return exit_s, code, finals, logs

        exit_s, code, finals, logs = asyncio.run(main())
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    assert code == 1, text[-3000:]
    assert exit_s < 8.0 + 25.0, exit_s  # the limit, then a bounded close
    assert "Traceback" not in text and "Unclosed" not in text, text[-5000:]
    assert "kafka.outage_limit_s" in text and '"exit_code": 1' in text
    for j, fin in zip(ids, finals):
        assert fin.finish_reason == "length" and fin.usage.completion_tokens == 1500 and fin.attempt == 2
        evs = logs[j]
        assert whole(evs, j).seq == fin.seq and any(isinstance(e, Restarted) for e in evs)


def test_a_worker_started_while_the_broker_is_away_waits_for_it(own_stack, prefix):
    """Issue 50: a worker whose broker is away at start used to exit at once (its
    orchestrator restarting it in a loop); it now waits, not started and with
    `kafka_outage` at 1, and serves once the broker is back."""
    from worker.serve.worker import Worker

    asyncio.run(create_and_see_topics(own_stack.bootstrap, prefix))
    cfg = stack_config(own_stack, prefix, kafka={"outage_limit_s": 120.0})
    own_stack.stop_kafka()

    async def main():
        w = Worker(cfg, engine=slow_null_engine(0.0))
        task = asyncio.create_task(w.run(install_signals=False))
        try:
            await asyncio.sleep(12)
            waiting = not task.done() and not w.started.is_set()
            gauge = w.metrics.kafka_outage._value.get()
        finally:
            own_stack.up()
        deadline = time.monotonic() + 90
        while not (w.started.is_set() and w.intake.consumer.assignment()):
            assert not task.done() or task.result() is None, "the worker stopped"
            assert time.monotonic() < deadline, "the worker did not start once the broker was back"
            await asyncio.sleep(0.2)
        async with InflightClient(own_stack.bootstrap, own_stack.redis_url, topic_prefix=prefix,
                                  key_prefix=prefix) as client:
            jid = await client.submit("after the outage", params=SamplingParams(max_tokens=5, ignore_eos=True))
            fin = await client.result(jid, 60)
        episodes = w.kafka_outage.num_episodes
        await stop_worker(w, task)
        return waiting, gauge, fin, episodes

    waiting, gauge, fin, episodes = asyncio.run(main())
    assert waiting and gauge == 1 and episodes == 1
    assert fin.finish_reason == "length" and fin.usage.completion_tokens == 5


def test_a_submit_kafka_cannot_acknowledge_fails_in_bounded_time(own_stack, prefix):
    """The client's producer is idempotent, and aiokafka never gives such a record up: with
    the broker away, `submit` would wait for ever. It raises after `delivery_timeout_s`,
    saying that the record may still be written and a retry with the same job_id is safe."""
    import pytest
    from aiokafka.errors import KafkaTimeoutError

    asyncio.run(create_and_see_topics(own_stack.bootstrap, prefix))

    async def main():
        async with InflightClient(own_stack.bootstrap, own_stack.redis_url, topic_prefix=prefix, key_prefix=prefix,
                                  delivery_timeout_s=3.0) as client:
            await client.submit("before", params=SamplingParams(max_tokens=1), job_id="bt-1")
            own_stack.stop_kafka()
            try:
                t = time.monotonic()
                with pytest.raises(KafkaTimeoutError, match="same job_id"):
                    await client.submit("during", params=SamplingParams(max_tokens=1), job_id="bt-2")
                return time.monotonic() - t
            finally:
                own_stack.up()

    assert asyncio.run(main()) < 10
