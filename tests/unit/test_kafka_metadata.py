"""The cluster requests every part makes besides producing and consuming
(`worker.security.kafka`): a reachability check and topic lookups whose cost does not
grow with the cluster (a request for no topics, or for the named ones only), that never
ask the broker to auto-create a topic they name, and that try each known broker in turn.
Regression: the gateway's readiness check fetched every topic's metadata every 5 s
(~90 ms of its event loop's CPU per check with 1 600 topics on the dev broker)."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka.errors import KafkaConnectionError, NodeNotReadyError

from worker.security.kafka import existing_topics, partition_ids, ping_cluster, topic_metadata


class Broker:
    def __init__(self, node_id: int) -> None:
        self.nodeId = node_id


class Response:
    def __init__(self, topics: list[dict]) -> None:
        self.brokers = [(1, "127.0.0.1", 9092, None)]
        self._topics = topics

    def to_object(self) -> dict:
        return {"brokers": [], "topics": self._topics}


class FakeClient:
    """An AIOKafkaClient stand-in: known brokers, and the requests sent to each."""

    def __init__(self, nodes: list[int], down: set[int] = frozenset(), topics: list[dict] | None = None) -> None:
        self.nodes, self.down, self.topics = nodes, down, topics or []
        self.sent: list[tuple[int, object]] = []
        self.cluster = self

    def brokers(self) -> list[Broker]:
        return [Broker(n) for n in self.nodes]

    async def send(self, node: int, request) -> Response:
        self.sent.append((node, request))
        if node in self.down:
            raise NodeNotReadyError(f"node {node} is down")
        return Response(self.topics)


def asked(request) -> tuple[list[str] | None, bool | None]:
    return request._topics, request._allow_auto_topic_creation


@pytest.mark.parametrize("attr", ["client", "_client", None])  # producer, consumer / admin, the client itself
def test_ping_asks_for_no_topics_and_never_for_auto_creation(attr):
    inner = FakeClient([1])
    holder = inner if attr is None else type("Holder", (), {attr: inner})()
    asyncio.run(ping_cluster(holder))
    [(node, request)] = inner.sent
    assert node == 1
    assert asked(request) == ([], False)  # [] is no topics from Metadata v1 on; None would be all of them


def test_ping_tries_every_known_broker_then_raises_the_last_error():
    inner = FakeClient([1, 2, 3], down={1, 3})
    asyncio.run(ping_cluster(inner))
    assert 2 in [n for n, _ in inner.sent]  # some order reached the broker that answers
    every = FakeClient([1, 2], down={1, 2})
    with pytest.raises(NodeNotReadyError):
        asyncio.run(ping_cluster(every))
    assert sorted(n for n, _ in every.sent) == [1, 2]
    with pytest.raises(KafkaConnectionError, match="no Kafka broker is known"):
        asyncio.run(ping_cluster(FakeClient([])))


def test_topic_lookups_name_only_the_wanted_topics():
    topics = [{"topic": "a", "error_code": 0, "partitions": [{"partition": 0}, {"partition": 2}]},
              {"topic": "gone", "error_code": 3, "partitions": []},
              {"topic": "hidden", "error_code": 29, "partitions": []}]
    inner = FakeClient([7], topics=topics)
    assert asyncio.run(existing_topics(inner, ["a", "gone", "hidden"])) == {"a"}
    assert asyncio.run(partition_ids(inner, "a")) == {0, 2}
    assert [t["topic"] for t in asyncio.run(topic_metadata(inner, ("a", "gone")))] == ["a", "gone", "hidden"]
    assert [asked(r) for _, r in inner.sent] == [(["a", "gone", "hidden"], False), (["a"], False),
                                                 (["a", "gone"], False)]


def test_the_gateways_kafka_readiness_check_is_the_ping():
    """InflightClient.ping_kafka (the gateway's `kafka` readiness probe, every 5 s) asks
    for no topics: it fetched all of them before."""
    from worker.client.inflight import InflightClient

    inner = FakeClient([1])
    client = InflightClient("127.0.0.1:1", "redis://127.0.0.1:1/0")
    client._producer = type("Producer", (), {"client": inner})()  # started: _kafka() returns it
    asyncio.run(client.ping_kafka())
    assert [asked(r) for _, r in inner.sent] == [([], False)]
