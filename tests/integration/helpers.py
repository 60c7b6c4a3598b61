"""Shared helpers for the integration tests."""

from __future__ import annotations

import asyncio
import contextlib
import time

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from schemas import keys
from schemas.wire import Finished, Started
from worker.client import InflightClient, last_attempt_tokens
from worker.obs.stacks import task_stacks
from worker.security.kafka import partition_ids
from worker.serve.worker import Worker

# How long a test waits for a worker to start (its engine built, its partitions assigned),
# in-process or spawned. A start takes 5-10 s on an idle 2-core box and has taken over
# 60 s there while the suite's other pytest-xdist workers load models too (a worker
# without an `engine` spawns an engine process that imports torch and transformers and
# loads the checkpoint): the bound is for a start that never ends, not a measure of its
# speed, and one value serves every start a test waits for.
START_S = 180.0


async def start_worker(cfg, engine, timeout: float = START_S) -> tuple[Worker, asyncio.Task]:
    """Run a Worker in this loop; return once it owns partitions (TimeoutError after
    `timeout` seconds, saying how far the start got)."""
    w = Worker(cfg, engine=engine)
    task = asyncio.create_task(w.run(install_signals=False))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if task.done():
            task.result()
        if w.started.is_set() and w.intake.consumer.assignment():
            return w, task
        await asyncio.sleep(0.1)
    stage = "no partitions assigned" if w.started.is_set() else "not started (engine or connections)"
    raise TimeoutError(f"worker {w.worker_id} did not start within {timeout:g} s: {stage}")


async def stop_worker(w: Worker, task: asyncio.Task) -> None:
    w.request_stop()
    await finished_within(task, 60, f"worker {w.worker_id}'s stop")


async def finished_within(task: asyncio.Task, timeout_s: float, what: str):
    """`task`'s result (its exception raised) once it is done; after `timeout_s` seconds,
    every task's await chain printed and TimeoutError naming `what`, the task left as it
    is. Bounded whatever the task does with a cancellation (`asyncio.wait`; Python 3.11's
    `wait_for` waits for a cancelled task to finish, so a stop that never returns hung it)."""
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        dump_tasks()
        raise TimeoutError(f"{what} did not end within {timeout_s} s")
    return task.result()


@contextlib.asynccontextmanager
async def running_worker(cfg, engine=None, **kw):
    """`async with running_worker(cfg, engine) as w:` — a started worker that is always
    stopped (drained, closed) when the block ends, whether the test passed or not."""
    w, task = await start_worker(cfg, engine, **kw)
    try:
        yield w
    finally:
        if not task.done():
            await stop_worker(w, task)


async def collect(client: InflightClient, job_id: str, timeout: float = 120.0, tenant: str | None = None) -> list:
    try:
        return [ev async for ev in client.stream(job_id, timeout_s=timeout, tenant=tenant)]
    except TimeoutError:
        dump_tasks()
        raise


async def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.05):
    """Poll `predicate()` (a function, or one returning an awaitable) every `interval_s`
    seconds until it returns something true, and return that; after `timeout_s` seconds,
    TimeoutError naming `what`. The way a test waits for a state instead of sleeping."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = predicate()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(interval_s)


def dump_tasks() -> None:
    """Print every asyncio task's await chain (to diagnose a hang)."""
    for name, frames in task_stacks().items():
        print("TASK", name, " <- ".join(frames))


def assert_well_formed(events: list, job_id: str) -> Finished:
    """seq 0..n-1 without gaps, exactly one terminal event and it is last."""
    assert [e.seq for e in events] == list(range(len(events))), [type(e).__name__ for e in events]
    finished = [e for e in events if isinstance(e, Finished)]
    assert len(finished) == 1 and events[-1] is finished[0], [type(e).__name__ for e in events]
    assert all(e.job_id == job_id for e in events)
    return finished[0]


def token_ids(events: list) -> list[int]:
    """Token ids of the last attempt."""
    return [i for t in last_attempt_tokens(events) for i in t.token_ids]


def kinds(events: list) -> list[str]:
    return [type(e).__name__ for e in events]


async def committed_reaches_end(bootstrap: str, group: str, prefix: str, timeout: float = 20.0,
                                security: dict | None = None, pool: str | None = None) -> dict:
    """Wait until the group's committed offsets equal the end offsets of every job
    partition (of `pool`'s topics; None: the default pool's); return the last
    {tp: (committed, end)} seen. `security`: aiokafka security kwargs (a principal
    allowed to describe the group and topics)."""
    topics = keys.job_topics(prefix, pool)
    probe = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, **(security or {}))
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **(security or {}))
    await probe.start()
    await admin.start()
    try:
        tps = [TopicPartition(t, p) for t in topics for p in sorted(await partitions_of(probe, t))]
        ends = await probe.end_offsets(tps)
        deadline = time.monotonic() + timeout
        state = {}
        while True:
            try:
                got = await admin.list_consumer_group_offsets(group)
            except KafkaError:  # the coordinator is down or moving: ask again
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
                continue
            state = {tp: (got[tp].offset if tp in got else 0, ends[tp]) for tp in tps}
            if all(c == e for c, e in state.values()) or time.monotonic() > deadline:
                return state
            await asyncio.sleep(0.3)
    finally:
        await probe.stop()
        await admin.close()


async def partitions_of(consumer: AIOKafkaConsumer, topic: str) -> set[int]:
    """The partition ids of `topic` (waiting for its metadata)."""
    for _ in range(50):
        parts = await partition_ids(consumer, topic)
        if parts:
            return parts
        await asyncio.sleep(0.1)
    raise RuntimeError(f"no partitions for {topic}")


def slow_null_engine(delay_s: float, **tuning):
    """A model-less engine whose steps take `delay_s` (jobs long enough to span an outage)."""
    from worker.config import EngineConfig, ServingTuning
    from worker.model.null_runner import NullRunner, null_engine

    class SlowRunner(NullRunner):
        def execute(self, sched):
            time.sleep(delay_s)
            return super().execute(sched)

    t = dict(max_total_tokens=16384, max_running_requests=8, max_output_tokens=2048)
    t.update(tuning)
    eng = null_engine(EngineConfig(serving_tuning=ServingTuning(**t)), vocab_size=100, max_model_len=4096)
    eng.runner = SlowRunner(100, avoid=frozenset({0}))
    return eng


async def recorded_outcomes(client, job_ids: list[str], timeout_s: float = 60.0) -> dict:
    """The results-topic records of `job_ids`, waited for until all are there or `timeout_s`
    passed (then what was found). A job's record is written by the finalizer after its
    terminal event reached Redis (and retried through a Kafka outage), so a lookup right
    after `result()` or a stream's end can run before the write."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = await client.lookup_results(list(job_ids), timeout_s=max(5.0, deadline - time.monotonic()))
        if len(found) == len(set(job_ids)) or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.25)


async def running_on(client, job_ids: list[str], worker_id: str, tenant: str | None = None,
                     timeout: float = 60.0) -> str:
    """Wait until one of `job_ids` runs on `worker_id` (its log's last `started` is that
    worker's and no terminal event follows); return that job's id. A test that kills a
    worker to see its jobs re-run elsewhere kills it after this: waiting for a count of
    started or completed jobs instead raced the CPU model, which may finish a worker's
    share of short jobs before the count is seen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for job_id in job_ids:
            evs = await client.read_log(job_id, tenant=tenant)
            started = [e for e in evs if isinstance(e, Started)]
            if started and started[-1].worker_id == worker_id and not any(isinstance(e, Finished) for e in evs):
                return job_id
        await asyncio.sleep(0.02)  # a round of reads per 20 ms, not a busy loop against the workers
    raise TimeoutError(f"no job ran on {worker_id} within {timeout} s")


async def read_whole_log(redis_url: str, prefix: str, job_id: str) -> list:
    """Every event of the job's log, from its first entry, decoded (a compacted run
    expanded into the events it stands for: `schemas.replay`)."""
    import redis.asyncio as aioredis

    from schemas.replay import entry_of, expand

    r = aioredis.from_url(redis_url)
    try:
        return [ev for _, f in await r.xrange(keys.log_key(job_id, prefix)) for ev in expand(entry_of(f))]
    finally:
        await r.aclose()


async def wait_group_members(bootstrap: str, group: str, n: int, timeout: float = 60.0) -> None:
    """Poll until the consumer group is Stable with `n` members (instead of sleeping). A
    coordinator that is down or moving (a broker killed) is asked again at the next poll."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                described = await admin.describe_consumer_groups([group])
            except KafkaError:
                described = []
            for desc in described:
                groups = getattr(desc, "groups", None) or []
                for g in groups:  # (error_code, group_id, state, protocol_type, protocol, members, ...)
                    if g[1] == group and g[2] == "Stable" and len(g[5]) == n:
                        return
            await asyncio.sleep(0.2)
        raise TimeoutError(f"group {group} did not reach {n} stable members in {timeout} s")
    finally:
        await admin.close()


async def create_and_see_topics(bootstrap: str, prefix: str) -> None:
    """Create the prefix's topics on a broker a test started (`own_stack`) and wait until
    its metadata shows them (a broker just started answers before it does)."""
    from worker.cli.topics import create_topics
    from worker.security.probe import _unusable_topics

    await create_topics(bootstrap, prefix, partitions=3)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        deadline = time.monotonic() + 30
        while True:
            _, missing = await _unusable_topics(admin, keys.all_topics(prefix), 5.0)
            if not missing or time.monotonic() > deadline:
                return
            await asyncio.sleep(0.3)
    finally:
        await admin.close()


async def read_topic(bootstrap: str, topic: str, decode, timeout_ms: int = 3000) -> list:
    """Every record of `topic` from its start that one fetch of up to `timeout_ms` returns,
    each passed through `decode` (e.g. `schemas.codec.decode_job`)."""
    c = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest")
    await c.start()
    try:
        got = await c.getmany(timeout_ms=timeout_ms)
        return [decode(r.value) for rs in got.values() for r in rs]
    finally:
        await c.stop()
