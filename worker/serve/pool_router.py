"""The worker's safety net for pools by prompt length (schemas/pools.py): a job whose
prompt is outside the range of this worker's pool is not run or rejected here but sent
on, as the record it came in, to the pool that serves it.

Producers that count tokens (the gateway, `InflightClient` with a tokenizer) write to the
right pool's topics already; the rest write to the default pool's, and its workers
forward. For a claimed job whose tokenized prompt belongs elsewhere (`Misrouted`), the
starter hands it here:

    1. the claim is given back with its attempt undone (`ClaimStore.unclaim`), so the
       target pool's worker claims the job as the same attempt when the record reaches it;
    2. the original record (value, key, headers, plus `inflight-forwarded-from: <pool>`
       and `inflight-forward-hops: n`) is produced to the target pool's topic of the same
       priority, and acknowledged (`acks=all`; Kafka errors retried while the offset stays
       open, as every final write);
    3. the record's offset is done (committed by the intake).

Nothing was published for the job here (no `started`), so its stream shows only the
target pool's run. A worker that dies between 1 and 3 leaves the offset open: the record
is read again, claimed again and forwarded again, and the target pool's claims (by job
id) run it once (a second copy finds the job claimed, then done). The order runs all of
this in the finalizer's loop (`Finalizer.forward`), where a refusal stops the worker. A job longer than every pool's bound
is rejected (`prompt_too_long`, DLQ) as before; a record already forwarded
`MAX_FORWARD_HOPS` times (pools declared differently across the fleet) is rejected too
(`prompt_too_long`, the message naming the hops), never passed around forever. Cancels reach every pool: the cancel topic is shared.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog
from aiokafka.errors import KafkaError

from schemas import keys
from schemas.pools import Pool, Pools
from worker.security.access import raise_if_refused

if TYPE_CHECKING:
    from aiokafka import AIOKafkaProducer

    from worker.config import WorkerConfig
    from worker.serve.local_job import LocalJob

log = structlog.get_logger(__name__)

FORWARDED_FROM = "inflight-forwarded-from"
FORWARD_HOPS = "inflight-forward-hops"
MAX_FORWARD_HOPS = 2  # a well-declared fleet forwards a record at most once


def check_pool_limits(cfg: WorkerConfig, max_input_tokens: int, max_model_len: int | None = None) -> None:
    """A worker must run every prompt its pool serves: its pool's bound may not exceed the
    engine's `max_input_tokens` (resolved from the model's context when unset). Called
    at start and by `inflight check` (its `limits` line).

    Raises:
        ConfigError: naming both numbers and what can be changed.
    """
    from worker.config import ConfigError

    pool = cfg.pool
    bound = pool.max_prompt_tokens
    if cfg.pool_set.routes and (bound is None or bound > max_input_tokens):
        longest = max_model_len - 1 if max_model_len else None
        if longest is not None and (bound is None or bound > longest):
            fix = (f"the model's context ({max_model_len} tokens) cannot hold such prompts: lower the pool's "
                   f"max_prompt_tokens to {longest} at most, or serve the pool with a longer-context model")
        else:
            fix = "raise serving_tuning.max_input_tokens to the pool's bound (or unset it: the model's context - 1)"
        raise ConfigError(f"pools: pool {pool.name!r} serves prompts up to "
                          f"{'any length' if bound is None else f'{bound} tokens'}, but this worker's "
                          f"serving_tuning.max_input_tokens is {max_input_tokens}; {fix}")


class Misrouted(Exception):
    """Raised by input processing: the prompt's `num_prompt_tokens` are outside this
    worker's pool; `target` is the pool that serves it (None: no pool does)."""

    def __init__(self, num_prompt_tokens: int, target: Pool | None) -> None:
        super().__init__(f"prompt of {num_prompt_tokens} tokens belongs to pool "
                         f"{target.name if target else None!r}")
        self.num_prompt_tokens = num_prompt_tokens
        self.target = target


class PoolRouter:
    """Forwards a job whose prompt length belongs to another pool to that pool's topic.

    Args:
        pools: the deployment's pools; own: this worker's pool.
        prefix: `kafka.topic_prefix`.
        producer: the worker's producer (`acks=all`).
    """

    def __init__(self, pools: Pools, own: Pool, prefix: str, producer: AIOKafkaProducer | None = None) -> None:
        self.pools = pools
        self.own = own
        self.prefix = prefix
        self.producer = producer
        self.active = pools.routes

    def check(self, num_prompt_tokens: int) -> None:
        """Raises Misrouted when this pool does not serve a prompt of that length."""
        if self.active:
            target = self.pools.route(num_prompt_tokens)
            if target is not self.own:
                raise Misrouted(num_prompt_tokens, target)

    def byte_limit_tokens(self, max_input_tokens: int) -> int | None:
        """The prompt length (tokens) whose byte bound refuses a job before tokenizing it:
        the engine's `max_input_tokens` without pools; with pools the longest prompt any
        pool serves (a prompt too long for this pool may be another's; None: no bound)."""
        return self.pools.max_prompt_tokens if self.active else max_input_tokens

    def hops(self, headers: tuple) -> int | None:
        """How many times the record was forwarded already (its `inflight-forward-hops`;
        0 without one); None when the header is not a count (not a number, or negative)."""
        for k, v in headers or ():
            if k == FORWARD_HOPS:
                try:
                    n = int(v)
                except (TypeError, ValueError):
                    return None
                return n if n >= 0 else None
        return 0

    def why_not_forward(self, e: Misrouted, headers: tuple) -> str | None:
        """The rejection message (`prompt_too_long`) when the misrouted job must not be
        forwarded: no pool serves its length, its hop header is not a count, or it was
        forwarded `MAX_FORWARD_HOPS` times already. None: forward it."""
        if e.target is None:
            return (f"prompt has {e.num_prompt_tokens} tokens; the longest any pool serves is "
                    f"{self.pools.max_prompt_tokens}")
        hops = self.hops(headers)
        if hops is None:
            return (f"its prompt of {e.num_prompt_tokens} tokens belongs to pool {e.target.name!r}, but its "
                    f"{FORWARD_HOPS} header is not a count of forwards, so it is not forwarded")
        if hops >= MAX_FORWARD_HOPS:
            return (f"its prompt of {e.num_prompt_tokens} tokens belongs to pool {e.target.name!r}, but it was "
                    f"forwarded {hops} times already (pools declared differently across the fleet?)")
        return None

    async def send(self, held: LocalJob, target: Pool) -> str:
        """Produce `held`'s original record to `target`'s job topic of its priority and
        wait for the acknowledgement. Returns the topic.

        Raises:
            aiokafka.errors.KafkaError: the broker did not take it (the caller retries).
            worker.security.access.Refused: the principal may not write `topic`.
        """
        topic = keys.job_topic(self.prefix, held.priority, target.name)
        headers = [(k, v) for k, v in held.headers or () if k not in (FORWARDED_FROM, FORWARD_HOPS)]
        hops = (self.hops(held.headers) or 0) + 1
        headers += [(FORWARDED_FROM, self.own.name.encode()), (FORWARD_HOPS, str(hops).encode())]
        try:
            await self.producer.send_and_wait(topic, value=held.raw, key=held.raw_key, headers=headers)
        except KafkaError as e:
            raise_if_refused(e)  # a missing Write ACL: retrying cannot help
            raise
        return topic
