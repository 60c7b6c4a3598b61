"""The intake's consumer-group rebalance listener. aiokafka's rebalance is eager: every
partition is revoked, then some are assigned again. The revoke commits and keeps
everything (much of it may come back); the assignment forgets only the partitions that
went elsewhere (`Intake.keep_only`) and positions the assigned ones (committed offset, or
the log start when that is below it). For partitions kept, the tracker still knows every
offset read here (waiting, running or finished), so their re-read from the committed
offset neither runs a job twice nor loses one. Nothing is taken between the revoke and
the assignment (`Intake.rebalancing`)."""

from __future__ import annotations

from typing import Any, Protocol

import structlog
from aiokafka import ConsumerRebalanceListener
from aiokafka.errors import IllegalStateError, KafkaError

from worker.obs import transient_log

log = structlog.get_logger(__name__)


class RebalanceHost(Protocol):
    """What the listener needs of the intake (`worker.serve.intake.Intake`)."""

    rebalancing: bool
    num_revocations: int
    metrics: Any

    async def commit(self, only: set | None = None) -> None: ...

    def keep_only(self, kept: set) -> None: ...

    async def position(self, tps: list) -> None: ...


class Rebalance(ConsumerRebalanceListener):
    """The intake consumer's rebalance listener: revoked partitions are finished or handed back, assigned ones start fresh.

    Args: intake: the intake whose consumer this listens for."""

    def __init__(self, intake: RebalanceHost) -> None:
        self.intake = intake

    async def on_partitions_revoked(self, revoked) -> None:
        intake = self.intake
        intake.rebalancing = True
        await intake.commit(only=set(revoked))
        if revoked:
            intake.num_revocations += 1
            if intake.metrics is not None:
                intake.metrics.rebalances.inc()
            log.info("partitions revoked", partitions=sorted(f"{tp.topic}:{tp.partition}" for tp in revoked))

    async def on_partitions_assigned(self, assigned) -> None:
        intake = self.intake
        intake.keep_only(set(assigned))
        intake.rebalancing = False  # what is kept may be taken while positions are fetched
        try:
            await intake.position(list(assigned))
        except (KafkaError, IllegalStateError) as e:
            level, fields = transient_log.observe_error(e)
            log.log(level, "could not position assigned partitions; leaving it to the consumer", error=repr(e),
                    **fields)
        if assigned:
            log.info("partitions assigned", partitions=sorted(f"{tp.topic}:{tp.partition}" for tp in assigned))
