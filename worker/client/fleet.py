"""Which workers are alive, by pool: the members of each pool's consumer group that
subscribe to the pool's job topics, as Kafka's group coordinator sees them
(DescribeGroups). A worker is a member from its group join until it leaves (a clean stop:
at once) or misses `kafka.session_timeout_ms` of heartbeats (kill -9, a frozen process, a
lost network), so "no member" is Kafka's own word that nothing consumes the pool's jobs.

Only members subscribed to one of the pool's job topics count: the group id may be shared
with other consumers (another deployment's topic prefix on the same `group_id`, a tool),
and the consumer protocol's member metadata names each member's subscription. A member
whose metadata does not decode (a client speaking another protocol) counts as alive.

Used by the gateway (`worker.gateway.app`): a pool without a live worker is refused at
once with 503 rather than queued until `queue_timeout_s`, and `/readyz` says so. A group
the coordinator does not know (never committed to: a fleet not started yet, or a gateway
whose `kafka.group_id` is not the workers') counts as unknown, not dead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiokafka.coordinator.protocol import ConsumerProtocolMemberMetadata
from aiokafka.errors import for_code

from schemas import keys
from schemas.pools import Pools


@dataclass(frozen=True, slots=True)
class PoolGroup:
    """One pool's consumer group and the job topics its workers subscribe to."""

    pool: str
    group_id: str
    topics: frozenset[str]


def pool_groups(pools: Pools, base_group_id: str, topic_prefix: str) -> list[PoolGroup]:
    """Each pool's group (`Pools.group_id`: `kafka.group_id` for `default`) and job topics."""
    return [PoolGroup(p.name, pools.group_id(p, base_group_id), frozenset(keys.job_topics(topic_prefix, p.name)))
            for p in pools.pools]


def subscribes(member_metadata: bytes, topics: frozenset[str]) -> bool:
    """Whether a member's consumer-protocol metadata subscribes to any of `topics` (True
    when it does not decode: a member of the group all the same)."""
    try:
        subscription = ConsumerProtocolMemberMetadata.decode(member_metadata).subscription
    except Exception:  # noqa: BLE001 - another protocol's metadata: count the member
        return True
    return bool(topics.intersection(subscription))


def live_members(rows: list[Any], group: PoolGroup) -> int | None:
    """Members of `group` subscribed to its topics, from DescribeGroups response rows
    `(error_code, group, state, protocol_type, protocol, members, ...)` with members
    `(member_id, client_id, client_host, member_metadata, member_assignment)`.

    None when the coordinator knows no such group (state `Dead`, or no row): no worker
    ever committed under that id — a fleet not started yet, or a `group_id` that is not
    the workers'; a fleet that stopped keeps its group (`Empty`, 0 members) while its
    committed offsets live.

    Raises:
        KafkaError: the row's error code (e.g. GroupAuthorizationFailedError: the principal
            may not describe the group).
    """
    count: int | None = None
    for row in rows:
        error_code, group_id, state, _ptype, _protocol, members = row[:6]
        if group_id != group.group_id:
            continue
        if error_code:
            raise for_code(error_code)(f"DescribeGroups {group_id!r}")
        if state == "Dead" and not members:
            continue
        count = (count or 0) + sum(subscribes(m[3], group.topics) for m in members)
    return count


async def live_workers(admin: Any, groups: list[PoolGroup]) -> dict[str, int | None]:
    """Live workers per pool name (None: the pool's group is unknown, `live_members`),
    through `admin` (a started `AIOKafkaAdminClient`).

    Raises:
        KafkaError: the cluster did not answer, or refused to describe a group.
    """
    responses = await admin.describe_consumer_groups(sorted({g.group_id for g in groups}))
    rows = [row for response in responses for row in response.groups]
    return {g.pool: live_members(rows, g) for g in groups}
