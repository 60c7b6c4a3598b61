"""The faults of a replicated Kafka and of Redis behind Sentinel, one job at a time:
a partition's leader killed in the middle of a job's stream, the group coordinator killed
during a rebalance, a Sentinel failover (to a replica that missed the last writes) during
a publish round. Each job still has exactly one outcome, in its log and in the results
topic, with seqs 0..n and nothing missing."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from schemas import keys
from schemas.params import SamplingParams
from schemas.wire import Finished, Started, Token
from tests.integration.conftest import worker_config
from tests.integration.helpers import committed_reaches_end, wait_group_members
from tests.integration.processes import spawn_worker, wait_started
from worker.client import InflightClient, text_of

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


def spawn(tmp_path, cluster, prefix, worker_id, step_s=0.02):
    cfg = worker_config((cluster.bootstrap, cluster.redis_url), prefix,
                        tuning={"max_running_requests": 8, "max_output_tokens": 2048, "max_total_tokens": 16384},
                        worker={"max_local_jobs": 12})
    proc, log = spawn_worker(tmp_path, cfg, worker_id, command=("tests.integration.null_worker",),
                             extra=("--step-delay", str(step_s)))
    return cfg, proc, log


async def wait_tokens(client, job_id: str, n: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sum(isinstance(e, Token) for e in await client.read_log(job_id)) >= n:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{job_id}: fewer than {n} tokens in {timeout_s} s")


async def outcomes(client, job_ids, timeout_s: float = 180) -> dict[str, Finished]:
    deadline = time.monotonic() + timeout_s
    found: dict = {}
    while len(found) < len(job_ids) and time.monotonic() < deadline:
        found = await client.lookup_results(list(job_ids))
        await asyncio.sleep(1)
    assert sorted(found) == sorted(job_ids), sorted(set(job_ids) - set(found))
    return found


def check_once(log: list, job_id: str, recorded: Finished, max_tokens: int) -> Finished:
    """Exactly one outcome: seqs 0..n, one terminal event (last), texts whole, the same as
    the results topic's record."""
    assert [e.seq for e in log] == list(range(len(log))), (job_id, [(type(e).__name__, e.seq) for e in log][:10])
    terminals = [e for e in log if isinstance(e, Finished)]
    assert len(terminals) == 1 and log[-1] is terminals[0], job_id
    fin = terminals[0]
    assert text_of(log) == fin.text and fin.usage.completion_tokens == max_tokens, job_id
    assert (recorded.seq, recorded.attempt, recorded.text) == (fin.seq, fin.attempt, fin.text), job_id
    return fin


def test_a_leader_killed_mid_stream_gives_one_outcome_and_one_commit(cluster, cluster_prefix, whole, tmp_path):
    cfg, proc, log = spawn(tmp_path, cluster, cluster_prefix, "lead-w")
    topic = keys.job_topic(cluster_prefix, "normal")

    async def main():
        await wait_started(log, proc)
        async with InflightClient(cluster.bootstrap, cluster.redis_url, topic_prefix=cluster_prefix,
                                  key_prefix=cluster_prefix) as client:
            await client.submit("x", params=SamplingParams(max_tokens=400, ignore_eos=True), job_id="lead-1")
            await wait_tokens(client, "lead-1", 20)
            (leader,) = (await cluster.leaders([topic])).keys()
            await asyncio.to_thread(cluster.kill, cluster.node_name(leader))  # the job partition's leader
            recorded = (await outcomes(client, ["lead-1"]))["lead-1"]
            events = await client.read_log("lead-1")
            committed = await committed_reaches_end(cluster.bootstrap, cfg.kafka.group_id, cluster_prefix, timeout=60)
            return recorded, events, committed

    recorded, events, committed = asyncio.run(main())
    fin = check_once(events, "lead-1", recorded, 400)
    assert fin.attempt == 1 and sum(isinstance(e, Started) for e in events) == 1  # never run twice
    assert all(c == e for c, e in committed.values()), committed  # its offset committed, once, past it
    assert "Traceback" not in log.read_text()


def test_the_coordinator_killed_during_a_rebalance_loses_and_doubles_nothing(cluster, cluster_prefix, whole,
                                                                              tmp_path):
    cfg, proc_a, log_a = spawn(tmp_path, cluster, cluster_prefix, "coord-a")
    lengths = {f"co-{i}": 60 + 20 * i for i in range(12)}

    async def main():
        await wait_started(log_a, proc_a)
        async with InflightClient(cluster.bootstrap, cluster.redis_url, topic_prefix=cluster_prefix,
                                  key_prefix=cluster_prefix) as client:
            for j, n in lengths.items():
                await client.submit(j, params=SamplingParams(max_tokens=n, ignore_eos=True), job_id=j,
                                    priority=("high", "normal", "low")[int(j[3:]) % 3])
            await wait_tokens(client, "co-0", 5)
            _, proc_b, log_b = spawn(tmp_path, cluster, cluster_prefix, "coord-b")  # a rebalance begins
            await wait_started(log_b, proc_b)
            coordinator = await cluster.coordinator(cfg.kafka.group_id)
            await asyncio.to_thread(cluster.kill, cluster.node_name(coordinator))
            await wait_group_members(cluster.bootstrap, cfg.kafka.group_id, 2, timeout=120)
            found = await outcomes(client, list(lengths))
            logs = {j: await client.read_log(j) for j in lengths}
            committed = await committed_reaches_end(cluster.bootstrap, cfg.kafka.group_id, cluster_prefix, timeout=60)
            return found, logs, committed, log_b

    found, logs, committed, log_b = asyncio.run(main())
    for j, n in lengths.items():
        fin = check_once(logs[j], j, found[j], n)
        attempts = [e.attempt for e in logs[j]]
        assert attempts == sorted(attempts) and fin.attempt == attempts[-1], (j, attempts)
    assert all(c == e for c, e in committed.values()), committed
    assert "Traceback" not in log_a.read_text() + log_b.read_text()


def test_a_sentinel_failover_during_a_publish_round_keeps_every_log_whole(cluster, cluster_prefix, whole, tmp_path):
    cfg, proc, log = spawn(tmp_path, cluster, cluster_prefix, "fail-w")
    lengths = {f"fo-{i}": 1500 for i in range(6)}  # 30 s each: they stream through the failover

    async def main():
        await wait_started(log, proc)
        async with InflightClient(cluster.bootstrap, cluster.redis_url, topic_prefix=cluster_prefix,
                                  key_prefix=cluster_prefix) as client:
            for j, n in lengths.items():
                await client.submit(j, params=SamplingParams(max_tokens=n, ignore_eos=True), job_id=j)
            await wait_tokens(client, "fo-5", 20)
            master = await asyncio.to_thread(cluster.redis_master)
            replica = "redis-replica" if master == "redis-master" else "redis-master"
            cluster.signal(replica, signal.SIGSTOP)  # the replica cannot reconnect ...
            await asyncio.to_thread(cluster.redis_cli, master, "CLIENT", "KILL", "TYPE", "replica")  # ... once cut off
            await asyncio.sleep(0.5)  # the worker's writes now are the master's alone
            await asyncio.to_thread(cluster.kill, master)
            cluster.signal(replica, signal.SIGCONT)
            promoted = await asyncio.to_thread(cluster.wait_failover, master)
            await asyncio.sleep(4)  # rounds on the new master
            mid = {j: await client.read_log(j) for j in lengths}  # live logs, before the end's rewrite
            found = await outcomes(client, list(lengths))
            logs = {j: await client.read_log(j) for j in lengths}
            return promoted, replica, mid, found, logs

    promoted, replica, mid, found, logs = asyncio.run(main())
    assert promoted == replica
    for j, events in mid.items():  # what a reader replaying a running job sees: nothing missing
        assert not any(isinstance(e, Finished) for e in events), j
        assert [e.seq for e in events] == list(range(len(events))), (j, [e.seq for e in events][-30:])
    for j, n in lengths.items():
        check_once(logs[j], j, found[j], n)
    text = log.read_text()
    assert "claims and logs restored" in text and "Traceback" not in text
