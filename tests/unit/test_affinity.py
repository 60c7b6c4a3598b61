"""Prefix affinity (`schemas/affinity.py`, `worker/client/affinity.py`): the head's exact
bytes (the recipe other producers follow, pinned with a test vector), which jobs get a
prefix, and the spread rule's partition loads."""

from __future__ import annotations

import math
import random
from collections import Counter

from schemas.affinity import affinity_partition, blake8, prefix_hash, prompt_head
from schemas.wire import ChatMessage, Job, ToolCall, ToolCallFunction
from worker.client.affinity import HEADROOM, MIN_WINDOW, PrefixAffinity

SYSTEM = "You are a careful assistant. " * 40  # 1160 bytes


def chat(job_id: str, system: str, user: str, tools: list | None = None) -> Job:
    return Job(job_id=job_id, messages=[ChatMessage(role="system", content=system),
                                        ChatMessage(role="user", content=user)], tools=tools)


def test_the_head_bytes_follow_the_recipe():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    call = ToolCall(id="c1", function=ToolCallFunction(name="get_weather", arguments='{"city":"Oslo"}'))
    job = Job(job_id="j", tools=tools, messages=[
        ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Météo ?"),
        ChatMessage(role="assistant", content=None, tool_calls=[call])])
    assert prompt_head(job) == ("tool\0get_weather\0system\0Be brief.\0user\0Météo ?\0assistant\0\0"
                                'get_weather\0{"city":"Oslo"}\0').encode()
    assert prompt_head(Job(job_id="j", prompt="héllo")) == "héllo".encode()
    assert prompt_head(Job(job_id="j", prompt_token_ids=[1, 256, 70000])) == bytes(
        [1, 0, 0, 0, 0, 1, 0, 0, 0x70, 0x11, 0x01, 0])
    # the test vector docs/concepts.md gives producers in other languages
    assert blake8(b"hello") == 0xA7B6EDA801E5347D
    assert prefix_hash(Job(job_id="j", prompt="hello world"), 5) == 0xA7B6EDA801E5347D


def test_jobs_sharing_the_first_bytes_share_a_prefix():
    a = prefix_hash(chat("a", SYSTEM, "What is 2 + 2?"), 1024)
    b = prefix_hash(chat("b", SYSTEM, "Write a haiku."), 1024)
    other = prefix_hash(chat("c", SYSTEM.replace("careful", "cheerful"), "What is 2 + 2?"), 1024)
    assert a is not None and a == b and other not in (None, a)
    assert prefix_hash(chat("d", "Short system prompt.", "Hi"), 1024) is None  # head shorter: by job id
    assert prefix_hash(chat("a", SYSTEM, "x"), 0) is None  # off


def test_a_prefix_is_spread_over_consecutive_partitions():
    parts = {affinity_partition(10, f"job-{i}", 3, 8) for i in range(200)}
    assert parts == {2, 3, 4}  # 10 % 8 = 2, then the next two
    assert {affinity_partition(10, f"job-{i}", 1, 8) for i in range(50)} == {2}
    assert {affinity_partition(10, f"job-{i}", 99, 4) for i in range(200)} == {0, 1, 2, 3}


def test_evenly_used_prefixes_stay_on_one_partition_each():
    aff = PrefixAffinity(1024, 1000)
    systems = [f"System prompt {i}. " + SYSTEM for i in range(20)]
    where: dict[int, set[int]] = {}
    for n in range(3000):
        s = n % 20
        where.setdefault(s, set()).add(aff.partition("t", chat(f"j{n}", systems[s], f"q{n}"), 3))
    assert all(len(p) == 1 for p in where.values()), where


def test_a_hot_prefix_spreads_and_no_partition_takes_twice_its_share():
    """One prompt takes half the traffic, 19 others share the rest (the issue's case)."""
    rng = random.Random(5)
    systems = [f"System prompt {i}. " + SYSTEM for i in range(20)]
    for num_partitions in (3, 6, 12):
        aff = PrefixAffinity(1024, 1000)
        load: Counter[int] = Counter()
        hot: set[int] = set()
        for n in range(6000):
            s = 0 if rng.random() < 0.5 else rng.randrange(1, 20)
            p = aff.partition("t", chat(f"j{n}", systems[s], f"q{n}"), num_partitions)
            if n >= 1000:  # past the first window
                load[p] += 1
                if s == 0:
                    hot.add(p)
        mean = sum(load.values()) / num_partitions
        k = math.ceil(HEADROOM * 0.5 * num_partitions)  # the window's share moves around 0.5
        assert min(k, num_partitions) <= len(hot) <= min(k + 1, num_partitions), (num_partitions, hot)
        assert max(load.values()) <= 2 * mean, (num_partitions, load)


def test_a_new_producer_does_not_spread_its_first_jobs():
    aff = PrefixAffinity(1024, 1000)
    parts = {aff.partition("t", chat(f"j{n}", SYSTEM, f"q{n}"), 6) for n in range(MIN_WINDOW // 10)}
    assert len(parts) == 1  # 10 of at least 100 counted: 1.5 x 0.1 x 6 <= 1
    assert aff.partition("t", chat("short", "Hi", "there"), 6) is None
