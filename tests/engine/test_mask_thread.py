"""Where a CPU engine's structured-output masks are filled (worker/model/masks.py
`fill_beside_forward`): on a thread of their own while the forward runs when torch's
intra-op threads leave a core (an engine process under the worker's thread budget), else
after the forward; either way the same masks, so the same tokens."""

from __future__ import annotations

import pytest
import torch

import worker.model.masks as masks
from schemas.params import SamplingParams
from tests.engine.test_closing import SCHEMA, valid
from tests.engine.test_structured import PROMPTS, constrained, make_engine


def run(engine, monkeypatch, cpus: int) -> tuple[list, int]:
    """Outputs of greedy and seeded constrained requests (some cut by closing near their
    limit) with `cpus` usable CPUs, and how many steps filled their masks beside the forward."""
    monkeypatch.setattr(masks, "_usable_cpus", lambda: cpus)
    started = []
    real = masks.start_token_bitmask
    monkeypatch.setattr("worker.model.runner.start_token_bitmask",
                        lambda *a: started.append(1) or real(*a))
    params = [constrained(SCHEMA, seed=None if i % 2 else i, max_tokens=30 + 7 * (i % 3)) for i in range(6)]
    params.append(SamplingParams(max_tokens=12, temperature=0.0))  # an unconstrained row beside them
    outs = engine.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params)
    return outs, len(started)


def test_masks_filled_beside_the_forward_give_the_tokens_of_masks_filled_after_it(llama_path, monkeypatch):
    engine = make_engine(llama_path)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        beside, threaded = run(engine, monkeypatch, cpus=2)  # a core left beside torch's one thread
        after, unthreaded = run(engine, monkeypatch, cpus=1)  # none: filled after the forward
    finally:
        torch.set_num_threads(before)
    assert threaded > 0 and unthreaded == 0
    assert [o.token_ids for o in beside] == [o.token_ids for o in after]
    assert all(valid(o.text) for o in beside[:-1])  # closing ran on the mask thread too


@pytest.mark.parametrize("device, threads, cpus, expected", [
    ("cpu", 2, 2, False),  # an engine alone with torch's default threads: after the forward
    ("cpu", 1, 2, True),   # the worker's engine process on two cores
    ("cpu", 7, 8, True),
    ("cuda", 8, 8, True),  # the forward thread waits for the device
])
def test_the_rule(monkeypatch, device, threads, cpus, expected):
    monkeypatch.setattr(masks, "_usable_cpus", lambda: cpus)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    assert masks.fill_beside_forward(torch.device(device)) is expected
