"""Pools by prompt length (schemas/pools.py): validation naming the pool, the routing
rule at the range edges, topics and consumer groups."""

from __future__ import annotations

import pytest

from schemas import keys
from schemas.pools import Pool, Pools

TWO = Pools([Pool(name="default", max_prompt_tokens=256), Pool(name="long", max_prompt_tokens=4096)])


def test_routing_at_the_range_edges():
    assert [TWO.route(n).name for n in (1, 256, 257, 4096)] == ["default", "default", "long", "long"]
    assert TWO.route(4097) is None  # longer than every pool
    default, long = TWO.get("default"), TWO.get("long")
    assert (TWO.min_prompt_tokens(default), TWO.min_prompt_tokens(long)) == (1, 257)
    assert TWO.holds(default, 256) and not TWO.holds(default, 257)
    assert TWO.holds(long, 257) and not TWO.holds(long, 256) and not TWO.holds(long, 4097)
    assert TWO.routes and TWO.max_prompt_tokens == 4096


def test_no_pools_is_one_unbounded_default_pool():
    one = Pools()
    assert one.names == ["default"] and not one.routes and one.route(10**9).name == "default"
    assert one.max_prompt_tokens is None


def test_topics_and_groups():
    assert keys.job_topic("inflight", "high") == "inflight.jobs.high"
    assert keys.job_topic("inflight", "high", "default") == "inflight.jobs.high"
    assert keys.job_topic("inflight", "low", "long") == "inflight.jobs.long.low"
    assert keys.all_topics("p", TWO)[:6] == ["p.jobs.high", "p.jobs.normal", "p.jobs.low", "p.jobs.long.high",
                                             "p.jobs.long.normal", "p.jobs.long.low"]
    assert keys.all_topics("p")[-3:] == ["p.cancel", "p.dlq", "p.results"]
    assert TWO.group_id(TWO.get("default"), "g") == "g" and TWO.group_id(TWO.get("long"), "g") == "g.long"
    own = Pools([Pool(name="default"), ])
    assert own.group_id(own.get("default"), "g") == "g"
    assert Pools([Pool(name="default", max_prompt_tokens=9), Pool(name="x", group_id="gx")]).group_id(
        Pool(name="x", group_id="gx"), "g") == "gx"


@pytest.mark.parametrize("pools,message", [
    ([Pool(name="long", max_prompt_tokens=9)], "one named 'default'"),
    ([Pool(name="default", max_prompt_tokens=9), Pool(name="default", max_prompt_tokens=99)], "declared twice"),
    ([Pool(name="default", max_prompt_tokens=99), Pool(name="long", max_prompt_tokens=9)], "increasing"),
    ([Pool(name="default"), Pool(name="long", max_prompt_tokens=9)], "must be the last"),
    ([Pool(name="default", max_prompt_tokens=0)], ">= 1"),
    ([Pool(name="Long.X"), Pool(name="default")], "1-32 characters"),
])
def test_invalid_pools_are_refused_naming_the_pool(pools, message):
    with pytest.raises(ValueError, match=message):
        Pools(pools)


def test_an_unknown_pool_name_lists_the_declared_ones():
    with pytest.raises(ValueError, match=r"unknown pool 'huge'.*\['default', 'long'\]"):
        TWO.get("huge")
