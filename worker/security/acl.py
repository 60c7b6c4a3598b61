"""The ACL recipe: which principal needs which operation on which resource, as data, so
the ACL tables of docs/security.md, `inflight acl` (for operators) and the secured dev stack
(`tools/stack/devstack.sh up --secure`) all come from here.

Kafka (StandardAuthorizer, LITERAL resource names):

    principal  operations                 resources
    worker     Read, Describe             topics <p>.jobs.{high,normal,low}, <p>.cancel; group <group_id>
    worker     Write, Describe            topics <p>.dlq, <p>.results
    producer   Write, Describe            topics <p>.jobs.{high,normal,low}, <p>.cancel
    producer   Read, Describe (optional)  topic <p>.results: the client's results fallback
    producer   Describe                   group <group_id>: the gateway counts live workers

With pools by prompt length (schemas/pools.py) every pool's job topics take the place of
<p>.jobs.*: a worker reads them and *writes* them (it forwards a job to the pool that
serves its prompt), and reads every pool's consumer group; the producer writes them all.
One worker principal for the fleet keeps that one recipe; a principal per pool would need
Read on its own pool's topics and group and Write on the others' topics.

Redis (ACL users; key and channel patterns from `schemas.keys`):

    worker          every key and channel under `<key_prefix>:*`, only the commands the
                    worker runs (its Lua scripts' commands included)
    tenant reader   SUBSCRIBE / PSUBSCRIBE and XRANGE / XREVRANGE / XREAD / XLEN on its own
                    tenant's channels and logs (read-only); nothing else
    canceller       optionally added to a reader: SET on cancel tombstones only
    gateway         reads every tenant's channels and logs, sets cancel tombstones, owns
                    the batch keys `<key_prefix>:gw:*` (state, index, leases)
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas import keys
from schemas.pools import Pools
from schemas.wire import check_tenant

# Every command the worker sends (serve/claims.py, serve/publish.py, serve/fleet_quota.py, cli/preflight.py,
# serve/worker.py), including those its Lua scripts call: Redis checks a script's commands and keys against
# the user (tests/unit/test_security_config.py reads every script's commands).
WORKER_COMMANDS = (
    "ping",                                      # health checks, pub/sub keep-alive
    "evalsha", "script|load",                    # the claim and publish scripts (loaded on first use)
    "get", "set", "del", "exists",               # epoch, tombstones, done marks, preflight probe; in scripts
    "incr", "expire", "pexpire", "ttl",          # attempts, TTLs, leases (in scripts)
    "info",                                      # the server's run_id: a failover shows another (claims.server_id)
    "time",                                      # the suspect mark's and the fleet buckets' server time (in scripts)
    "sadd", "srem", "scard",                     # failure marks (in scripts)
    "xadd", "xrevrange", "xrange",               # the replay log (in scripts; xrange: a later attempt keeps the log so far, the end's rewrite its first id)
    "publish",                                   # live events (in the publish script)
    "hset", "hmget", "hgetall", "hdel",          # fleet-wide tenant limits: buckets, slots (serve/fleet_quota.py)
    "zadd", "zrem", "zcard", "zrangebyscore", "zremrangebyscore",  # ... live workers, slot leases
)
READER_COMMANDS = ("ping", "subscribe", "unsubscribe", "psubscribe", "punsubscribe",
                   "xrange", "xrevrange", "xread", "xlen")


# Every command the gateway sends (InflightClient streams and cancels, the batch store).
GATEWAY_COMMANDS = (
    "ping", "subscribe", "unsubscribe", "xrange",        # streams (worker.client.inflight)
    "set", "get", "del", "exists",                      # tombstones, leases, the index marker
    "evalsha", "script|load", "pexpire",                 # the lease renewal script
    "hset", "hmget", "zadd", "zrevrange", "sadd", "srem", "smembers",  # batch state and index
)


def redis_worker_rules(key_prefix: str = "inflight") -> list[str]:
    """ACL rules (for `ACL SETUSER <user> on >password <rules…>` or an aclfile line) of the
    workers' Redis user: every key and channel under `key_prefix`, only `WORKER_COMMANDS`."""
    space = keys.key_space(key_prefix)
    return ["resetkeys", f"~{space}", "resetchannels", f"&{space}", "-@all",
            *(f"+{c}" for c in WORKER_COMMANDS)]


def redis_reader_rules(tenant: str | None, key_prefix: str = "inflight", *, may_cancel: bool = False) -> list[str]:
    """ACL rules of a stream reader confined to one tenant's jobs (None: the jobs without
    a tenant): subscribe to their channels (also by the one pattern `tenant_pattern`) and
    read their logs. It cannot PUBLISH, write, or see another tenant's channels or keys.
    `may_cancel` adds SET on cancel tombstones (the client's cancel shortcut).

    Raises:
        ValueError: invalid tenant id.
    """
    pattern = keys.tenant_pattern(check_tenant(tenant), key_prefix)
    rules = ["resetkeys", f"%R~{pattern}", "resetchannels", f"&{pattern}", "-@all",
             *(f"+{c}" for c in READER_COMMANDS)]
    if may_cancel:
        rules += [f"%W~{keys.tombstone_pattern(key_prefix)}", "+set"]
    return rules


def redis_gateway_rules(key_prefix: str = "inflight") -> list[str]:
    """ACL rules of the gateway's Redis user: read (and subscribe to) the channels and logs
    of every tenant's jobs and of the jobs without a tenant, set cancel tombstones, and
    read and write its own batch keys (`<key_prefix>:gw:*`); `GATEWAY_COMMANDS` only."""
    tenants, untenanted = f"{key_prefix}:t:*", keys.tenant_pattern(None, key_prefix)
    return ["resetkeys", f"%R~{tenants}", f"%R~{untenanted}", f"%W~{keys.tombstone_pattern(key_prefix)}",
            f"~{key_prefix}:gw:*", "resetchannels", f"&{tenants}", f"&{untenanted}", "-@all",
            *(f"+{c}" for c in GATEWAY_COMMANDS)]


@dataclass(frozen=True, slots=True)
class KafkaAcl:
    """One row of the Kafka ACL table: `principal` may do `operations` on each resource
    (`resource_type` topic or group, LITERAL names)."""

    principal: str
    operations: tuple[str, ...]
    resource_type: str
    names: tuple[str, ...]
    why: str

    def acl_command_args(self) -> list[str]:
        """Arguments of Kafka's own `kafka-acls.sh` (`org.apache.kafka.tools.AclCommand`)
        after `--bootstrap-server … --command-config …` that add this row."""
        args = ["--add", "--allow-principal", self.principal]
        for op in self.operations:
            args += ["--operation", op]
        for name in self.names:
            args += [f"--{self.resource_type}", name]
        return args


def kafka_acls(topic_prefix: str = "inflight", group_id: str = "inflight-workers", *,
               worker: str = "User:inflight-worker", producer: str = "User:inflight-producer",
               producer_reads_results: bool = True, pools: Pools | None = None) -> list[KafkaAcl]:
    """The ACLs a deployment needs (see the module docstring). `worker` and `producer`
    are principals (`User:<SASL user>` or `User:<name the certificate maps to>`);
    `pools`: the deployment's pools (None: one pool, `default`)."""
    pool_names = pools.names if pools is not None else [None]
    jobs = tuple(t for name in pool_names for t in keys.job_topics(topic_prefix, name))
    groups = tuple(dict.fromkeys(pools.group_id(pools.get(n), group_id) for n in pools.names)) if pools else (group_id,)
    cancel = keys.cancel_topic(topic_prefix)
    out = [
        KafkaAcl(worker, ("Read", "Describe"), "topic", (*jobs, cancel), "consume jobs; read every cancel"),
        KafkaAcl(worker, ("Read", "Describe"), "group", groups, "join the group, commit offsets"),
        KafkaAcl(worker, ("Write", "Describe"), "topic", (keys.dlq_topic(topic_prefix),
                                                          keys.results_topic(topic_prefix)),
                 "dead letters; durable outcomes"),
        KafkaAcl(producer, ("Write", "Describe"), "topic", (*jobs, cancel), "submit jobs; send cancels"),
        KafkaAcl(producer, ("Describe",), "group", groups,
                 "the gateway counts each pool's live workers (without it: no fleet liveness check)"),
    ]
    if pools is not None and pools.routes:
        out.insert(3, KafkaAcl(worker, ("Write", "Describe"), "topic", jobs,
                               "forward a job to the pool that serves its prompt length"))
    if producer_reads_results:
        out.append(KafkaAcl(producer, ("Read", "Describe"), "topic", (keys.results_topic(topic_prefix),),
                            "InflightClient.result() fallback (every tenant's outcomes: trusted clients only)"))
    return out
