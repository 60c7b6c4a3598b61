"""The preflight's consumer-group check against a fresh broker: its group coordinator
answers "not coordinator" while `__consumer_offsets` is being created (seen in the first
seconds of the Compose stack's Kafka). Those answers are asked again, and one that stays
is reported as a coordinator not ready, never as a missing permission."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from worker.cli.preflight import _group_check

NOT_COORDINATOR, GROUP_AUTHORIZATION_FAILED = 16, 30


class FakeAdmin:
    def __init__(self, codes: list[int]):
        self.codes = codes  # the describe answers' error codes, the last one repeated
        self.describes = 0

    async def find_coordinator(self, group_id):
        return 1

    async def describe_consumer_groups(self, groups, group_coordinator_id):
        code = self.codes[min(self.describes, len(self.codes) - 1)]
        self.describes += 1
        group = {"error_code": code, "state": "Empty", "members": []}
        return [SimpleNamespace(to_object=lambda: {"groups": [group]})]

    async def list_consumer_group_offsets(self, group_id, group_coordinator_id, partitions):
        return {tp: SimpleNamespace(offset=-1) for tp in partitions}


def check(admin, timeout_s=2.0):
    return asyncio.run(_group_check(admin, "inflight-workers", {"inflight.jobs.normal": 2}, timeout_s))


def test_not_coordinator_answers_of_a_fresh_broker_are_asked_again():
    admin = FakeAdmin([NOT_COORDINATOR, NOT_COORDINATOR, 0])
    c = check(admin)
    assert c.status == "pass" and admin.describes == 3, c
    assert "committed offsets on 0 of 2 job partitions" in c.detail


def test_a_coordinator_never_ready_is_not_reported_as_a_permission():
    c = check(FakeAdmin([NOT_COORDINATOR]), timeout_s=0.5)
    assert c.status == "fail" and "coordinator was not ready within 0.5 s" in c.detail, c
    assert "Describe and Read" not in c.detail


def test_a_refused_group_fails_at_once_naming_the_permission():
    admin = FakeAdmin([GROUP_AUTHORIZATION_FAILED])
    c = check(admin)
    assert c.status == "fail" and admin.describes == 1 and "needs Describe and Read on the group" in c.detail, c
