"""Connection settings of the two services a worker talks to: Kafka (`KafkaConfig`:
topics, consumer group, timeouts, SASL/TLS) and Redis (`RedisConfig`: URL, stream log
bounds, claim lease, outage limit, TLS)."""

from __future__ import annotations

from typing import ClassVar

import msgspec

from worker.config.checks import (
    ConfigError,
    one_of,
    one_secret,
    positive,
    read_secret,
    redact_url,
    tls_fields,
    unused,
)

SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


class TlsSettings(msgspec.Struct, kw_only=True):
    """The TLS client fields of the `kafka` and `redis` sections (one definition, one
    check): the CA to verify the server against (`ssl_cafile`; the system's CAs when
    unset), a client certificate for mutual TLS (`ssl_certfile`, `ssl_keyfile` if the key
    is in another file) and the key's password (`ssl_key_password` or its `*_file` twin).

    Attributes:
        ssl_cafile: PEM file of the CA(s) the server's certificate must chain to. None:
            the system's CAs.
        ssl_certfile: PEM client certificate presented for mutual TLS (None: none).
        ssl_keyfile: its private key, when not in `ssl_certfile`.
        ssl_key_password: the key's password (from the environment; never logged).
        ssl_key_password_file: a file whose first line is that password.
        ssl_check_hostname: verify that the server's certificate names the host dialled.
    """

    SECTION: ClassVar[str]  # the section's name in error messages

    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_key_password: str | None = None
    ssl_key_password_file: str | None = None
    ssl_check_hostname: bool = True

    def key_password(self) -> str | None:
        """The client key's password: `ssl_key_password_file`'s first line, else
        `ssl_key_password` (None: the key is not encrypted).

        Raises:
            ConfigError: the file cannot be read (names `<section>.ssl_key_password_file`).
        """
        return read_secret(f"{self.SECTION}.ssl_key_password", self.ssl_key_password, self.ssl_key_password_file)


class KafkaConfig(TlsSettings, kw_only=True, forbid_unknown_fields=True):
    """Kafka connection and consumer-group settings.

    Security (docs/security.md): `security_protocol` PLAINTEXT | SSL |
    SASL_PLAINTEXT | SASL_SSL. SASL needs `sasl_mechanism` (PLAIN, SCRAM-SHA-256,
    SCRAM-SHA-512), `sasl_username` and a password; TLS verifies the broker against
    `ssl_cafile` (the system's CAs when unset) and presents a client certificate when
    `ssl_certfile` is set (mutual TLS; `ssl_keyfile` if the key is in another file). Every
    secret (`sasl_password`, `ssl_key_password`) comes from the environment
    (`INFLIGHT_KAFKA__SASL_PASSWORD`) or from its `*_file` twin, and is never logged.

    Attributes:
        bootstrap_servers: `host:port[,host:port...]` of the brokers to bootstrap from.
        topic_prefix: the topics' prefix: `<prefix>.jobs.<priority>`, `.cancel`, `.dlq`,
            `.results` (schemas/keys.py); every worker, producer and gateway of a
            deployment uses the same.
        group_id: the workers' consumer group (the default pool's; another pool `P` uses
            `<group_id>.P` unless its own `group_id` is set). The gateway counts its
            members as the pool's live workers.
        security_protocol: PLAINTEXT | SSL | SASL_PLAINTEXT | SASL_SSL.
        sasl_mechanism: PLAIN | SCRAM-SHA-256 | SCRAM-SHA-512 (SASL only).
        sasl_username: the SASL user (the principal `User:<name>`).
        sasl_password: its password (from the environment; never logged).
        sasl_password_file: a file whose first line is that password.
        session_timeout_ms: how long the group coordinator waits for a worker's heartbeat
            before it counts the worker gone and moves its partitions, milliseconds.
        heartbeat_interval_ms: heartbeat period, milliseconds (below the session timeout).
        max_poll_interval_ms: longest gap between two polls before the consumer leaves the
            group, milliseconds (intake polls continuously, so only a stalled loop hits it).
        max_partition_fetch_bytes: most bytes fetched per partition per request (also the
            largest job record a worker can read).
        commit_interval_ms: how often finished jobs' offsets are committed, milliseconds.
        cancel_lookback_s: where the cancel listener starts reading at start: None, the
            cancel topic's log start (every cancel it keeps); else this many seconds ago.
        max_cancelled_ids: cancelled job ids a worker keeps in memory.
        outage_limit_s: how long Kafka may be unreachable before the worker gives up
            (exit 1), seconds, while it runs or while it starts; transient errors are
            retried meanwhile.
        stall_timeout_s: lag, free slots and no record for this long: the consumer is
            recreated, seconds.
        transient_grace_s: expected transient conditions (coordinator loading, a
            rebalance, a broker restart) log at info until one has lasted this long, then
            once at warning, seconds.
        affinity_prefix_bytes: prefix affinity for the producers here (the Python client,
            the gateway, `inflight submit`): a job whose prompt head (`schemas/affinity.py`:
            its text, or its tools' names and messages, before any tokenizer) holds at
            least this many bytes goes to the partition its first this-many bytes hash to,
            so jobs sharing that prefix meet on one worker's prefix cache (hot prefixes
            spread over more partitions: `worker/client/affinity.py`). Shorter heads keep
            the job id's partition. Pick about the shortest shared prefix worth placing
            (1024 bytes: some 250 tokens). 0: off, every job by its id.
        affinity_window: jobs per topic a producer counts to find its hot prefixes.
        partition_assignor: how the workers' group deals partitions out: `sticky`
            (Inflight's: balanced per topic, a partition stays with its worker across
            rebalances, so its prefixes stay cached: worker/serve/sticky.py) or
            `roundrobin` (aiokafka's, what workers before 2026-12 used). Every worker of a
            group needs the same: a worker the group refuses for it stops with a config
            error (docs/operations.md, Scaling, says how to switch a running fleet).
    """

    SECTION: ClassVar[str] = "kafka"

    bootstrap_servers: str = "127.0.0.1:19092"
    topic_prefix: str = "inflight"
    group_id: str = "inflight-workers"
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = msgspec.field(default=None)
    sasl_password_file: str | None = None
    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 3_000
    max_poll_interval_ms: int = 300_000
    max_partition_fetch_bytes: int = 16 * 1024 * 1024
    commit_interval_ms: int = 500
    cancel_lookback_s: float | None = None  # worker/serve/cancels.py
    max_cancelled_ids: int = 1_000_000
    outage_limit_s: float = 600.0  # worker/serve/kafka_outage.py
    stall_timeout_s: float = 10.0
    transient_grace_s: float = 30.0  # worker.obs.transient_log
    affinity_prefix_bytes: int = 1024  # schemas/affinity.py, worker/client/affinity.py
    affinity_window: int = 1000
    partition_assignor: str = "sticky"  # worker/serve/sticky.py

    def __post_init__(self) -> None:
        positive("kafka", session_timeout_ms=self.session_timeout_ms, max_poll_interval_ms=self.max_poll_interval_ms,
                  commit_interval_ms=self.commit_interval_ms, heartbeat_interval_ms=self.heartbeat_interval_ms,
                  max_partition_fetch_bytes=self.max_partition_fetch_bytes, affinity_window=self.affinity_window)
        if self.affinity_prefix_bytes < 0:
            raise ConfigError(f"kafka.affinity_prefix_bytes must be >= 0 (0: off), got {self.affinity_prefix_bytes}")
        if self.heartbeat_interval_ms >= self.session_timeout_ms:
            raise ConfigError(
                f"kafka.heartbeat_interval_ms ({self.heartbeat_interval_ms}) must be below kafka.session_timeout_ms "
                f"({self.session_timeout_ms}); Kafka recommends at most a third of it"
            )
        if self.stall_timeout_s <= 0 or (self.cancel_lookback_s is not None and self.cancel_lookback_s < 0):
            raise ConfigError("kafka.stall_timeout_s must be > 0 and kafka.cancel_lookback_s >= 0 (or null)")
        positive("kafka", max_cancelled_ids=self.max_cancelled_ids)
        if not self.outage_limit_s > 0:
            raise ConfigError(f"kafka.outage_limit_s must be > 0, got {self.outage_limit_s}")
        if self.transient_grace_s <= 0:
            raise ConfigError(f"kafka.transient_grace_s must be > 0, got {self.transient_grace_s}")
        if not self.bootstrap_servers:
            raise ConfigError("kafka.bootstrap_servers must not be empty")
        one_of("kafka", "security_protocol", self.security_protocol, SECURITY_PROTOCOLS)
        one_of("kafka", "partition_assignor", self.partition_assignor, ("sticky", "roundrobin"))
        uses_sasl = self.security_protocol.startswith("SASL_")
        if uses_sasl:
            if self.sasl_mechanism is None:
                raise ConfigError(f"kafka.sasl_mechanism is required with security_protocol "
                                  f"{self.security_protocol} (one of {sorted(SASL_MECHANISMS)})")
            one_of("kafka", "sasl_mechanism", self.sasl_mechanism, SASL_MECHANISMS)
            if not self.sasl_username:
                raise ConfigError(f"kafka.sasl_username is required with security_protocol {self.security_protocol}")
            if self.sasl_password is None and self.sasl_password_file is None:
                raise ConfigError(f"kafka.sasl_password (e.g. INFLIGHT_KAFKA__SASL_PASSWORD) or "
                                  f"kafka.sasl_password_file is required with security_protocol {self.security_protocol}")
        else:
            unused("kafka", f"security_protocol {self.security_protocol} (no SASL)", sasl_mechanism=self.sasl_mechanism,
                    sasl_username=self.sasl_username)
        one_secret("kafka", "sasl_password", self.sasl_password, self.sasl_password_file)
        tls_fields("kafka", self.security_protocol in ("SSL", "SASL_SSL"), f"security_protocol {self.security_protocol}",
                    self)

    @property
    def uses_tls(self) -> bool:
        return self.security_protocol in ("SSL", "SASL_SSL")

    def password(self) -> str | None:
        """The SASL password: `sasl_password_file`'s first line, else `sasl_password`.

        Raises:
            ConfigError: the file cannot be read (names `kafka.sasl_password_file`).
        """
        return read_secret("kafka.sasl_password", self.sasl_password, self.sasl_password_file)

    def principal(self) -> str:
        """Who the broker will think we are, for error messages: the SASL user, the
        client certificate, or ANONYMOUS."""
        if self.security_protocol.startswith("SASL_"):
            return f"User:{self.sasl_username} ({self.sasl_mechanism})"
        if self.ssl_certfile:
            return f"the client certificate {self.ssl_certfile!r}"
        return "User:ANONYMOUS"

    def __repr__(self) -> str:  # never print secrets
        return (f"KafkaConfig(bootstrap_servers={self.bootstrap_servers!r}, group_id={self.group_id!r}, "
                f"security_protocol={self.security_protocol!r}, ...)")


class RedisConfig(TlsSettings, kw_only=True, forbid_unknown_fields=True):
    """Redis connection (`redis://`, `rediss://` for TLS, or `unix://` URL) and event
    retention.

    Security: an ACL user with `username` and `password` (or `password_file`), or
    credentials in the URL (given through `INFLIGHT_REDIS__URL`), not both. With
    `rediss://` the server is verified against `ssl_cafile` (the system's CAs when unset)
    and `ssl_certfile` / `ssl_keyfile` are presented when set (for `tls-auth-clients
    yes`). Secrets come from the environment or their `*_file` twins, never logged.

    Attributes:
        url: `redis://host:port/db`, `rediss://` for TLS, `unix://path`, or a master
            found through Redis Sentinel:
            `redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]`
            (`rediss+sentinel://` for TLS to the master and the Sentinels); the
            credentials are the master's (`SentinelTarget`).
        key_prefix: the keys' and channels' prefix (`<prefix>:job:<id>:log`, a tenant's
            under `<prefix>:t:<tenant>:`; schemas/keys.py).
        username: the ACL user (None: `default`, or the URL's).
        password: its password (from the environment; never logged).
        password_file: a file whose first line is that password.
        log_ttl_s: lifetime of a job's replay log, done mark and counters after its
            last event, seconds.
        log_maxlen: approximate cap of entries per replay log (while the job runs).
        compact_logs: when a job ends, rewrite its log with each run of token events
            merged into one entry that lists their sizes (`schemas.replay`): the same
            events replay, seq for seq, from ~10x fewer bytes. Off: one entry per publish
            round stays until `log_ttl_s`.
        claim_lease_ms: claim lease; renewed every third of it while the job runs.
        tombstone_ttl_s: lifetime of a cancel tombstone, seconds.
        outage_limit_s: how long the worker holds events while Redis is unreachable
            (jobs keep running, intake pauses) before it gives up and exits so its
            partitions move, seconds.
        publish_interval_ms: least time between two publisher rounds; > 0 merges each
            job's tokens of several steps into one event (fewer Redis writes, coarser
            streaming, as vLLM's `stream_interval`); 0 publishes as fast as Redis takes it.
        command_timeout_s: how long a Redis command (and a connect) may wait for its
            answer before it fails as an outage, seconds: a Redis that accepts
            connections but never answers (frozen, a half-open connection) is then an
            outage, not a wait for ever. Pub/sub reads use their own short polls.
    """

    SECTION: ClassVar[str] = "redis"

    url: str = "redis://127.0.0.1:6390/0"
    key_prefix: str = "inflight"
    username: str | None = None
    password: str | None = None
    password_file: str | None = None
    log_ttl_s: int = 3600
    log_maxlen: int = 10_000
    compact_logs: bool = True
    claim_lease_ms: int = 15_000
    tombstone_ttl_s: int = 3600
    outage_limit_s: float = 60.0
    publish_interval_ms: float = 0.0
    command_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://", *SentinelTarget.SCHEMES)):
            raise ConfigError("redis.url must start with redis://, rediss://, unix://, redis+sentinel:// or "
                              f"rediss+sentinel://, got {self.url.split('@')[-1]!r}")
        SentinelTarget.parse(self.url)  # a malformed Sentinel URL fails now, naming the field
        positive("redis", log_ttl_s=self.log_ttl_s, log_maxlen=self.log_maxlen, claim_lease_ms=self.claim_lease_ms,
                  tombstone_ttl_s=self.tombstone_ttl_s)
        if not self.outage_limit_s > 0:
            raise ConfigError(f"redis.outage_limit_s must be > 0, got {self.outage_limit_s}")
        if not self.command_timeout_s > 0:
            raise ConfigError(f"redis.command_timeout_s must be > 0, got {self.command_timeout_s}")
        if not 0 <= self.publish_interval_ms <= 10_000:
            raise ConfigError(f"redis.publish_interval_ms must be in [0, 10000], got {self.publish_interval_ms}")
        one_secret("redis", "password", self.password, self.password_file)
        from urllib.parse import urlsplit

        in_url = urlsplit(self.url)
        if (self.password is not None or self.password_file is not None) and in_url.password:
            raise ConfigError("redis.password / redis.password_file and a password in redis.url are both set; "
                              "set one")
        if self.username and in_url.username:
            raise ConfigError("redis.username and a user name in redis.url are both set; set one")
        tls_fields("redis", self.uses_tls, "a redis:// or unix:// URL (TLS needs rediss://)", self)

    @property
    def uses_tls(self) -> bool:
        return self.url.startswith(("rediss://", "rediss+sentinel://"))

    @property
    def sentinel(self) -> SentinelTarget | None:
        """The Sentinel addresses and service of a `redis+sentinel://` URL (None: a
        direct URL)."""
        return SentinelTarget.parse(self.url)

    def secret_password(self) -> str | None:
        """The ACL password: `password_file`'s first line, else `password` (None: the
        URL's, or none)."""
        return read_secret("redis.password", self.password, self.password_file)

    def user(self) -> str:
        """The ACL user connections authenticate as, for error messages."""
        from urllib.parse import unquote, urlsplit

        name = self.username or unquote(urlsplit(self.url).username or "")
        return name or "default"

    def safe_url(self) -> str:
        """`url` with its password replaced by `***` (for logs and messages)."""
        return redact_url(self.url)

    def __repr__(self) -> str:
        return f"RedisConfig(url=<hidden>, key_prefix={self.key_prefix!r})"


class SentinelTarget(msgspec.Struct, frozen=True):
    """Where a `redis+sentinel://` URL points: the Sentinels to ask, the master's service
    name, the database. redis-py's `Sentinel` does the asking (and re-asks after a
    failover); this is only the URL's parse.

    URL: `redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]`, or
    `rediss+sentinel://` for TLS (master and Sentinels). The user and password are the
    master's; Sentinels are reached without them.

    Raises (from `parse`):
        ConfigError: no host:port, a port that is not a number, or no service name.
    """

    SCHEMES: ClassVar[tuple[str, ...]] = ("redis+sentinel://", "rediss+sentinel://")

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None

    @classmethod
    def parse(cls, url: str) -> SentinelTarget | None:
        from urllib.parse import unquote

        if not url.startswith(cls.SCHEMES):
            return None
        rest = url.split("://", 1)[1]
        netloc, _, path = rest.partition("/")
        creds, _, hosts = netloc.rpartition("@")
        user, _, password = creds.partition(":")
        sentinels = []
        for hp in filter(None, hosts.split(",")):
            host, _, port = hp.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"redis.url: Sentinel address {hp!r} is not host:port")
            sentinels.append((host, int(port)))
        if not sentinels:
            raise ConfigError("redis.url: a redis+sentinel:// URL needs at least one host:port")
        parts = [p for p in path.split("/") if p]
        if not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
            raise ConfigError("redis.url: a redis+sentinel:// URL ends in /service or /service/db "
                              f"(the master's name in the Sentinels' config), got {'/' + path!r}")
        return cls(tuple(sentinels), unquote(parts[0]), int(parts[1]) if len(parts) == 2 else 0,
                   unquote(user) or None, unquote(password) or None)
