"""The LoRA slot table (worker/engine/lora_slots.py) and the grouped delta
(worker/model/lora.py) without a model: LRU eviction, pins, the per-batch cap, loads
off the caller's thread, failures; the delta against a per-token loop."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.engine.lora_slots import Admission, LoRASlots
from worker.model.lora import add_lora_delta, build_step


class Loader:
    """Loads that finish when the test says so (`release`)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.gates: dict[str, threading.Event] = {}
        self.fail: set[str] = set()

    def __call__(self, name: str):
        self.calls.append(name)
        self.gates.setdefault(name, threading.Event()).wait(5)
        if name in self.fail:
            raise ValueError(f"{name} is broken")
        return {"w": name}, 10

    def release(self, *names: str) -> None:
        for n in names:
            self.gates.setdefault(n, threading.Event()).set()


def ready(slots: LoRASlots, loader: Loader, *names: str) -> None:
    for n in names:
        assert slots.admit(n) is Admission.WAIT
    loader.release(*names)
    slots.wait_loads(5)
    for n in names:
        assert slots.admit(n) is Admission.READY


def test_a_load_runs_off_the_callers_thread_and_the_request_waits_meanwhile():
    loader = Loader()
    slots = LoRASlots(2, None, loader)
    assert slots.admit("a") is Admission.WAIT  # returns at once: the load is on the loader thread
    assert slots.admit("a") is Admission.WAIT and loader.calls == ["a"]  # one load, however often asked
    loader.release("a")
    slots.wait_loads(5)
    assert slots.admit("a") is Admission.READY
    stats = slots.step_stats()
    assert (stats.resident, stats.loads, len(stats.load_s)) == (1, 1, 1)
    assert slots.step_stats().loads == 0  # counts are per call
    slots.close()


def test_lru_evicts_the_least_recently_used_unpinned_adapter_only():
    loader = Loader()
    slots = LoRASlots(2, None, loader)
    ready(slots, loader, "a", "b")
    slot_a = slots.pin("a")
    slots.pin("b")
    slots.unpin("b")  # b idle, a pinned
    assert slots.admit("c") is Admission.WAIT  # evicts b (a is pinned)
    assert "b" not in slots.resident and "a" in slots.resident
    assert slots.admit("d") is Admission.BLOCKED  # a pinned, c loading: no slot
    loader.release("c")
    slots.wait_loads(5)
    slots.unpin("a")
    slots.pin("c")
    slots.unpin("c")  # now a is the least recently used
    assert slots.admit("d") is Admission.WAIT
    assert set(slots.resident) == {"c"} and slots.step_stats().evictions == 2
    loader.release("d")
    slots.wait_loads(5)
    assert slots.resident["d"].slot == slot_a and slots.resident["d"].load_id > 2  # a new load in a's slot


def test_the_per_batch_cap_blocks_other_adapters_but_not_more_of_the_same():
    loader = Loader()
    slots = LoRASlots(3, 1, loader)
    ready(slots, loader, "a", "b")
    slots.pin("a")
    assert slots.admit("a") is Admission.READY
    assert slots.admit("b") is Admission.BLOCKED
    slots.unpin("a")
    assert slots.admit("b") is Admission.READY


def test_a_failed_load_is_reported_once_and_frees_its_slot():
    loader = Loader()
    loader.fail.add("bad")
    slots = LoRASlots(1, None, loader)
    assert slots.admit("bad") is Admission.WAIT
    loader.release("bad")
    slots.wait_loads(5)
    assert slots.admit("bad") is Admission.FAILED and slots.has_failures
    ended = []

    class Sched:
        requests = {}

    slots.end_failed(Sched(), lambda req, err: ended.append(err))
    assert not slots.has_failures and slots.step_stats().failures == 1
    assert slots.admit("good") is Admission.WAIT  # the slot came back


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-1, 3), min_size=1, max_size=40), st.integers(0, 2**16))
def test_the_grouped_delta_equals_a_per_token_loop(token_slots, seed):
    g = torch.Generator().manual_seed(seed)
    n_in, n_out, rank, loras = 12, 10, 5, 4
    x = torch.randn(len(token_slots), n_in, generator=g, dtype=torch.float64)
    a = torch.randn(loras, n_in, rank, generator=g, dtype=torch.float64)  # A^T per slot
    b = torch.randn(loras, rank, n_out, generator=g, dtype=torch.float64)  # B^T per slot
    want = torch.zeros(len(token_slots), n_out, dtype=torch.float64)
    for i, s in enumerate(token_slots):
        if s >= 0:
            want[i] = b[s].T @ (a[s].T @ x[i])
    step = build_step(token_slots, torch.device("cpu"), max_loras=loras if seed % 2 else None)
    got = torch.zeros_like(want)
    if step is not None:
        add_lora_delta(x, got, a, b, step)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("token_slots", [[-1, -1], [2, 2, 2], [0, -1, 1, 0]])
def test_build_step_shapes(token_slots):
    step = build_step(token_slots, torch.device("cpu"))
    if all(s < 0 for s in token_slots):
        assert step is None
    elif len(set(token_slots)) == 1:
        assert step.single == token_slots[0]
    else:
        assert step.single is None and step.src.tolist() == [0, 3, 2, 4] and step.max_n == 2
        assert step.dst.tolist() == [0, 3, 2, 0]


def test_loads_evictions_and_failures_are_logged(caplog):
    """An operator sees which adapters come and go (issue 49: the worker logged nothing)."""
    caplog.set_level("INFO", logger="worker.engine.lora_slots")
    loader = Loader()
    loader.fail.add("bad")
    slots = LoRASlots(1, None, loader)
    ready(slots, loader, "a")
    assert slots.admit("b") is Admission.WAIT  # evicts a
    loader.release("b")
    slots.wait_loads(5)
    slots.admit("b")
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith("LoRA adapter 'a' loaded into slot 0 (10 parameters, ")
    assert messages[1] == "LoRA adapter 'a' evicted from slot 0 (least recently used) for 'b'"
    assert messages[2].startswith("LoRA adapter 'b' loaded into slot 0")
    slots.close()
    caplog.clear()
    failing = LoRASlots(1, None, loader)
    assert failing.admit("bad") is Admission.WAIT
    loader.release("bad")
    failing.wait_loads(5)
    assert [r.getMessage() for r in caplog.records] == ["LoRA adapter 'bad' did not load: ValueError: bad is broken"]
    failing.close()
