"""Transient Kafka conditions: info at first, one warning once they outlast the grace,
everything else untouched (worker/obs/transient_log.py)."""

from __future__ import annotations

import io
import json
import logging

import structlog

from worker.obs import transient_log
from worker.obs.log import setup_logging
from worker.obs.transient_log import TransientEpisodes, TransientLogFilter, transient_kind

COORD = ("Group Coordinator Request failed: %s", ("[Error 15] GroupCoordinatorNotAvailableError",))
REBALANCE = ("Heartbeat failed for group %s because it is rebalancing", ("g1",))


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def record(name: str, level: int, msg_args: tuple, exc_info=None) -> logging.LogRecord:
    msg, args = msg_args
    return logging.LogRecord(name, level, __file__, 1, msg, args, exc_info)


def test_messages_seen_from_aiokafka_are_classified():
    assert transient_kind("Group Coordinator Request failed: [Error 15] GroupCoordinatorNotAvailableError") \
        == "coordinator_unavailable"
    assert transient_kind("Group Coordinator Request failed: NodeNotReadyError: Attempt to send a request to node "
                          "which is not ready (node id 1).") == "broker_unreachable"
    assert transient_kind("Unable connect to node with id 1: [Errno 111] Connect call failed ('127.0.0.1', 29092)") \
        == "broker_unreachable"
    assert transient_kind("Heartbeat failed for group g because it is rebalancing") == "rebalance"
    assert transient_kind("OffsetCommit failed for group g due to group error ([Error 27] RebalanceInProgressError: "
                          "g), will rejoin") == "rebalance"
    assert transient_kind("Topic inflight.cancel not found in cluster metadata") == "topic_metadata"
    assert transient_kind("Unexpected error in coordinator routine") is None
    assert transient_kind("OffsetCommit failed for group g - GroupAuthorizationFailedError") is None


def test_episode_info_then_debug_then_one_warning_then_new_episode():
    clock = Clock()
    f = TransientLogFilter(TransientEpisodes(grace_s=30.0, clock=clock), min_level=logging.INFO)
    name = "aiokafka.consumer.group_coordinator"

    def emit(at: float, msg_args=COORD, level=logging.ERROR) -> tuple[bool, str, logging.LogRecord]:
        clock.t = 1000.0 + at
        r = record(name, level, msg_args)
        return f.filter(r), r.levelname, r

    passed, level, r = emit(0.0)
    assert (passed, level, r.transient) == (True, "INFO", "coordinator_unavailable")
    assert emit(0.1)[:2] == (False, "DEBUG")  # repeats of the episode: dropped at INFO
    assert emit(0.2, REBALANCE, logging.WARNING)[:2] == (True, "INFO")  # another kind: its own episode
    assert emit(29.9)[:2] == (False, "DEBUG")
    passed, level, r = emit(30.0)
    assert (passed, level, r.persisted_s) == (True, "WARNING", 30.0)  # outlasted the grace: once
    assert emit(31.0)[:2] == (False, "DEBUG")
    assert emit(59.0)[:2] == (False, "DEBUG")
    assert emit(89.5)[:2] == (True, "INFO")  # silent for more than the grace: a new episode


def test_other_records_pass_unchanged():
    f = TransientLogFilter(TransientEpisodes(grace_s=30.0, clock=Clock()))
    cases = [
        record("aiokafka.consumer.group_coordinator", logging.ERROR, ("Unexpected error in coordinator routine", ())),
        record("worker.serve.intake", logging.ERROR, COORD),  # our own lines opt in through observe()
        record("aiokafka.consumer.group_coordinator", logging.ERROR, COORD,
               exc_info=(RuntimeError, RuntimeError("x"), None)),  # a traceback is never hidden
    ]
    for r in cases:
        assert f.filter(r) and r.levelno == logging.ERROR and not hasattr(r, "transient")


def test_rendered_through_setup_logging_and_shared_with_our_own_lines():
    buf = io.StringIO()
    setup_logging("INFO", json=True, stream=buf, transient_grace_s=30.0)
    try:
        logging.getLogger("aiokafka.consumer.group_coordinator").error(*COORD[:1], *COORD[1])
        logging.getLogger("aiokafka").error("Unable connect to node with id 1: [Errno 111] Connect call failed")
        level, fields = transient_log.observe("broker_unreachable")  # same episode as the line above
        structlog.get_logger("worker.serve.intake").log(level, "stall check could not reach Kafka", **fields)
        logging.getLogger("aiokafka").error("Unexpected error in coordinator routine")
    finally:
        setup_logging("INFO")
    lines = [json.loads(x) for x in buf.getvalue().splitlines()]
    assert [(x["level"], x.get("transient")) for x in lines] == [
        ("info", "coordinator_unavailable"),
        ("info", "broker_unreachable"),
        ("error", None),
    ]
    assert "GroupCoordinatorNotAvailableError" in lines[0]["event"]
