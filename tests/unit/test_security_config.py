"""Security settings without services: validation names the field, tenant ids and keys,
the ACL recipe, and how refused connections are explained (worker/security/access.py)."""

from __future__ import annotations

import ssl

import msgspec
import pytest
from aiokafka import errors as kerr
from redis import exceptions as rex

from schemas import keys
from schemas.codec import decode_job, json_schemas, recover_tenant
from schemas.wire import check_tenant
from worker.config import ConfigError, KafkaConfig, RedisConfig, load_config
from worker.obs.transient_log import TransientEpisodes, transient_kind
from worker.security import access, acl
from worker.security.kafka import kafka_security_kwargs


@pytest.mark.parametrize("env,field", [
    ({"SECURITY_PROTOCOL": "SASL_SSL", "SASL_USERNAME": "u", "SASL_PASSWORD": "p"}, "kafka.sasl_mechanism is required"),
    ({"SECURITY_PROTOCOL": "SASL_SSL", "SASL_MECHANISM": "GSSAPI", "SASL_USERNAME": "u", "SASL_PASSWORD": "p"},
     "kafka.sasl_mechanism must be one of"),
    ({"SECURITY_PROTOCOL": "SASL_PLAINTEXT", "SASL_MECHANISM": "PLAIN", "SASL_PASSWORD": "p"},
     "kafka.sasl_username is required"),
    ({"SECURITY_PROTOCOL": "SASL_SSL", "SASL_MECHANISM": "PLAIN", "SASL_USERNAME": "u"}, "kafka.sasl_password"),
    ({"SECURITY_PROTOCOL": "SASL_SSL", "SASL_MECHANISM": "PLAIN", "SASL_USERNAME": "u", "SASL_PASSWORD": "p",
      "SASL_PASSWORD_FILE": "/f"}, "kafka.sasl_password and kafka.sasl_password_file are both set"),
    ({"SASL_MECHANISM": "PLAIN"}, "kafka.sasl_mechanism is set but unused with security_protocol PLAINTEXT"),
    ({"SSL_CAFILE": "/ca.pem"}, "kafka.ssl_cafile is set but unused"),
    ({"SECURITY_PROTOCOL": "SSL", "SSL_KEYFILE": "/k.pem"}, "kafka.ssl_keyfile is set without kafka.ssl_certfile"),
    ({"SECURITY_PROTOCOL": "SSL", "SSL_KEY_PASSWORD": "x"}, "kafka.ssl_key_password is set without"),
])
def test_kafka_security_errors_name_the_field(env, field):
    with pytest.raises(ConfigError, match=field.replace("(", r"\(")):
        load_config(None, {f"INFLIGHT_KAFKA__{k}": v for k, v in env.items()})


@pytest.mark.parametrize("env,field", [
    ({"URL": "redis://r:6379/0", "SSL_CAFILE": "/ca"}, "redis.ssl_cafile is set but unused"),
    ({"URL": "rediss://u:pw@r:6379/0", "PASSWORD": "x"}, "redis.password / redis.password_file and a password"),
    ({"URL": "rediss://u@r:6379/0", "USERNAME": "v"}, "redis.username and a user name in redis.url"),
    ({"PASSWORD": "a", "PASSWORD_FILE": "/f"}, "redis.password and redis.password_file are both set"),
])
def test_redis_security_errors_name_the_field(env, field):
    with pytest.raises(ConfigError, match=field):
        load_config(None, {f"INFLIGHT_REDIS__{k}": v for k, v in env.items()})


def test_unreadable_secret_and_certificate_files_name_the_setting(tmp_path):
    k = KafkaConfig(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_username="u",
                    sasl_password_file=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=r"kafka.sasl_password_file: cannot read .*missing"):
        kafka_security_kwargs(k)
    k = KafkaConfig(security_protocol="SSL", ssl_certfile=str(tmp_path / "nope.pem"))
    with pytest.raises(ConfigError, match="kafka.ssl_certfile / ssl_keyfile: .*nope.pem.* does not exist"):
        kafka_security_kwargs(k)
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    with pytest.raises(ConfigError, match="kafka.ssl_cafile: cannot load CA certificates"):
        kafka_security_kwargs(KafkaConfig(security_protocol="SSL", ssl_cafile=str(bad)))
    ctx = kafka_security_kwargs(KafkaConfig(security_protocol="SSL"))["ssl_context"]
    assert ctx.check_hostname and ctx.verify_mode == ssl.CERT_REQUIRED


def test_tenant_ids_and_tenant_keys():
    assert keys.channel("j1", "p", "acme") == "p:t:acme:job:j1" and keys.log_key("j1", "p", "acme") == "p:t:acme:job:j1:log"
    assert keys.channel("j1", "p") == "p:job:j1" and keys.log_key("j1", "p", None) == "p:job:j1:log"
    assert keys.claim_key("j1", "p") == "p:job:j1:claim"  # worker-internal keys: no tenant segment
    assert keys.tenant_pattern("acme", "p") == "p:t:acme:job:*" and keys.tenant_pattern(None, "p") == "p:job:*"
    assert decode_job(b'{"job_id": "a", "prompt": "x", "tenant": "acme.eu-1"}').tenant == "acme.eu-1"
    for bad in ("a:b", "", "has space", "a*", "x" * 201):
        with pytest.raises(msgspec.ValidationError, match="tenant"):
            decode_job(b'{"job_id": "a", "prompt": "x", "tenant": %s}' % msgspec.json.encode(bad))
        with pytest.raises(ValueError, match="tenant must be"):
            check_tenant(bad)
    assert recover_tenant(b'{"job_id": "a", "prompt": 7, "tenant": "acme"}') == "acme"
    assert recover_tenant(b'{"job_id": "a", "tenant": "a:b"}') is None
    assert json_schemas()["$defs"]["Job"]["properties"]["tenant"]["anyOf"][0]["pattern"] == "^[A-Za-z0-9._@/+=-]+$"


def test_one_tenants_pattern_never_matches_another_tenants_keys():
    import fnmatch

    pattern = keys.tenant_pattern("a", "inflight")
    for tenant in ("a.b", "ab", "b", "a-"):
        assert not fnmatch.fnmatchcase(keys.log_key("j", "inflight", tenant), pattern)
    assert not fnmatch.fnmatchcase(keys.log_key("j", "inflight"), pattern)  # nor jobs without a tenant
    assert fnmatch.fnmatchcase(keys.log_key("x:y", "inflight", "a"), pattern)


def test_acl_recipe():
    rules = acl.redis_reader_rules("acme", "inflight")
    assert "%R~inflight:t:acme:job:*" in rules and "&inflight:t:acme:job:*" in rules and "+publish" not in rules
    assert "-@all" in rules and rules.index("-@all") < rules.index("+subscribe")
    with pytest.raises(ValueError):
        acl.redis_reader_rules("a:b")
    worker = acl.redis_worker_rules("inflight")
    assert "~inflight:*" in worker and "+evalsha" in worker and "+script|load" in worker and "+config|get" not in worker
    rows = acl.kafka_acls("inflight", "g", worker="User:w", producer="User:p")
    assert rows[0].acl_command_args()[3:5] == ["--operation", "Read"]
    grants = {(r.principal, op, n) for r in rows for op in r.operations for n in r.names}
    assert ("User:w", "Read", "inflight.jobs.high") in grants and ("User:w", "Write", "inflight.results") in grants
    assert ("User:p", "Read", "inflight.jobs.high") not in grants and ("User:p", "Write", "inflight.cancel") in grants
    assert ("User:w", "Read", "g") in grants and ("User:p", "Read", "g") not in grants
    assert ("User:p", "Describe", "g") in grants  # the gateway counts live workers; it never joins
    assert not any(p == "User:w" and op == "Write" and "jobs" in n for p, op, n in grants)  # one pool: no forwards


def test_with_pools_workers_read_and_write_every_pools_job_topics():
    from schemas.pools import Pool, Pools

    pools = Pools([Pool(name="default", max_prompt_tokens=256), Pool(name="long", max_prompt_tokens=4096)])
    rows = acl.kafka_acls("inflight", "g", worker="User:w", producer="User:p", pools=pools)
    grants = {(r.principal, op, n) for r in rows for op in r.operations for n in r.names}
    for topic in ("inflight.jobs.high", "inflight.jobs.long.low"):
        assert {("User:w", "Read", topic), ("User:w", "Write", topic), ("User:p", "Write", topic)} <= grants
        assert ("User:p", "Read", topic) not in grants
    assert {("User:w", "Read", "g"), ("User:w", "Read", "g.long")} <= grants
    assert {("User:p", "Describe", "g"), ("User:p", "Describe", "g.long")} <= grants


def test_refusals_are_explained_with_their_setting_and_exit_code():
    k = KafkaConfig(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_username="svc",
                    sasl_password="pw-never-shown")
    cases = [
        (kerr.SaslAuthenticationFailed(), 3, "kafka.sasl_password"),
        (kerr.TopicAuthorizationFailedError("inflight.jobs.high"), 5, "Read + Describe"),
        (kerr.GroupAuthorizationFailedError("inflight-workers"), 5, "kafka.group_id"),
        (ssl.SSLCertVerificationError(1, "certificate verify failed"), 4, "kafka.ssl_cafile"),
        (ssl.SSLError(1, "[SSL: TLSV1_ALERT_UNKNOWN_CA] tlsv1 alert unknown ca"), 4, "kafka.ssl_certfile"),
        (ConnectionRefusedError(111, "Connection refused"), 1, "kafka.bootstrap_servers"),
    ]
    for exc, code, words in cases:
        err = access.explain_kafka(exc, k, "h:1")
        assert err is not None and err.exit_code == code and words in str(err), (exc, err)
        assert "pw-never-shown" not in str(err) and "\n" not in str(err)
    assert access.explain_kafka(kerr.RequestTimedOutError(), k) is None  # transient: not explained away
    r = RedisConfig(url="rediss://h:6380/0", username="w", password="pw-never-shown")
    err = access.explain_redis(rex.AuthenticationError("invalid username-password pair"), r)
    assert err.exit_code == 3 and "'w'" in str(err) and "pw-never-shown" not in str(err)
    assert access.explain_redis(rex.NoPermissionError("no permissions"), r).exit_code == 5
    # a script's command refused by the ACL comes back as a plain error reply (seen with the fleet limits' script)
    refused = rex.ResponseError("The user executing the script can't run this command or subcommand script: 5585, "
                                "on @user_script:5.")
    assert access.explain_redis(refused, r).exit_code == 5 and access.is_fatal_redis(refused)
    assert not access.is_fatal_redis(rex.ResponseError("EPOCH changed"))
    wrapped = rex.ConnectionError("Error 1 connecting")
    wrapped.__context__ = ssl.SSLCertVerificationError(1, "self-signed certificate in certificate chain")
    assert access.explain_redis(wrapped, r).setting == "redis.ssl_cafile" and access.is_fatal_redis(wrapped)
    outage = rex.ConnectionError("Connection reset by peer")
    outage.__context__ = ssl.SSLError(1, "[SSL: UNEXPECTED_EOF_WHILE_READING] EOF")
    assert not access.is_fatal_redis(outage)  # a restarting server: still an outage to ride out
    assert access.is_fatal_kafka(access.Refused(kerr.TopicAuthorizationFailedError("t")))


def test_refused_access_is_logged_at_once_then_at_most_once_per_interval():
    assert transient_kind('Unable connect to "h:1": [Error 58] SaslAuthenticationFailed: Authentication failed') \
        == "access_refused"
    assert transient_kind("Topic inflight.dlq is not authorized for this client") == "access_refused"
    t = [0.0]
    ep = TransientEpisodes(grace_s=30, clock=lambda: t[0])
    levels = []
    for now in (0, 1, 5, 29, 31, 32, 70):
        t[0] = now
        levels.append(ep.observe("access_refused")[0])
    W, D = 30, 10  # logging.WARNING, logging.DEBUG
    assert levels == [W, D, D, D, W, D, W]


def test_publisher_builds_each_events_keys_with_its_jobs_tenant():
    """Round.tenants from the job table reach the publish script's keys; a restore after
    data loss finds the tenant of held and recently finished jobs (JobTable.tenant_of)."""
    from schemas.wire import Job
    from worker.engine import RequestOutput
    from worker.serve.claims import Claimed, ClaimStore
    from worker.serve.jobs import JobTable
    from worker.serve.publish import Publisher
    from worker.serve.read_ahead import JobRecord

    class FakeRedis:
        def register_script(self, src):
            return None

    table = JobTable("w1")
    for jid, tenant in (("a1", "acme"), ("n1", None)):
        table.open(JobRecord(Job(job_id=jid, prompt="x", tenant=tenant), "normal", "tp", 0, 0.0, None, None), Claimed("tok", 1, 0, 0, False))
        table.accepted(jid)
        table.apply_outputs([RequestOutput(jid, [5], "y", finished=True, finish_reason="length")])
    rnd = table.drain()
    assert rnd.tenants == ["acme", "acme", "acme", None, None, None]
    pub = Publisher(FakeRedis(), RedisConfig(), ClaimStore(FakeRedis(), "inflight", "w1", lease_ms=1000, ttl_s=60,
                                                           tombstone_ttl_s=60), table)
    ks, _, _ = pub._script_args(rnd)
    assert "inflight:t:acme:job:a1:log" in ks and "inflight:t:acme:job:a1" in ks
    assert "inflight:job:n1:log" in ks and not any(k.startswith("inflight:job:a1") and k.endswith((":log", "a1"))
                                                   for k in ks)
    assert "inflight:job:a1:claim" in ks  # the terminal event's worker-internal keys: per job id
    table.done(rnd.finished[0])
    assert table.tenant_of("a1") == "acme" and table.tenant_of("n1") is None and table.tenant_of("zz") is None


def test_every_command_a_lua_script_calls_is_granted_to_its_user():
    """Redis checks each command a script calls against the user running it: a command
    missing from the worker's (or the gateway's) grants fails only when the script runs,
    after the start-up probe loaded it (the fleet limits' hash and zset commands once were)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    users = {"worker": (acl.WORKER_COMMANDS, ["worker/serve/claim_scripts.py", "worker/serve/publish.py",
                                             "worker/serve/fleet_quota.py"]),
             "gateway": (acl.GATEWAY_COMMANDS, ["worker/gateway/batch/state.py"])}
    for user, (granted, files) in users.items():
        called = {m.lower() for f in files
                  for m in re.findall(r"redis\.call\(\s*'([A-Za-z]+)'", (root / f).read_text())}
        assert called, files
        assert called <= set(granted), (user, sorted(called - set(granted)))


def test_sentinel_urls_parse_and_bad_ones_name_the_field():
    from worker.config import ConfigError, RedisConfig
    from worker.config.services import SentinelTarget

    cfg = RedisConfig(url="redis+sentinel://app:s3cret@10.0.0.1:26379,sentinel-b:26380/cache/2")
    assert cfg.sentinel == SentinelTarget((("10.0.0.1", 26379), ("sentinel-b", 26380)), "cache", 2, "app", "s3cret")
    assert cfg.safe_url() == "redis+sentinel://app:***@10.0.0.1:26379,sentinel-b:26380/cache/2"
    assert "s3cret" not in repr(cfg) and cfg.user() == "app" and not cfg.uses_tls
    assert RedisConfig(url="rediss+sentinel://h:1/m").uses_tls
    assert RedisConfig(url="redis+sentinel://h:1/m").sentinel.db == 0
    assert RedisConfig(url="redis://h:6379/0").sentinel is None
    for bad, says in [("redis+sentinel://h:1", "/service"), ("redis+sentinel:///m", "host:port"),
                      ("redis+sentinel://h:x/m", "'h:x'"), ("redis+sentinel://h:1/m/x", "/service"),
                      ("sentinel://h:1/m", "redis+sentinel://")]:
        with pytest.raises(ConfigError, match="redis.url") as e:
            RedisConfig(url=bad)
        assert says in str(e.value), (bad, str(e.value))
