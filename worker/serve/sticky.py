"""The workers' partition assignor: sticky, balanced per topic (`inflight-sticky`).

A rebalance under aiokafka's default round-robin assignor deals every partition out again
over the members sorted by id, so one worker joining or leaving moves most partitions,
and with them the prefix caches that prefix affinity built (`schemas/affinity.py`: a
partition's jobs share prefixes). This assignor keeps each partition with its worker where
balance allows, as Kafka's StickyAssignor (KIP-54) does. Each member says in its join
metadata which partitions it holds; the group's leader then, topic by topic:

1. keeps every partition with the one member that claims it (two claimants — a member
   that was away and missed a generation — and neither keeps it; a member not subscribed
   to the topic keeps nothing of it);
2. trims a member's kept partitions to `ceil(partitions / members)` of the topic;
3. gives each partition nobody kept to the subscribed member holding fewest of the
   topic's, then fewest over all topics, then the lowest member id;
4. moves partitions from the member holding most of the topic to the one holding fewest
   while they differ by more than one;
5. then, over all topics, while a member holds two or more partitions more than another,
   moves one to it from a topic where the first holds more of it than the second (the
   topic stays within one): with fewer partitions per topic than members, the members
   left out of one topic get another's, so no worker sits idle.

So every priority topic is spread over the workers on its own (a worker never ends up
with all of `high`), every worker gets its share of all partitions, and a worker leaving
moves only its own partitions.

The state is per instance (`claims`), so several consumers in one process (tests, a
worker's restarted consumer) never share it — aiokafka's own sticky assignor keeps it on
the class (aio-libs/aiokafka#1175) and advertises no generation (#1176), which is why it is
not used.

**One protocol, not two.** Kafka's way to change assignors in a running group is to list
the new one before the old one, so the group agrees on the old until every member offers
the new. aiokafka 0.14 cannot: its join sends one JoinGroup per listed assignor, each with
the protocols listed so far (the request is built inside the loop over assignors), and
the second, with other metadata, forces a new rebalance — with two members joining, the
group rebalances forever (seen here: never stable in 15 s; one protocol: 0.14 s). So a
worker offers exactly one, `kafka.partition_assignor` (`sticky`, or aiokafka's
`roundrobin`, what workers before this used), and a worker whose group already agreed on
the other is refused by the broker: `Intake.start` turns that into a config error naming
the field (docs/operations.md says how to switch a running fleet).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping

import msgspec
from aiokafka.cluster import ClusterMetadata
from aiokafka.coordinator.assignors.abstract import AbstractPartitionAssignor
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment, ConsumerProtocolMemberMetadata

log = logging.getLogger(__name__)


class _Claims(msgspec.Struct, array_like=True):
    """A member's join metadata: the partitions it holds, by topic."""

    owned: dict[str, list[int]] = {}


def _decode_claims(user_data: bytes) -> dict[str, list[int]]:
    """A member's claims; none for metadata this assignor cannot read (logged)."""
    if not user_data:
        return {}
    try:
        return msgspec.msgpack.decode(user_data, type=_Claims).owned
    except msgspec.DecodeError:
        log.warning("a group member's inflight-sticky metadata is unreadable; its partitions are dealt again")
        return {}


class StickyAssignor(AbstractPartitionAssignor):
    """Kafka partition assignor for the workers' consumer group (rules in the module
    docstring). One instance per worker, kept across its consumers (`strategy`)."""

    name = "inflight-sticky"
    version = 0

    def __init__(self) -> None:
        self.claims: dict[str, list[int]] = {}  # what this member holds now, by topic

    def strategy(self) -> tuple:
        """`partition_assignment_strategy` for a worker's consumer: this assignor alone
        (the module docstring says why not a second)."""
        return (self,)

    def metadata(self, topics: Iterable[str]) -> ConsumerProtocolMemberMetadata:  # type: ignore[override]
        return ConsumerProtocolMemberMetadata(self.version, list(topics), msgspec.msgpack.encode(_Claims(self.claims)))

    def on_assignment(self, assignment: ConsumerProtocolMemberAssignment) -> None:  # type: ignore[override]
        self.claims = {topic: sorted(parts) for topic, parts in assignment.assignment}

    def assign(self, cluster: ClusterMetadata,  # type: ignore[override]
               members: Mapping[str, ConsumerProtocolMemberMetadata]) -> dict[str, ConsumerProtocolMemberAssignment]:
        subscribed = {m: set(md.subscription) for m, md in members.items()}
        claims = {m: _decode_claims(md.user_data) for m, md in members.items()}
        topics = sorted(set().union(*subscribed.values())) if subscribed else []
        partitions = {}
        for topic in topics:
            parts = cluster.partitions_for_topic(topic)
            if parts is None:
                log.warning("no partition metadata for topic %s: not assigned this round", topic)
                continue
            partitions[topic] = sorted(parts)
        plan = assign_sticky(partitions, subscribed, claims)
        return {m: ConsumerProtocolMemberAssignment(self.version, sorted(plan[m].items()), b"") for m in members}


def assign_sticky(partitions: dict[str, list[int]], subscribed: dict[str, set[str]],
                  claims: dict[str, dict[str, list[int]]]) -> dict[str, dict[str, list[int]]]:
    """The assignment (member -> topic -> partitions) by the module docstring's rules;
    `partitions`: each topic's partition ids, `subscribed`: each member's topics,
    `claims`: what each member says it holds."""
    plan: dict[str, dict[str, list[int]]] = {m: {} for m in subscribed}
    total = dict.fromkeys(subscribed, 0)
    for topic, parts in partitions.items():
        subs = sorted(m for m, topics in subscribed.items() if topic in topics)
        if not subs:
            continue
        valid = set(parts)
        claimants: dict[int, list[str]] = {}
        for m in subs:
            for p in claims.get(m, {}).get(topic, ()):
                if p in valid:
                    claimants.setdefault(p, []).append(m)
        cap = math.ceil(len(parts) / len(subs))
        held: dict[str, list[int]] = {m: [] for m in subs}
        for p in parts:  # 1 and 2: one claimant keeps it, up to the cap
            owners = claimants.get(p, [])
            if len(owners) == 1 and len(held[owners[0]]) < cap:
                held[owners[0]].append(p)
        kept = {p for ps in held.values() for p in ps}
        for p in parts:  # 3: the rest to whoever holds least
            if p not in kept:
                m = min(subs, key=lambda m: (len(held[m]), total[m], m))
                held[m].append(p)
        while True:  # 4: even out
            most = max(subs, key=lambda m: (len(held[m]), m))
            fewest = min(subs, key=lambda m: (len(held[m]), total[m], m))
            if len(held[most]) - len(held[fewest]) <= 1:
                break
            held[fewest].append(held[most].pop())
        for m in subs:
            if held[m]:
                plan[m][topic] = held[m]
                total[m] += len(held[m])
    _even_out_totals(plan, total, subscribed)
    return {m: {t: sorted(ps) for t, ps in topics.items() if ps} for m, topics in plan.items()}


def _even_out_totals(plan: dict[str, dict[str, list[int]]], total: dict[str, int],
                     subscribed: dict[str, set[str]]) -> None:
    """Rule 5, in place: move partitions between members whose totals differ by two or
    more, each from a topic the giver holds more of than the taker (both subscribed)."""
    while (move := _next_move(plan, total, subscribed)) is not None:
        giver, taker, topic = move
        plan[taker].setdefault(topic, []).append(plan[giver][topic].pop())
        total[giver] -= 1
        total[taker] += 1


def _next_move(plan: dict[str, dict[str, list[int]]], total: dict[str, int],
               subscribed: dict[str, set[str]]) -> tuple[str, str, str] | None:
    """(giver, taker, topic) of rule 5's next move: the member holding most that can give,
    to the one holding fewest that can take, of the first such topic by name; None when
    no two members differ by two or more with a topic to move."""
    for giver in sorted(total, key=lambda m: (-total[m], m)):
        for taker in sorted(total, key=lambda m: (total[m], m)):
            if total[giver] - total[taker] < 2:
                break  # takers hold more from here on
            topic = next((t for t, ps in sorted(plan[giver].items())
                          if t in subscribed[taker] and len(ps) > len(plan[taker].get(t, ()))), None)
            if topic is not None:
                return giver, taker, topic
    return None
