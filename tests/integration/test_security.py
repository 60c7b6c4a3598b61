"""Secured transports and tenant isolation, on the real secured stack of
`tools/stack/devstack.sh up --secure` (Kafka SASL_SSL / mTLS / SASL_PLAINTEXT with
StandardAuthorizer ACLs, TLS-only Redis with client certificates and ACL users)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid

import msgspec
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import GroupAuthorizationFailedError, TopicAuthorizationFailedError
from redis.exceptions import NoPermissionError

from schemas import keys
from schemas.codec import decode_event, encode
from schemas.params import SamplingParams
from schemas.wire import DLQ_HEADER_JOB_ID, DLQ_HEADER_REASON, Finished, Started, Token
from tests.integration.conftest import ROOT, secure_worker_config
from tests.integration.helpers import (
    assert_well_formed,
    collect,
    committed_reaches_end,
    finished_within,
    recorded_outcomes,
    start_worker,
    stop_worker,
)
from tests.integration.processes import spawn
from worker.client import InflightClient
from worker.engine import Engine
from worker.security.access import EXIT_AUTHENTICATION, EXIT_AUTHORIZATION, EXIT_TLS, AccessError
from worker.security.kafka import kafka_security_kwargs
from worker.security.redis import redis_client


@pytest.fixture(scope="module")
def engine_factory(llama_path):
    def make(cfg):
        return Engine.from_pretrained(str(llama_path), cfg.engine)

    return make


async def dlq_records_since(stack, ends: dict, timeout_s: float = 20.0) -> list:
    """Records appended to the DLQ after `ends` (end offsets taken before), read as the
    admin principal (super user; workers and producers may not read the DLQ)."""
    kafka, _ = stack.sections("admin", "scram-sha-512")
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka.bootstrap_servers, group_id=None, enable_auto_commit=False,
                                **kafka_security_kwargs(kafka))
    await consumer.start()
    try:
        consumer.assign(list(ends))
        for tp, off in ends.items():
            consumer.seek(tp, off)
        out: list = []
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not out and asyncio.get_running_loop().time() < deadline:
            for recs in (await consumer.getmany(timeout_ms=500)).values():
                out.extend(recs)
        return out
    finally:
        await consumer.stop()


async def dlq_ends(stack) -> dict:
    kafka, _ = stack.sections("admin", "scram-sha-512")
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka.bootstrap_servers, group_id=None,
                                **kafka_security_kwargs(kafka))
    await consumer.start()
    try:
        topic = keys.dlq_topic(stack.prefix)
        tps = [TopicPartition(topic, p) for p in range(3)]
        return await consumer.end_offsets(tps)
    finally:
        await consumer.stop()


@pytest.mark.parametrize("worker_mode,client_mode", [("scram-sha-512", "scram-sha-256"), ("mtls", "mtls")],
                         ids=["sasl_ssl-scram", "mtls"])
def test_main_job_end_to_end_on_the_secured_stack(secure_stack, engine_factory, worker_mode, client_mode):
    """Produce, stream, cancel and dead-letter over SASL_SSL/SCRAM or mutual TLS to Kafka
    and TLS + ACL users to Redis; the worker as `inflight-worker`, the client as
    `inflight-producer` (Redis user `inflight-client`), a tenant's job read by that
    tenant's reader user; that tenant has fleet-wide limits, whose script runs as the
    worker's ACL user."""
    from worker.config import TenantPolicy
    from worker.serve.fleet_quota import bucket_key

    stack = secure_stack
    fleet = {"tenant-a": TenantPolicy(fleet_tokens_per_s=100_000, fleet_max_running=4)}
    cfg = secure_worker_config(stack, worker_mode, tuning={"max_output_tokens": 1000, "tenants": fleet})
    engine = engine_factory(cfg)
    run = uuid.uuid4().hex[:8]
    kafka, redis = stack.sections("producer", client_mode)
    admin_kafka = stack.sections("admin", "scram-sha-512")[0]

    async def main():
        ends = await dlq_ends(stack)
        w, task = await start_worker(cfg, engine)
        try:
            async with InflightClient(kafka=kafka, redis=redis) as client:
                params = [SamplingParams(temperature=0, max_tokens=2 + 3 * i) for i in range(6)]
                ids = [await client.submit(f"Job {i}: the module", params=sp, job_id=f"{run}-{i}",
                                           priority=("high", "normal", "low")[i % 3]) for i, sp in enumerate(params)]
                results = await asyncio.gather(*(collect(client, j, 90) for j in ids))

                # a tenant's job, followed live by that tenant's reader (read-only Redis user)
                tj = await client.submit("A tenant's job", params=SamplingParams(temperature=0, max_tokens=5),
                                         job_id=f"{run}-ta", tenant="tenant-a")
                async with InflightClient(kafka=kafka, redis=stack.reader("tenant-a")) as reader:
                    tenant_events = [ev async for ev in reader.stream(tj, tenant="tenant-a", timeout_s=90)]
                admin_redis = redis_client(stack.sections("admin", "scram-sha-512")[1])
                try:  # the fleet limits' rounds ran as the worker's ACL user (the job waited for its lease)
                    quota_synced = await admin_redis.exists(bucket_key(cfg.redis.key_prefix, "tenant-a")) == 1
                finally:
                    await admin_redis.aclose()

                # cancel mid-stream
                long = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)  # outlasts the cancel's trip
                cj = await client.submit("Cancel me", params=long, job_id=f"{run}-cancel")
                cancelled = []
                async for ev in client.stream(cj, timeout_s=90):
                    cancelled.append(ev)
                    if isinstance(ev, Token) and len(cancelled) == 3:
                        await client.cancel(cj)

                # a poison record: DLQ (+ finished(rejected) on its stream)
                producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap_servers, **kafka_security_kwargs(kafka))
                await producer.start()
                try:
                    await producer.send_and_wait(keys.job_topic(stack.prefix, "normal"),
                                                 b'{"job_id": "%s-poison", "prompt": 7}' % run.encode(),
                                                 key=f"{run}-poison".encode())
                finally:
                    await producer.stop()
                poison = await collect(client, f"{run}-poison", 60)
                dead = await dlq_records_since(stack, ends)

                # the durable outcomes, read back by the producer principal (Read on results)
                recorded = await recorded_outcomes(client, ids + [cj])

                # the CLI with a tenant client's config (producer over mTLS, tenant-a's reader user)
                cli = await asyncio.to_thread(subprocess.run, [
                    sys.executable, "-m", "worker", "submit", "--config",
                    str(stack.configs / "inflight-reader-tenant-a.yaml"), "--tenant", "tenant-a", "--prompt", "From the CLI",
                    "--max-tokens", "4", "--job-id", f"{run}-cli", "--stream", "--timeout", "60"],
                    capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
                ready = w.health.readiness()
            committed = await committed_reaches_end(admin_kafka.bootstrap_servers, stack.group_id, stack.prefix,
                                                    security=kafka_security_kwargs(admin_kafka), timeout=30)
        finally:
            await stop_worker(w, task)
        return ids, results, tj, tenant_events, cj, cancelled, poison, dead, recorded, committed, cli, ready, quota_synced

    (ids, results, tj, tenant_events, cj, cancelled, poison, dead, recorded, committed, cli, ready,
     quota_synced) = asyncio.run(main())
    assert quota_synced
    for jid, events in zip(ids, results):
        fin = assert_well_formed(events, jid)
        assert isinstance(events[0], Started) and fin.finish_reason in ("stop", "length")
        assert fin.text == "".join(e.text for e in events if isinstance(e, Token))
        assert recorded[jid].finish_reason == fin.finish_reason and recorded[jid].text == fin.text
    assert assert_well_formed(tenant_events, tj).finish_reason in ("stop", "length")
    fin = assert_well_formed(cancelled, cj)
    assert fin.finish_reason == "cancelled" and fin.usage.completion_tokens < 1000
    assert recorded[cj].finish_reason == "cancelled"
    assert poison[-1].finish_reason == "rejected" and poison[-1].error.code == "invalid_job"
    mine = [r for r in dead if dict(r.headers).get(DLQ_HEADER_JOB_ID) == f"{run}-poison".encode()]
    assert len(mine) == 1 and dict(mine[0].headers)[DLQ_HEADER_REASON] == b"invalid_job"
    assert mine[0].value == b'{"job_id": "%s-poison", "prompt": 7}' % run.encode()
    assert all(c == e for c, e in committed.values()), committed
    assert cli.returncode == 0 and f"[job {run}-cli]" in cli.stderr and "[finished: length" in cli.stderr, cli
    assert f"{run}-cli" not in cli.stdout, cli  # streamed: stdout is the text alone
    assert ready[0] is True, ready  # /readyz: Kafka and Redis checks pass over the secured connections


@pytest.mark.parametrize("mode", ["plain", "scram-sha-256", "scram-sha-512", "sasl-plaintext", "mtls"])
def test_client_connects_in_every_mode(secure_stack, mode):
    """InflightClient in each security mode: SASL_SSL with PLAIN / SCRAM-SHA-256 /
    SCRAM-SHA-512, SASL_PLAINTEXT (SCRAM-SHA-512), SSL with a client certificate; Redis
    over TLS with its client certificate and ACL user (tombstone written, log read)."""
    kafka, redis = secure_stack.sections("producer", mode)
    job_id = f"probe-{mode}-{uuid.uuid4().hex[:8]}"

    async def main():
        async with InflightClient(kafka=kafka, redis=redis) as client:
            await client.cancel(job_id)  # Kafka write (cancel topic) + Redis SET (tombstone)
            assert await client.read_log(job_id) == []
        async with redis_client(secure_stack.sections("admin", "mtls")[1]) as admin:
            return await admin.exists(keys.cancelled_key(job_id, secure_stack.prefix))

    assert asyncio.run(main()) == 1


def test_topic_creation_and_preflight_on_the_secured_stack(secure_stack):
    """`inflight topics create` as the admin principal (mTLS), and `inflight check`'s
    network checks as the worker principal (SCRAM): every one passes."""
    from worker.cli.preflight import kafka_checks, redis_checks

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "worker", "topics", "create", "--config",
                          str(secure_stack.config_path("admin", "mtls")), "--partitions", "3"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and "nothing (all exist)" in out.stdout, out.stderr
    cfg = secure_worker_config(secure_stack, "scram-sha-512")

    async def checks():
        return await kafka_checks(cfg, 10.0) + await redis_checks(cfg, 10.0)

    got = {c.name: c for c in asyncio.run(checks())}
    assert [got[n].status for n in ("kafka", "topics", "consumer group", "redis")] == ["pass"] * 4, got
    assert "unknown (CONFIG GET not allowed" in got["redis persistence"].detail  # the worker user may not CONFIG

    # refused: each failing check names the setting to fix, not just the address
    cfg = msgspec.structs.replace(cfg, kafka=msgspec.structs.replace(cfg.kafka, sasl_password="Wr0ng-Pa55word",
                                                                     sasl_password_file=None),
                                  redis=msgspec.structs.replace(cfg.redis, ssl_cafile=str(secure_stack.certs /
                                                                                          "rogue-ca.pem")))
    got = {c.name: c for c in asyncio.run(checks())}
    assert (got["kafka"].status, got["kafka"].setting) == (
        "fail", "kafka.sasl_username and kafka.sasl_password / kafka.sasl_password_file"), got["kafka"]
    assert (got["redis"].status, got["redis"].setting) == ("fail", "redis.ssl_cafile"), got["redis"]
    assert "Wr0ng-Pa55word" not in got["kafka"].detail


FAILURES = {
    # case: (config principal-mode, env overrides, exit code, words of the one error line)
    "kafka wrong password": ("worker-scram-sha-512", {"INFLIGHT_KAFKA__SASL_PASSWORD_FILE": "",
                                                      "INFLIGHT_KAFKA__SASL_PASSWORD": "Wr0ng-Pa55word"},
                             EXIT_AUTHENTICATION, ["refused the credentials", "kafka.sasl_password"]),
    "kafka unknown user": ("worker-scram-sha-512", {"INFLIGHT_KAFKA__SASL_USERNAME": "nobody"},
                           EXIT_AUTHENTICATION, ["User:nobody", "kafka.sasl_username"]),
    "kafka wrong CA": ("worker-scram-sha-512", {"INFLIGHT_KAFKA__SSL_CAFILE": "{certs}/rogue-ca.pem"},
                       EXIT_TLS, ["not trusted", "kafka.ssl_cafile"]),
    "kafka untrusted client cert": ("worker-mtls", {"INFLIGHT_KAFKA__SSL_CERTFILE": "{certs}/rogue-worker.pem",
                                                    "INFLIGHT_KAFKA__SSL_KEYFILE": "{certs}/rogue-worker.key",
                                                    "INFLIGHT_KAFKA__SSL_KEY_PASSWORD_FILE": ""},
                                    EXIT_TLS, ["rejected the client certificate", "kafka.ssl_certfile"]),
    "kafka missing ACL": ("noacl-scram-sha-512", {"INFLIGHT_REDIS__USERNAME": "inflight-worker",
                                                  "INFLIGHT_REDIS__PASSWORD_FILE":
                                                      "{secrets}/inflight-worker.redis-password"},
                          EXIT_AUTHORIZATION, ["User:inflight-noacl", "may not use topics", "inflight acl kafka"]),
    "kafka group not granted": ("worker-scram-sha-512", {"INFLIGHT_KAFKA__GROUP_ID": "not-granted"},
                                EXIT_AUTHORIZATION, ["consumer group 'not-granted'", "kafka.group_id"]),
    "redis wrong password": ("worker-mtls", {"INFLIGHT_REDIS__PASSWORD_FILE": "",
                                             "INFLIGHT_REDIS__PASSWORD": "Wr0ng-Pa55word"},
                             EXIT_AUTHENTICATION, ["refused user 'inflight-worker'", "redis.password"]),
    "redis wrong CA": ("worker-mtls", {"INFLIGHT_REDIS__SSL_CAFILE": "{certs}/rogue-ca.pem"},
                       EXIT_TLS, ["not trusted", "redis.ssl_cafile"]),
    "redis missing ACL": ("worker-mtls", {"INFLIGHT_REDIS__USERNAME": "inflight-reader-tenant-a",
                                          "INFLIGHT_REDIS__PASSWORD_FILE":
                                              "{secrets}/inflight-reader-tenant-a.redis-password"},
                          EXIT_AUTHORIZATION, ["inflight-reader-tenant-a", "no permissions", "redis.username"]),
}


def test_refused_credentials_certificates_and_acls_exit_with_one_line(secure_stack, llama_path):
    """`inflight worker` against each misconfiguration: the documented exit code, exactly
    one error line naming the cause and the setting, no traceback, and no secret (the
    right ones or the wrong one) anywhere in its output."""
    stack = secure_stack
    secrets = [p.read_text().strip() for p in stack.secrets.iterdir()] + ["Wr0ng-Pa55word"]
    procs = {}
    for case, (config, env_over, _, _) in FAILURES.items():
        principal, _, mode = config.partition("-")
        env = {k: v for k, v in os.environ.items() if not k.startswith("INFLIGHT_")}
        env.update({k: v.format(certs=stack.certs, secrets=stack.secrets) for k, v in env_over.items()},
                   PYTHONPATH=str(ROOT), INFLIGHT_MODEL__PATH=str(llama_path), INFLIGHT_METRICS__PORT="",
                   INFLIGHT_MODEL__COMPILE="off")
        procs[case] = spawn([sys.executable, "-m", "worker", "worker", "--config",
                             str(stack.config_path(principal, mode))], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for case, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        code, words = FAILURES[case][2], FAILURES[case][3]
        text = out + err
        assert proc.returncode == code, (case, proc.returncode, text[-2000:])
        assert "Traceback" not in text, (case, text[-2000:])
        for secret in secrets:
            assert secret not in text, (case, "a secret reached the output")
        errors = [json.loads(line) for line in err.splitlines() if line.startswith("{") and '"error"' in line]
        errors = [e for e in errors if e.get("level") == "error"]
        assert len(errors) == 1, (case, errors)
        line = errors[0]
        assert line["exit_code"] == code and line["event"].count("\n") == 0, (case, line)
        for word in words:
            assert word in line["event"], (case, word, line["event"])
        assert line["setting"] in line["event"]


def test_tenant_readers_see_only_their_own_streams(secure_stack):
    """Events of a tenant-a job and a tenant-b job (published with the worker's user as the
    worker does): tenant-a's reader subscribes to and XRANGEs its own job, and gets NOPERM
    on tenant-b's channel and log, on PSUBSCRIBE across tenants, on PUBLISH and on
    writes; the client's stream of tenant-b's job fails with exit code 5, not a hang."""
    stack = secure_stack
    p = stack.prefix
    a_job, b_job = f"iso-a-{uuid.uuid4().hex[:8]}", f"iso-b-{uuid.uuid4().hex[:8]}"
    ev = Finished(job_id=a_job, seq=0, attempt=1, finish_reason="stop", text="for a")
    worker_redis = stack.sections("worker", "mtls")[1]

    async def main():
        out: dict = {}
        async with redis_client(worker_redis) as w, redis_client(stack.reader("tenant-a")) as r:
            ps = r.pubsub()
            await ps.subscribe(keys.channel(a_job, p, "tenant-a"))
            assert (await ps.get_message(timeout=5))["type"] == "subscribe"
            await ps.psubscribe(keys.tenant_pattern("tenant-a", p))  # its own pattern: allowed
            assert (await ps.get_message(timeout=5))["type"] == "psubscribe"
            for jid, tenant, e in ((a_job, "tenant-a", ev), (b_job, "tenant-b", msgspec.structs.replace(
                    ev, job_id=b_job, text="for b"))):
                await w.xadd(keys.log_key(jid, p, tenant), {"e": encode(e), "q": 0})
                await w.publish(keys.channel(jid, p, tenant), encode(e))
            got = []
            for _ in range(20):
                msg = await ps.get_message(timeout=1)
                if msg and msg["type"] in ("message", "pmessage"):
                    got.append((msg["type"], decode_event(msg["data"]).job_id))
                if len(got) == 2:
                    break
            out["live"] = sorted(got)
            out["log"] = [decode_event(f[b"e"]).text for _, f in await r.xrange(keys.log_key(a_job, p, "tenant-a"))]
            denied = {
                "subscribe b": lambda: _subscribe(r, keys.channel(b_job, p, "tenant-b")),
                "xrange b": lambda: r.xrange(keys.log_key(b_job, p, "tenant-b")),
                "psubscribe all tenants": lambda: _subscribe(r, f"{p}:t:*", pattern=True),
                "psubscribe everything": lambda: _subscribe(r, f"{p}:*", pattern=True),
                "psubscribe b": lambda: _subscribe(r, keys.tenant_pattern("tenant-b", p), pattern=True),
                "subscribe untenanted": lambda: _subscribe(r, keys.channel(a_job, p)),
                "publish own channel": lambda: r.publish(keys.channel(a_job, p, "tenant-a"), b"x"),
                "write own log": lambda: r.xadd(keys.log_key(a_job, p, "tenant-a"), {"e": b"x"}),
                "read claim key": lambda: r.get(keys.claim_key(a_job, p)),
            }
            out["denied"] = {}
            for name, call in denied.items():
                try:
                    await call()
                    out["denied"][name] = "allowed"
                except NoPermissionError:
                    out["denied"][name] = "NOPERM"
            await ps.aclose()
        kafka, _ = stack.sections("producer", "mtls")
        async with InflightClient(kafka=kafka, redis=stack.reader("tenant-a")) as client:
            try:
                async for _ in client.stream(b_job, tenant="tenant-b", timeout_s=20):
                    pass
                out["client"] = "streamed"
            except AccessError as e:
                out["client"] = e.exit_code
            out["own"] = [e.text async for e in client.stream(a_job, tenant="tenant-a", timeout_s=20)]
        return out

    out = asyncio.run(main())
    assert out["live"] == [("message", a_job), ("pmessage", a_job)]
    assert out["log"] == ["for a"] and out["own"] == ["for a"]
    assert out["denied"] == dict.fromkeys(out["denied"], "NOPERM"), out["denied"]
    assert out["client"] == EXIT_AUTHORIZATION


async def _subscribe(r: aioredis.Redis, name: str, pattern: bool = False) -> None:
    """SUBSCRIBE / PSUBSCRIBE on a fresh pub/sub connection; the server's refusal comes
    back as the reply to it (NoPermissionError)."""
    ps = r.pubsub()
    try:
        await (ps.psubscribe(name) if pattern else ps.subscribe(name))
        await ps.get_message(timeout=5)
    finally:
        await ps.aclose()


def test_producer_principal_cannot_read_job_topics(secure_stack):
    """The producer principal writes jobs and cancels; it may not read the job topics (by
    assignment or through the workers' group), nor the DLQ."""
    kafka, _ = secure_stack.sections("producer", "scram-sha-512")
    security = kafka_security_kwargs(kafka)

    async def read(topic: str, group: str | None):
        consumer = AIOKafkaConsumer(bootstrap_servers=kafka.bootstrap_servers, group_id=group,
                                    enable_auto_commit=False, **security)
        await consumer.start()
        try:
            if group:
                consumer.subscribe([topic])
            else:
                consumer.assign([TopicPartition(topic, 0)])
            try:
                async with asyncio.timeout(20):
                    await consumer.getmany(timeout_ms=2000)
                return "read"
            except (TopicAuthorizationFailedError, GroupAuthorizationFailedError) as e:
                return type(e).__name__
        finally:
            await consumer.stop()

    async def visible(topics: list[str]) -> dict[str, int]:
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers, **security)
        await admin.start()
        try:
            return {t["topic"]: t["error_code"] for t in await admin.describe_topics(topics)}
        finally:
            await admin.close()

    async def main():
        p = secure_stack.prefix
        return {
            "jobs by assignment": await read(keys.job_topic(p, "high"), None),
            "jobs through the group": await read(keys.job_topic(p, "normal"), secure_stack.group_id),
            "results (allowed: the client's fallback)": await read(keys.results_topic(p), None),
        }, await visible([keys.dlq_topic(p), keys.job_topic(p, "low")])

    reads, seen = asyncio.run(main())
    assert reads == {"jobs by assignment": "TopicAuthorizationFailedError",
                     "jobs through the group": "GroupAuthorizationFailedError",
                     "results (allowed: the client's fallback)": "read"}
    p = secure_stack.prefix  # no Describe on the DLQ: not even visible; job topics visible (Write)
    assert seen == {keys.dlq_topic(p): TopicAuthorizationFailedError.errno, keys.job_topic(p, "low"): 0}


def test_open_plaintext_stack_stays_the_default(services):
    """Without settings every client speaks PLAINTEXT to the open dev stack (127.0.0.1:19092,
    redis://127.0.0.1:6390): a config with no security fields, and the client built from
    it, connect there."""
    from worker.config import KafkaConfig, RedisConfig, load_config

    cfg = load_config(None, env={})
    assert cfg.kafka == KafkaConfig() and cfg.kafka.security_protocol == "PLAINTEXT"
    assert cfg.kafka.bootstrap_servers == "127.0.0.1:19092" and cfg.redis.url == "redis://127.0.0.1:6390/0"
    assert cfg.redis == RedisConfig() and not cfg.redis.uses_tls
    assert kafka_security_kwargs(cfg.kafka) == {"security_protocol": "PLAINTEXT"}

    async def main():
        async with InflightClient(services[0], services[1]) as client:
            await client.cancel(f"open-{uuid.uuid4().hex[:8]}")
            return await client.redis.ping()

    assert asyncio.run(main()) is True


def test_pipeline_benchmark_runs_on_the_secured_stack(secure_stack, tmp_path):
    """tools/bench_pipeline with `--config` (the admin principal over mutual TLS: the
    benchmark creates its own topics): producer, worker subprocess and Redis reads all
    connect secured, and every job finishes."""
    from tools.bench import pipeline as bench_pipeline

    config = str(secure_stack.config_path("admin", "mtls"))
    assert bench_pipeline.main(["--config", config, "--device-ms", "0", "--output-lens", "4", "--running", "8",
                                "--jobs", "12", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_pipeline.json").read_text())
    assert report["kafka"] == secure_stack.manifest["kafka"]["ssl"] and report["redis"] == secure_stack.redis_url
    row = report["rows"][0]
    assert row["num_jobs"] == 12 and row["worker"]["tokens"] == 12 * 4, row


def test_redis_password_rotation_and_a_refusal_at_runtime(secure_stack, engine_factory):
    """The README's Redis rotation on a user of its own (`inflight acl redis worker`
    rules): a second password is added and works beside the first; removing the one the
    running worker uses (and dropping its connections) makes /readyz name the cause, and
    the next job makes the worker stop with AuthenticationError, explained as exit 3."""
    from worker.security.acl import redis_worker_rules
    from worker.security.probe import diagnose

    stack = secure_stack
    user, old_pw, new_pw = f"rotate-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex, uuid.uuid4().hex
    cfg = secure_worker_config(stack, "mtls", redis={"username": user, "password": old_pw, "password_file": None})
    engine = engine_factory(cfg)
    admin_redis = stack.sections("admin", "mtls")[1]
    kafka, redis = stack.sections("producer", "mtls")

    async def main():
        async with redis_client(admin_redis) as admin:
            await admin.execute_command("ACL", "SETUSER", user, "reset", "on", f">{old_pw}", *redis_worker_rules(p))
            try:
                w, task = await start_worker(cfg, engine)
                try:
                    await admin.execute_command("ACL", "SETUSER", user, f">{new_pw}")  # 1. add the new password
                    rotated = msgspec.structs.replace(cfg.redis, password=new_pw)
                    async with redis_client(rotated) as r:
                        both = await r.ping()
                    await asyncio.sleep(1.5)
                    ready_during = w.health.readiness()[0]
                    # 2. remove the old one before the worker got the new one: its connections are refused
                    await admin.execute_command("ACL", "SETUSER", user, f"<{old_pw}")
                    await admin.execute_command("CLIENT", "KILL", "USER", user)
                    for _ in range(40):
                        await asyncio.sleep(0.25)
                        ready, body = w.health.readiness()
                        if not ready:
                            break
                    async with InflightClient(kafka=kafka, redis=redis) as client:
                        await client.submit("after rotation", job_id=f"rot-{user}")
                    try:
                        await finished_within(task, 60, "the worker after its credentials were rotated away")
                        stopped = None
                    except Exception as e:  # the worker's crash, as Worker.run raises it
                        stopped = await diagnose(e, kafka=cfg.kafka, redis=cfg.redis)
                finally:
                    if not task.done():
                        await stop_worker(w, task)
                # the job is taken by the next worker run (it stays uncommitted): drop it here
                async with InflightClient(kafka=kafka, redis=redis) as client:
                    await client.cancel(f"rot-{user}")
            finally:
                await admin.execute_command("ACL", "DELUSER", user)
        return both, ready_during, ready, body, stopped

    p = stack.prefix
    both, ready_during, ready, body, stopped = asyncio.run(main())
    assert both is True and ready_during is True
    assert ready is False and "Redis authentication failed" in body["errors"]["redis"], body
    assert "redis.password" in body["errors"]["redis"] and old_pw not in json.dumps(body)
    assert stopped is not None and stopped.exit_code == EXIT_AUTHENTICATION, stopped
