"""`inflight stream`'s notice for a job nothing knows of (worker/cli/commands.py), with a
stand-in client: said once when no log, claim, attempt count or results record exists;
not said when one does, or when an event came."""

from __future__ import annotations

import asyncio

import pytest

from worker.cli import commands


class Redis:
    def __init__(self, existing: int) -> None:
        self.existing = existing
        self.asked: list[tuple[str, ...]] = []

    async def exists(self, *names: str) -> int:
        self.asked.append(names)
        return self.existing


class Client:
    key_prefix = "p"

    def __init__(self, existing: int = 0, recorded: bool = False) -> None:
        self.redis = Redis(existing)
        self.recorded = recorded

    async def lookup_results(self, job_ids, timeout_s):
        return {j: object() for j in job_ids} if self.recorded else {}


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(commands, "UNKNOWN_NOTICE_S", 0.01)


def notice(client, seen=(), tenant=None) -> None:
    async def run():
        await commands._notice_if_unknown(client, "j1", tenant, 30.0, list(seen))
    asyncio.run(run())


def test_an_unknown_job_is_said_so_once(capsys):
    client = Client()
    notice(client, tenant="acme")
    err = capsys.readouterr().err
    assert err.startswith("[nothing known of job j1 yet: no event log, no claim, no results record; still waiting "
                          "up to 30 s in all")
    assert client.redis.asked == [("p:t:acme:job:j1:log", "p:job:j1:claim", "p:job:j1:attempts")]


@pytest.mark.parametrize("client,seen", [(Client(existing=1), ()), (Client(recorded=True), ()), (Client(), ("ev",))],
                         ids=["a key exists", "a results record", "an event came"])
def test_a_known_job_or_a_stream_with_events_says_nothing(client, seen, capsys):
    notice(client, seen)
    assert capsys.readouterr().err == ""
