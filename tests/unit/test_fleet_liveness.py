"""Fleet liveness: counting a pool's live workers from DescribeGroups rows
(`worker.client.fleet`) and the gateway's rule for a dead pool (`worker.gateway.liveness`).
The same against a real broker and gateway: tests/integration/test_gateway_edge.py."""

from __future__ import annotations

import pytest
from aiokafka.coordinator.protocol import ConsumerProtocolMemberMetadata
from aiokafka.errors import GroupAuthorizationFailedError

from schemas.pools import Pool, Pools
from worker.client import fleet
from worker.gateway.errors import ApiError
from worker.gateway.liveness import FleetLiveness


def member(member_id: str, topics: list[str]) -> tuple:
    meta = ConsumerProtocolMemberMetadata(0, topics, b"").encode()
    return (member_id, "aiokafka", "/10.0.0.1", meta, b"")


def test_pool_groups_follow_the_pools_naming():
    pools = Pools([Pool(name="default", max_prompt_tokens=256), Pool(name="long")])
    groups = {g.pool: g for g in fleet.pool_groups(pools, "workers", "acme")}
    assert groups["default"].group_id == "workers" and groups["long"].group_id == "workers.long"
    assert groups["default"].topics == {"acme.jobs.high", "acme.jobs.normal", "acme.jobs.low"}
    assert "acme.jobs.long.low" in groups["long"].topics


def test_only_members_on_the_pools_job_topics_count():
    g = fleet.pool_groups(Pools(), "workers", "acme")[0]
    rows = [
        (0, "workers", "Stable", "consumer", "roundrobin", [
            member("w1", ["acme.jobs.high", "acme.jobs.normal", "acme.jobs.low"]),
            member("w2", ["acme.jobs.low"]),
            member("other-prefix", ["beta.jobs.high"]),  # another deployment sharing the group id
            ("odd", "c", "h", b"\xff\x00not-consumer-protocol", b""),  # does not decode: counted
        ]),
        (0, "unrelated", "Stable", "consumer", "range", [member("x", ["acme.jobs.high"])]),
    ]
    assert fleet.live_members(rows, g) == 3
    assert fleet.live_members([(0, "workers", "Empty", "consumer", "", [])], g) == 0  # a fleet that stopped
    # a group the coordinator does not know: never committed to (not started yet, or not the workers' id)
    assert fleet.live_members([(0, "workers", "Dead", "", "", [])], g) is None
    assert fleet.live_members([], g) is None


def test_a_refused_describe_raises_the_kafka_error():
    g = fleet.pool_groups(Pools(), "workers", "acme")[0]
    with pytest.raises(GroupAuthorizationFailedError):
        fleet.live_members([(GroupAuthorizationFailedError.errno, "workers", "", "", "", [])], g)


def test_a_pool_is_dead_only_after_the_grace_and_alive_again_at_once():
    f = FleetLiveness("tiny", grace_s=5.0)
    f.update({"default": 0, "long": 2}, now=100.0)
    assert not f.dead("default", now=104.9) and f.readiness_error(now=104.9) is None
    f.update({"default": 0, "long": 2}, now=105.0)  # still empty: the first empty check's time holds
    assert f.dead("default", now=105.0) and not f.dead("long", now=105.0)
    f.update({"default": 1, "long": 0}, now=106.0)
    assert not f.dead("default", now=200.0) and f.dead("long", now=111.0)


def test_a_dead_pool_is_refused_with_503_naming_the_model_and_pool():
    f = FleetLiveness("tiny", grace_s=0.0)
    f.update({"default": 0})  # now: a grace of 0 is dead at once
    with pytest.raises(ApiError) as e:
        f.check("default")
    assert e.value.status == 503 and e.value.code == "no_live_worker"
    assert "no live worker for model 'tiny' (pool 'default')" in e.value.message
    assert f.readiness_error() == "no live worker for model 'tiny' (pool 'default')"
    f.check("long")  # a pool the counts do not name is not refused


def test_an_unknown_group_refuses_nothing():
    f = FleetLiveness("tiny", grace_s=0.0)
    f.update({"default": 0, "long": None}, now=0.0)
    assert f.dead("default", now=1.0) and not f.dead("long", now=100.0)
    f.update({"default": None, "long": None}, now=2.0)
    assert not f.dead("default", now=100.0) and f.readiness_error(now=100.0) is None


def test_unknown_counts_refuse_nothing():
    f = FleetLiveness("tiny", grace_s=0.0)
    f.update({"default": 0}, now=0.0)
    f.update(None, now=10.0)  # the groups could not be described
    assert f.counts is None and not f.dead("default", now=100.0)
    f.check("default")
    f.update({"default": 0}, now=100.0)  # counted again: the grace starts over
    assert f.dead("default", now=100.0)
