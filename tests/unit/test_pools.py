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


# ---- the worker's side: config, the router's rules -----------------------------------------
def write_config(tmp_path, text: str) -> str:
    path = tmp_path / "worker.yaml"
    path.write_text(text)
    return str(path)


POOLS_YAML = """
pools:
  - {name: default, max_prompt_tokens: 256}
  - {name: long, max_prompt_tokens: 4096}
"""


def test_a_worker_config_names_its_pool_and_gets_its_group(tmp_path):
    from worker.config import load_config

    cfg = load_config(write_config(tmp_path, POOLS_YAML + "worker: {pool: long}\nkafka: {group_id: fleet}\n"))
    assert cfg.pool.name == "long" and cfg.job_group_id == "fleet.long"
    assert load_config(write_config(tmp_path, POOLS_YAML)).job_group_id == "inflight-workers"


@pytest.mark.parametrize("text,message", [
    (POOLS_YAML + "worker: {pool: huge}\n", r"worker.pool must be one of the declared pools \['default', 'long'\]"),
    ("pools:\n  - {name: long, max_prompt_tokens: 9}\n", "pools: .*one named 'default'"),
    ("worker: {pool: long}\n", r"worker.pool must be one of the declared pools \['default'\]"),
])
def test_pool_config_errors_name_the_field(tmp_path, text, message):
    from worker.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(write_config(tmp_path, text))


def test_a_pools_bound_above_the_engines_max_input_tokens_is_a_config_error(tmp_path):
    from worker.config import ConfigError, load_config
    from worker.serve.pool_router import check_pool_limits

    cfg = load_config(write_config(tmp_path, POOLS_YAML + "worker: {pool: long}\n"))
    check_pool_limits(cfg, 4096)
    with pytest.raises(ConfigError, match="pool 'long' serves prompts up to 4096 tokens.*max_input_tokens is 2048"):
        check_pool_limits(cfg, 2048)
    check_pool_limits(load_config(write_config(tmp_path, "{}\n")), 10)  # one unbounded pool: no routing, no check


def test_the_router_forwards_what_its_pool_does_not_hold():
    from worker.serve.pool_router import FORWARD_HOPS, MAX_FORWARD_HOPS, Misrouted, PoolRouter

    default = PoolRouter(TWO, TWO.get("default"), "p")
    default.check(256)
    with pytest.raises(Misrouted) as e:
        default.check(257)
    assert e.value.target.name == "long" and e.value.num_prompt_tokens == 257
    with pytest.raises(Misrouted) as e:
        default.check(5000)
    assert e.value.target is None  # longer than every pool: rejected
    with pytest.raises(Misrouted) as e:
        PoolRouter(TWO, TWO.get("long"), "p").check(10)
    assert e.value.target.name == "default"
    assert default.byte_limit_tokens(256) == 4096  # a prompt too long here may be another pool's
    assert PoolRouter(Pools(), Pools().get("default"), "p").byte_limit_tokens(256) == 256
    assert default.hops(()) == 0 and default.hops(((FORWARD_HOPS, b"1"),)) == 1
    assert default.hops(((FORWARD_HOPS, b"junk"),)) is None and default.hops(((FORWARD_HOPS, b"-10"),)) is None
    to_long = Misrouted(300, TWO.get("long"))
    assert default.why_not_forward(to_long, ()) is None
    assert default.why_not_forward(to_long, ((FORWARD_HOPS, b"1"),)) is None
    assert "forwarded 2 times already" in default.why_not_forward(to_long, ((FORWARD_HOPS, str(MAX_FORWARD_HOPS).encode()),))
    # a mangled or negative count never forwards again (a negative one let a record ping-pong)
    for bad in (b"junk", b"-10"):
        assert "header is not a count of forwards" in default.why_not_forward(to_long, ((FORWARD_HOPS, bad),))
    assert "longest any pool serves is 4096" in default.why_not_forward(Misrouted(5000, None), ())


def test_the_client_routes_by_counted_tokens_else_to_the_default_pool():
    from schemas.wire import ChatMessage, Job
    from worker.client.routing import count_prompt_tokens, pool_for
    from worker.model.null_runner import LetterTokenizer

    tok = LetterTokenizer()
    assert pool_for(TWO, Job(job_id="a", prompt="x" * 300), tok) == "long"
    assert pool_for(TWO, Job(job_id="b", prompt="x" * 10), tok) == "default"
    assert pool_for(TWO, Job(job_id="c", prompt="x" * 300)) == "default"  # cannot count: the default pool forwards
    assert pool_for(TWO, Job(job_id="d", prompt_token_ids=list(range(1, 301)))) == "long"  # ids count as given
    assert pool_for(TWO, Job(job_id="e", prompt="x" * 5000), tok) == "default"  # too long for all: rejected there
    assert pool_for(Pools(), Job(job_id="f", prompt="x" * 5000), tok) == "default"
    assert count_prompt_tokens(Job(job_id="g", messages=[ChatMessage(role="user", content="hello")]), tok) == 5


# ---- refusals in the finalizer's background work stop the worker ----------------------------
def test_a_refused_forward_or_re_record_stops_the_finalizer_loop():
    """A forward to a pool whose topic the principal may not write, or a done job's
    outcome re-recorded to a results topic it may not write, raise `Refused` out of
    `Finalizer.run` (a worker task: the worker stops with exit 5) instead of dying in a
    task of their own and leaving the offset open for good."""
    import asyncio
    from types import SimpleNamespace

    from aiokafka import TopicPartition
    from aiokafka.errors import TopicAuthorizationFailedError

    from schemas.codec import encode
    from schemas.wire import Finished, FinishReason
    from worker.obs.metrics import Metrics
    from worker.security.access import Refused
    from worker.serve.finalize import Finalizer
    from worker.serve.offsets import OffsetTracker
    from worker.serve.pool_router import PoolRouter

    class RefusingProducer:
        async def send_and_wait(self, *args, **kwargs):
            raise TopicAuthorizationFailedError("inflight.jobs.long.normal")

    class RefusingResults:
        async def record(self, outcomes):
            raise Refused(TopicAuthorizationFailedError("inflight.results"))

    def finalizer():
        return Finalizer(table=None, tracker=OffsetTracker(), dead_letters=None, results=RefusingResults(),
                         metrics=Metrics())

    tp = TopicPartition("inflight.jobs.normal", 0)
    held = SimpleNamespace(job_id="j", priority="normal", headers=(), raw=b"{}", raw_key=b"j", claim_token="t",
                           attempt=1, offsets=[SimpleNamespace(tp=tp, offset=5)])
    router = PoolRouter(TWO, TWO.get("default"), "inflight", RefusingProducer())

    async def run(setup) -> BaseException:
        fin = finalizer()
        setup(fin)
        try:
            async with asyncio.timeout(5):
                await fin.run()
        except BaseException as e:  # noqa: BLE001  (what stopped the loop)
            return e
        raise AssertionError("the loop did not stop")

    class Claims:
        async def unclaim(self, claims):
            pass

    err = asyncio.run(run(lambda fin: fin.forward(held, TWO.get("long"), router, claims=Claims())))
    assert isinstance(err, Refused), err
    done = Finished(job_id="j", seq=3, attempt=1, finish_reason=FinishReason.LENGTH)
    err = asyncio.run(run(lambda fin: fin.settle(tp, 5, "j", (encode(done),))))
    assert isinstance(err, Refused), err


def test_a_pool_bound_the_models_context_cannot_hold_says_so(tmp_path):
    from worker.config import ConfigError, load_config
    from worker.serve.pool_router import check_pool_limits

    cfg = load_config(write_config(tmp_path, POOLS_YAML + "worker: {pool: long}\n"))
    with pytest.raises(ConfigError, match=r"max_input_tokens is 2047; the model's context \(2048 tokens\) cannot "
                                          r"hold such prompts: lower the pool's max_prompt_tokens to 2047"):
        check_pool_limits(cfg, 2047, 2048)
    with pytest.raises(ConfigError, match="max_input_tokens is 1024; raise serving_tuning.max_input_tokens"):
        check_pool_limits(cfg, 1024, 8192)
