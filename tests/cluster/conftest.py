"""Faults of a replicated cluster (tools/stack/cluster.sh on free ports: three KRaft nodes,
a Redis master with a replica behind three Sentinels), one stack for the suite. The suite
starts three JVMs and kills nodes, so it runs only when asked for:

    .venv/bin/python -m pytest -m cluster tests/cluster        # about 8 minutes

Every test leaves the stack whole (all nodes up, replicas in sync) for the next."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from tests.integration.conftest import reap_spawned  # noqa: F401  (the worker processes a test spawned)


def pytest_collection_modifyitems(config, items):
    if "cluster" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="the cluster fault suite runs with -m cluster (three JVMs, nodes killed)")
    for item in items:
        if item.get_closest_marker("cluster"):
            item.add_marker(skip)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The stack for one test module (stopped after it: the soak's module starts its own)."""
    from tools.stack.cluster_stack import ClusterStack

    stack = ClusterStack(tmp_path_factory.mktemp("cluster"), partitions=3)
    stack.up()
    yield stack
    stack.down()


@pytest.fixture
def cluster_prefix(cluster) -> str:
    """A fresh topic/key prefix: job topics of one partition (so a test knows which
    broker leads its job), replication factor 3."""
    from worker.cli.topics import create_topics

    p = f"c{uuid.uuid4().hex[:10]}"
    asyncio.run(create_topics(cluster.bootstrap, p, partitions=1, replication_factor=3))
    return p


@pytest.fixture
def whole(cluster):
    """After the test: every node running and every replica in sync again."""
    yield cluster
    cluster.up()
    asyncio.run(cluster.wait_in_sync(["inflight.jobs.normal"]))
