"""Worker faults found by outside clients and operators, each as a regression test on the
real dev stack: dead letters for every record that never runs, oversized input refused
before tokenization, priority when slots free, lag after retention deleted records, job
ids on engine-thread log lines, and jobs that break the forward or kill their workers."""

from __future__ import annotations

import asyncio
import io
import json
import signal
import subprocess
import time

import pytest
import torch
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete

from schemas import keys
from schemas.params import SamplingParams
from schemas.wire import DLQ_HEADER_ERROR, DLQ_HEADER_REASON
from tests.integration.conftest import worker_config
from tests.integration.helpers import (
    assert_well_formed,
    collect,
    recorded_outcomes,
    slow_null_engine,
    start_worker,
    stop_worker,
    wait_group_members,
    wait_until,
)
from worker.client import InflightClient
from worker.engine import Engine
from worker.obs.log import setup_logging
from worker.serve.input_size import prompt_byte_limit


async def read_dlq(bootstrap: str, prefix: str, n: int, timeout: float = 30.0) -> list:
    c = AIOKafkaConsumer(keys.dlq_topic(prefix), bootstrap_servers=bootstrap, group_id=None,
                         auto_offset_reset="earliest", max_partition_fetch_bytes=32 * 1024 * 1024,
                         fetch_max_bytes=64 * 1024 * 1024)
    await c.start()
    out = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < n and time.monotonic() < deadline:
            batch = await c.getmany(timeout_ms=300)
            out.extend(r for rs in batch.values() for r in rs)
    finally:
        await c.stop()
    return out


@pytest.mark.timing
def test_every_record_that_never_runs_is_a_dead_letter_and_big_input_never_blocks_intake(
        services, prefix, llama_path):
    cfg = worker_config(services, prefix)
    engine = Engine.from_pretrained(str(llama_path), cfg.engine)
    limit = prompt_byte_limit(engine.tokenizer, engine.tuning.max_input_tokens)  # the limit in force
    topic = keys.job_topic(prefix, "normal")
    bad = {  # job id -> (record value, expected reason)
        "empty": (b'{"v":1,"job_id":"empty","prompt":""}', "empty_prompt"),
        "vocab": (b'{"v":1,"job_id":"vocab","prompt_token_ids":[5, 600, 7]}', "invalid_prompt"),
        "huge": (json.dumps({"v": 1, "job_id": "huge", "prompt": "x" * (5 * 1024 * 1024)}).encode(),
                 "prompt_too_long"),
        "big": (json.dumps({"v": 1, "job_id": "big", "prompt": "the quick brown fox. " * (limit // 24)}).encode(),
                "prompt_too_long"),  # under the byte bound: tokenized (off the loop), then too long
        "params": (b'{"v":1,"job_id":"params","prompt":"x","params":{"max_tokens":100000}}', "invalid_params"),
        "null": (None, "invalid_job"),  # a null value (a tombstone produced by mistake): kept null, key kept
    }

    async def main():
        w, task = await start_worker(cfg, engine)
        producer = AIOKafkaProducer(bootstrap_servers=services[0], max_request_size=16 * 1024 * 1024)
        await producer.start()
        for jid in ("huge", "big", "empty", "vocab", "params", "null"):
            await producer.send_and_wait(topic, bad[jid][0], key=jid.encode(), partition=0)
        good = [f"good-{i}" for i in range(3)]
        for jid in good:  # right behind the oversized ones, same partition
            job = {"v": 1, "job_id": jid, "prompt": "a small job", "params": {"max_tokens": 3, "temperature": 0}}
            await producer.send_and_wait(topic, json.dumps(job).encode(), key=jid.encode(), partition=0)
        await producer.stop()
        async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            results = {j: await collect(client, j, 60) for j in [*bad, *good]}
        dead = await read_dlq(services[0], prefix, len(bad))
        await stop_worker(w, task)
        return results, dead

    results, dead = asyncio.run(main())
    for jid, (_, reason) in bad.items():
        fin = assert_well_formed(results[jid], jid)
        assert len(results[jid]) == 1 and fin.finish_reason == "rejected" and fin.error.code == reason, (jid, fin)
    by_id = {r.key.decode(): r for r in dead}
    assert sorted(by_id) == sorted(bad)
    for jid, (value, reason) in bad.items():  # original bytes, reason countable from the DLQ alone
        assert by_id[jid].value == value
        assert dict(by_id[jid].headers)[DLQ_HEADER_REASON] == reason.encode()
    assert b"value is null" in dict(by_id["null"].headers)[DLQ_HEADER_ERROR]
    for jid in ("good-0", "good-1", "good-2"):
        fin = assert_well_formed(results[jid], jid)
        assert fin.finish_reason in ("stop", "length")
        assert fin.timings.ttft_s < 1.0, f"{jid} waited behind oversized input: TTFT {fin.timings.ttft_s:.2f} s"


def test_a_freed_slot_goes_to_high_priority_first(services, prefix):
    """Strictly: once the worker holds a high record, no low job takes a slot before every
    high job has one (the issue saw 2-8 low jobs jump ahead in 5 of 6 runs)."""
    cfg = worker_config(services, prefix, tuning={"max_running_requests": 2}, worker={"max_local_jobs": 4})
    engine = slow_null_engine(0.01, max_running_requests=2)
    params = SamplingParams(max_tokens=30, ignore_eos=True)

    async def main():
        w, task = await start_worker(cfg, engine)
        takes: list[tuple[float, list[str]]] = []  # every batch the intake hands over: (time, job ids)
        take = w.starter.take

        async def recording_take(records):
            takes.append((time.time(), [r.job.job_id for r in records]))
            return await take(records)

        w.starter.take = recording_take
        seen_high: list[float] = []

        async def watch():  # when the worker first holds a high record (buffered or claimed)
            while not seen_high:
                if w.intake.read_ahead.num_waiting("high") or any(j.priority == "high" for j in w.table):
                    seen_high.append(time.time())
                await asyncio.sleep(0.002)

        async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            low = [await client.submit(f"low {i}", params=params, job_id=f"low-{i}", priority="low")
                   for i in range(40)]
            await wait_until(lambda: any(j.priority == "low" for j in w.table), 30, "the worker holds low jobs")
            watcher = asyncio.create_task(watch())
            high = [await client.submit(f"high {i}", params=params, job_id=f"high-{i}", priority="high")
                    for i in range(4)]
            await watcher
            results = {j: await collect(client, j, 120) for j in high + low}
        await stop_worker(w, task)
        return low, high, results, seen_high[0], takes

    low, high, results, high_seen, takes = asyncio.run(main())
    for j, evs in results.items():
        assert assert_well_formed(evs, j).finish_reason == "length"
    pending_high = set(high)
    jumped = []
    for t, ids in takes:
        pending_high -= set(ids)
        if t >= high_seen and pending_high:
            jumped += [j for j in ids if j.startswith("low")]
    assert not pending_high and not jumped, f"low jobs took slots while high jobs waited: {jumped}"


def test_lag_and_commits_after_retention_deleted_records(services, prefix):
    """Committed 10, five more records deleted by retention (log start 15): lag 0, the
    group's committed offset moves to 15, and the stall watchdog leaves the consumer be.
    Same for an idle partition whose records were all deleted and that has no commit."""
    cfg = worker_config(services, prefix, kafka={"stall_timeout_s": 2.0})
    topic = keys.job_topic(prefix, "normal")
    tp0, tp1 = TopicPartition(topic, 0), TopicPartition(topic, 1)

    async def main():
        producer = AIOKafkaProducer(bootstrap_servers=services[0])
        await producer.start()
        job = json.dumps({"v": 1, "job_id": "old", "prompt": "x"}).encode()
        for _ in range(15):
            await producer.send_and_wait(topic, job, partition=0)
        for _ in range(3):
            await producer.send_and_wait(topic, job, partition=1)
        await producer.stop()
        group = AIOKafkaConsumer(bootstrap_servers=services[0], group_id=cfg.kafka.group_id, enable_auto_commit=False)
        await group.start()
        group.assign([tp0])
        await group.commit({tp0: 10})
        await group.stop()
        admin = AIOKafkaAdminClient(bootstrap_servers=services[0])
        await admin.start()
        await admin.delete_records({tp0: RecordsToDelete(before_offset=15), tp1: RecordsToDelete(before_offset=3)})
        w, task = await start_worker(cfg, slow_null_engine(0.0))
        await asyncio.sleep(3 * cfg.kafka.stall_timeout_s + 1)
        lag = {(tp.topic, tp.partition): v for tp, v in w.intake.lag(await w.intake.consumer.end_offsets([tp0, tp1])).items()}
        gauge = {k: w.metrics.consumer_lag.labels(topic, str(k[1]))._value.get() for k in lag}
        restarts = w.intake.num_consumer_restarts
        await stop_worker(w, task)
        committed = await admin.list_consumer_group_offsets(cfg.kafka.group_id)
        await admin.close()
        return lag, gauge, restarts, {tp.partition: committed[tp].offset for tp in (tp0, tp1) if tp in committed}

    lag, gauge, restarts, committed = asyncio.run(main())
    assert lag == {(topic, 0): 0, (topic, 1): 0} and set(gauge.values()) == {0}
    assert restarts == 0
    assert committed == {0: 15, 1: 3}


def test_engine_thread_log_lines_name_their_jobs(services, prefix, llama_path):
    cfg = worker_config(services, prefix, tuning={"max_oom_retries": 1})
    engine = Engine.from_pretrained(str(llama_path), cfg.engine)
    execute = engine.runner.execute
    calls = {"n": 0}

    def failing(sched):  # one out-of-memory once both jobs run
        calls["n"] += 1
        if calls["n"] == 6:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return execute(sched)

    engine.runner.execute = failing
    buf = io.StringIO()
    setup_logging("INFO", json=True, stream=buf)

    async def main():
        w, task = await start_worker(cfg, engine)
        async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
            ids = [await client.submit(f"job {i}", params=p, job_id=f"oom-{i}") for i in range(2)]
            results = [await collect(client, j) for j in ids]
        await stop_worker(w, task)
        return ids, results

    try:
        ids, results = asyncio.run(main())
    finally:
        setup_logging("INFO")
    lines = [json.loads(x) for x in buf.getvalue().splitlines() if x.startswith("{")]
    oom = [x for x in lines if x["event"].startswith("out of memory")]
    assert oom and oom[0]["level"] == "warning"
    assert set(oom[0]["job_ids"]) <= set(ids) and oom[0]["job_ids"] and oom[0]["num_jobs"] == len(oom[0]["job_ids"])
    for j, evs in zip(ids, results):
        assert assert_well_formed(evs, j).finish_reason == "length"


POISON_TOKEN = 511  # in no other job's prompt


def test_a_forward_that_always_fails_on_one_job_spares_the_rest(services, prefix, llama_path):
    cfg = worker_config(services, prefix)
    engine = Engine.from_pretrained(str(llama_path), cfg.engine)
    execute = engine.runner.execute

    def breaks_on_poison(sched):
        if any(POISON_TOKEN in s.token_ids for s in sched.scheduled):
            raise RuntimeError("kernel assertion failed (injected)")
        return execute(sched)

    engine.runner.execute = breaks_on_poison
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def main():
        w, task = await start_worker(cfg, engine)
        async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            ids = [await client.submit(prompt_token_ids=[5 + i, 6, 7], params=params, job_id=f"ok-{i}")
                   for i in range(6)]
            await client.submit(prompt_token_ids=[5, POISON_TOKEN, 7], params=params, job_id="bad")
            ids += [await client.submit(prompt_token_ids=[9, 6 + i, 7], params=params, job_id=f"after-{i}")
                    for i in range(3)]
            results = {j: await collect(client, j) for j in [*ids, "bad"]}
        alive = not task.done()
        await stop_worker(w, task)
        return ids, results, alive

    ids, results, alive = asyncio.run(main())
    assert alive
    fin = assert_well_formed(results["bad"], "bad")
    assert fin.finish_reason == "error" and fin.error.code == "internal" and "\n" not in fin.error.message
    for j in ids:
        fin = assert_well_formed(results[j], j)
        assert fin.finish_reason == "length" and fin.usage.completion_tokens == 12


def test_a_job_that_kills_its_workers_becomes_poison(services, prefix, llama_path, tmp_path):
    """The forward of one job kills the process (as a segfaulting kernel would). The first
    worker dies running it among other jobs; every job it held then runs alone on the
    next worker, where the poison job kills a second worker by itself; the third worker
    does not run it (`worker.max_job_failures` 2): `finished(error)`, code `poison`, the
    record to the DLQ. Every other job finishes exactly once; none is poisoned."""
    cfg = worker_config(services, prefix, model={"path": str(llama_path), "dtype": "float32", "device": "cpu"},
                        worker={"poison_grace_s": 3.0})  # the workers it killed never come back
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    from tests.integration.processes import spawn_worker

    procs = [spawn_worker(tmp_path, cfg, f"crash-{k}", ("tests.integration.crashing_worker",),
                          ("--crash-token", str(POISON_TOKEN))) for k in "abc"]
    try:
        async def main():
            from tests.integration.processes import wait_started

            await asyncio.gather(*(wait_started(log, p) for p, log in procs))
            await wait_group_members(services[0], cfg.kafka.group_id, 3)
            async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
                ids = [await client.submit(prompt_token_ids=[5 + i, 6, 7], params=params, job_id=f"j-{i}")
                       for i in range(10)]
                await client.submit(prompt_token_ids=[5, POISON_TOKEN, 7], params=params, job_id="poison")
                results = {j: await collect(client, j, 180) for j in [*ids, "poison"]}
            dead = await read_dlq(services[0], prefix, 1)
            return ids, results, dead

        ids, results, dead = asyncio.run(main())
    finally:
        codes = []
        for p, _ in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
            codes.append(p.wait())
    fin = assert_well_formed(results["poison"], "poison")
    assert fin.finish_reason == "error" and fin.error.code == "poison", fin
    assert [d.key for d in dead] == [b"poison"] and dict(dead[0].headers)[DLQ_HEADER_REASON] == b"poison"
    assert sorted(codes) == [0, 70, 70], f"exactly two workers died: exit codes {codes}"
    for j in ids:
        assert assert_well_formed(results[j], j).finish_reason == "length"


def test_a_job_killed_once_and_stalled_once_is_not_poison(services, prefix, tmp_path):
    """The soak's case: a job whose first attempt died with its worker (kill -9) runs alone
    on a second worker, which is then frozen (SIGSTOP) past its lease and its session. The
    third worker finds two failure marks, as it would after two deaths, but the second
    worker is alive: the third waits `worker.poison_grace_s` instead of calling the job
    poison, the second comes back (SIGCONT), takes its claim back and finishes the job.
    Exactly one outcome, `length`; no DLQ record. (Before: `finished(error)`, `poison`.)"""
    import redis.asyncio as aioredis

    from tests.integration.processes import spawn_worker, wait_for_starts, wait_started

    cfg = worker_config(services, prefix, worker={"poison_grace_s": 60.0})
    job = "stalled-once"
    command = ("tests.integration.null_worker",)

    async def main():
        r = aioredis.from_url(services[1])
        await r.set(keys.attempts_key(job, prefix), 1, ex=600)  # attempt 1 ran, and its worker died:
        await r.sadd(keys.failures_key(job, prefix), 1)  # its failure mark stayed
        await r.aclose()
        b, b_log = spawn_worker(tmp_path, cfg, "worker-b", command=command, extra=("--step-delay", "0.05"))
        await wait_started(b_log, b)
        async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            await client.submit("x", params=SamplingParams(max_tokens=300, ignore_eos=True), job_id=job)
            await wait_for_starts(client, [job], "worker-b", 1)
            b.send_signal(signal.SIGSTOP)  # frozen past its 3 s lease and 6 s session
            c, c_log = spawn_worker(tmp_path, cfg, "worker-c", command=command, extra=("--step-delay", "0.05"))
            deadline = time.monotonic() + 90
            while "reached its failure limit" not in c_log.read_text():
                assert time.monotonic() < deadline, c_log.read_text()[-3000:]
                assert c.poll() is None, c_log.read_text()[-3000:]
                await asyncio.sleep(0.2)
            b.send_signal(signal.SIGCONT)  # back: takes its claim back (the third gave it back) and goes on
            events = await collect(client, job, 120)
            dead = await read_dlq(services[0], prefix, 1, timeout=3.0)  # none expected: 3 s of looking
        return events, dead, c_log.read_text()

    events, dead, c_text = asyncio.run(main())
    fin = assert_well_formed(events, job)
    assert fin.finish_reason == "length" and fin.usage.completion_tokens == 300, fin
    assert "poison job not run again" not in c_text
    assert not [d for d in dead if d.key == job.encode()]


def test_a_done_job_whose_results_record_was_lost_gets_it_from_its_log(services, prefix):
    """A worker killed between publishing a job's terminal event (log entry + done mark,
    one script) and writing its results record left a job done in Redis with no durable
    outcome; the redelivered record was released as already done, so a batch waiting on
    the results topic stayed `in_progress` for ever (2 of 48 lines in a run of
    test_a_batch_survives_kill_9_of_a_worker). The redelivery now writes the terminal
    event found in the log to the results topic before its offset is done."""
    from redis.asyncio import Redis

    from schemas.codec import encode
    from schemas.wire import Finished, Token
    from tests.integration.helpers import committed_reaches_end

    cfg = worker_config(services, prefix)
    engine = slow_null_engine(0.001)

    async def main():
        r = Redis.from_url(services[1])
        log_key = keys.log_key("lost-1", prefix)
        await r.xadd(log_key, {"e": encode(Token(job_id="lost-1", seq=2, attempt=1, text="ab", token_ids=[1])),
                               "q": 2})
        fin = Finished(job_id="lost-1", seq=3, attempt=1, finish_reason="length", text="abc")
        await r.xadd(log_key, {"e": encode(fin), "q": 3})
        await r.set(keys.done_key("lost-1", prefix), "length", ex=600)
        await r.aclose()
        async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            await client.submit("x", job_id="lost-1", params=SamplingParams(max_tokens=5))  # the redelivered record
            await client.submit("y", job_id="fresh-1", params=SamplingParams(max_tokens=3, ignore_eos=True))
            w, task = await start_worker(cfg, engine)
            try:
                fresh = await collect(client, "fresh-1", 60)
                found = await recorded_outcomes(client, ["lost-1", "fresh-1"], timeout_s=60)
                committed = await committed_reaches_end(services[0], cfg.kafka.group_id, prefix)
            finally:
                await stop_worker(w, task)
        return fresh, found, committed, w

    fresh, found, committed, w = asyncio.run(main())
    assert assert_well_formed(fresh, "fresh-1").finish_reason == "length"
    assert found["lost-1"].finish_reason == "length" and found["lost-1"].text == "abc"  # from the log, not re-run
    assert w.finalizer.num_settled == 1 and w.finalizer.num_finished == 1  # lost-1 never ran again
    assert all(c == e for c, e in committed.values()), committed
