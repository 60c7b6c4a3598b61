"""The workers' sticky assignor (`worker/serve/sticky.py`): balanced per topic, a
partition stays with its worker across rebalances where balance allows, conflicting or
foreign claims are dealt again, and its join metadata round-trips."""

from __future__ import annotations

import random

from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment

from worker.serve.sticky import StickyAssignor, _decode_claims, assign_sticky

TOPICS = {"jobs.high": list(range(3)), "jobs.normal": list(range(3)), "jobs.low": list(range(3))}


def counts(plan, topic):
    return sorted(len(plan[m].get(topic, [])) for m in plan)


def rebalance(plan, members):
    """The next round: every member in `members` claims what it held in `plan`."""
    subscribed = {m: set(TOPICS) for m in members}
    return assign_sticky(TOPICS, subscribed, {m: plan.get(m, {}) for m in members})


def moved(before, after):
    """Partitions taken from a worker that is still there (a gone worker's must move)."""
    owner = {(t, p): m for m, tps in before.items() for t, ps in tps.items() for p in ps}
    return sum(1 for m, tps in after.items() for t, ps in tps.items() for p in ps
               if owner.get((t, p)) in after and owner[(t, p)] != m)


def test_each_topic_is_spread_over_the_workers():
    plan = rebalance({}, ["w1", "w2", "w3"])
    for t in TOPICS:
        assert counts(plan, t) == [1, 1, 1]
    plan2 = rebalance({}, ["w1", "w2"])
    assert all(counts(plan2, t) == [1, 2] for t in TOPICS)
    totals = sorted(sum(len(ps) for ps in plan2[m].values()) for m in plan2)
    assert totals == [4, 5]  # the odd partitions go to different workers


def test_a_worker_leaving_or_joining_moves_only_what_it_must():
    plan = rebalance({}, ["w1", "w2", "w3"])
    left = rebalance(plan, ["w1", "w3"])  # w2 left: only its 3 partitions move
    assert moved(plan, left) == 0
    assert all(counts(left, t) == [1, 2] for t in TOPICS)
    back = rebalance(left, ["w1", "w3", "w4"])  # a new worker takes one partition of each topic
    assert moved(left, back) == 3 and all(counts(back, t) == [1, 1, 1] for t in TOPICS)


def test_conflicting_or_unknown_claims_are_dealt_again():
    claims = {"w1": {"jobs.high": [0, 1]}, "w2": {"jobs.high": [1, 2], "jobs.gone": [0]}, "w3": {"jobs.high": [7]}}
    plan = assign_sticky({"jobs.high": [0, 1, 2]}, {m: {"jobs.high"} for m in claims}, claims)
    assert plan["w1"]["jobs.high"] == [0] and plan["w2"]["jobs.high"] == [2]  # 1 claimed twice: nobody keeps it
    assert sorted(p for m in plan for p in plan[m].get("jobs.high", [])) == [0, 1, 2]


def test_random_rounds_stay_balanced_and_complete():
    rng = random.Random(11)
    plan: dict = {}
    members = ["w1", "w2"]
    for _ in range(200):
        if rng.random() < 0.5 and len(members) < 6:
            members.append(f"w{rng.randrange(100, 999)}")
        elif len(members) > 1:
            members.remove(rng.choice(members))
        new = rebalance(plan, members)
        for t, parts in TOPICS.items():
            got = sorted(p for m in new for p in new[m].get(t, []))
            assert got == parts
            c = counts(new, t)
            assert c[-1] - c[0] <= 1
        totals = [sum(len(ps) for ps in new[m].values()) for m in new]
        assert max(totals) - min(totals) <= 1, new
        plan = new


def test_metadata_carries_the_claims():
    a = StickyAssignor()
    a.on_assignment(ConsumerProtocolMemberAssignment(0, [("jobs.high", [2, 0])], b""))
    md = a.metadata(["jobs.high"])
    b = StickyAssignor()
    plan = assign_sticky({"jobs.high": [0, 1, 2]}, {"a": {"jobs.high"}, "b": {"jobs.high"}},
                         {"a": _decode_claims(md.user_data), "b": {}})
    assert plan["a"]["jobs.high"] == [0, 2] and plan["b"]["jobs.high"] == [1]
    assert b.claims == {} and a.strategy()[0] is a


def test_more_workers_than_a_topics_partitions_still_share_the_partitions():
    """3 topics of 3 partitions over 4 workers: per topic one worker gets none, but not the
    same worker each time (no idle worker); a fourth joining moves only what it takes."""
    plan = rebalance({}, ["w1", "w2", "w3"])
    four = rebalance(plan, ["w1", "w2", "w3", "w4"])
    totals = sorted(sum(len(ps) for ps in four[m].values()) for m in four)
    assert totals == [2, 2, 2, 3], four
    assert all(counts(four, t) == [0, 1, 1, 1] for t in TOPICS)
    assert moved(plan, four) == 2
