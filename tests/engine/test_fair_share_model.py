"""The fair-share scenarios of tests/unit/test_fair_share.py on the tiny real model
(fp32, CPU): the same bounds and shares hold when real forwards produce the tokens."""

from __future__ import annotations

import pytest

from tests.unit import test_fair_share as scenarios
from worker.config import EngineConfig, ModelConfig
from worker.engine import Engine


@pytest.fixture(scope="module")
def make_engine(llama_path):
    def make(**over):
        cfg = EngineConfig(model=ModelConfig(dtype="float32", device="cpu"), serving_tuning=scenarios.tuning(**over))
        return Engine.from_pretrained(str(llama_path), cfg)

    return make


def test_light_tenant_starts_within_the_bound_behind_a_backlogged_one(make_engine):
    scenarios.test_light_tenant_starts_within_the_bound_behind_a_backlogged_one(make_engine)


@pytest.mark.parametrize("weights", [(1, 1), (3, 1)])
def test_backlogged_tenants_converge_to_their_weights(weights, make_engine):
    scenarios.test_backlogged_tenants_converge_to_their_weights(weights, make_engine)


def test_a_tenant_idle_then_bursting_does_not_starve_the_others(make_engine):
    scenarios.test_a_tenant_idle_then_bursting_does_not_starve_the_others(make_engine)
