"""Which LoRA adapters are resident, in which device slot, and which the running batch
uses: the scheduler's side of multi-LoRA serving (S-LoRA, Sheng et al. 2023; Punica,
Chen et al. 2023; vLLM's and SGLang's adapter managers).

`max_loras` slots. An adapter is LOADING (its weights read from disk on the loader
thread, never on the step path), then READY (its weights in host memory; the runner
copies them into the slot's device buffers before the first step that uses them,
`worker.model.lora.LoRAWeights`). A running request pins its adapter; a READY adapter
that no running request pins may be evicted, least recently used first, when another
needs its slot. `max_loras_per_batch` caps the distinct adapters the running batch
holds.

Admission (`admit`), for a waiting request of adapter X:
  READY    X is resident and the cap allows it: admit it (`pin` when it runs).
  WAIT     X is loading (or a load just started): it waits without counting an
           admission skip, and later requests pass it (a load never holds the batch).
  BLOCKED  the cap is reached by other adapters, or every slot is pinned: it counts a
           skip like a request that does not fit, so bounded skipping (scheduler.py)
           makes it hold the admission reservation in time: the batch's adapters drain
           and X gets its turn (never starved).
  FAILED   X's load raised: the engine ends its waiting requests with an error
           (`end_failed`); a later request tries again.

Writer: the Scheduler (engine thread); the loader thread only fills futures.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from worker.engine.outputs import LoRAStepStats
from worker.engine.request import ErrorCode, RequestStatus

log = logging.getLogger(__name__)


class Admission(enum.Enum):
    READY = "ready"
    WAIT = "wait"
    BLOCKED = "blocked"
    FAILED = "failed"


@dataclass(slots=True)
class ResidentAdapter:
    """A READY adapter: `weights` (host tensors, `worker.model.lora.read_adapter`) for
    `slot`; `load_id` tells the runner whether the slot already holds this load."""

    name: str
    slot: int
    weights: Any
    load_id: int
    num_params: int = 0



class LoRASlots:
    """The device slots of LoRA adapters: which are resident, pinned by running requests, loading; LRU eviction.

    Args:
        max_loras: device slots (`model.max_loras`).
        max_per_batch: distinct adapters in the running batch (`max_loras_per_batch`).
        max_admission_skips: `serving_tuning.max_admission_skips` (see `hold`).
        load: adapter name -> (weights, num_params); runs on the loader thread; raises on
            a bad adapter (its message ends the waiting requests).
    """

    def __init__(self, max_loras: int, max_per_batch: int | None, load: Callable[[str], tuple[Any, int]],
                 max_admission_skips: int = 8) -> None:
        self.max_loras = max_loras
        self.max_per_batch = max_per_batch or max_loras
        self.max_admission_skips = max_admission_skips
        self._load = load
        self._free = list(range(max_loras - 1, -1, -1))
        self._loading: dict[str, tuple[int, Future, float]] = {}  # name -> (slot, future, start)
        self.resident: dict[str, ResidentAdapter] = {}
        self._pins: Counter[str] = Counter()
        self._idle: OrderedDict[str, None] = OrderedDict()  # resident, unpinned: eviction order (LRU first)
        self._failures: dict[str, str] = {}
        self._load_ids = itertools.count(1)
        self._executor: ThreadPoolExecutor | None = None
        self._counts = [0, 0, 0]  # loads, evictions, failed loads not yet in a step_stats()
        self._load_s: list[float] = []

    # ---- queries ---------------------------------------------------------------------
    @property
    def loading(self) -> bool:
        """Whether a load is under way."""
        return bool(self._loading)

    def step_stats(self) -> LoRAStepStats:
        """Resident and active adapters now; loads, evictions, failures since the last call."""
        (loads, evictions, failures), load_s = self._counts, self._load_s
        self._counts, self._load_s = [0, 0, 0], []
        return LoRAStepStats(len(self.resident), len(self._pins), loads, evictions, failures, load_s)

    # ---- admission -------------------------------------------------------------------
    def admit(self, name: str) -> Admission:
        """Whether a waiting request of adapter `name` may join the batch now (see the
        module docstring); starts its load when it needs one and a slot can be had."""
        self.poll()
        if name in self._failures:
            return Admission.FAILED
        if name in self.resident:
            if name not in self._pins and len(self._pins) >= self.max_per_batch:
                return Admission.BLOCKED
            return Admission.READY
        if name in self._loading:
            return Admission.WAIT
        slot = self._take_slot(name)
        if slot is None:
            return Admission.BLOCKED
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inflight-lora-load")
        start = time.perf_counter()  # before the submit: the loader thread may begin (and end) before it returns
        self._loading[name] = (slot, self._executor.submit(self._load, name), start)
        return Admission.WAIT

    def hold(self, req: Any, skipped: list, deferred: list) -> bool | None:
        """The scheduler's admission of waiting `req` (its adapter set): None when it may
        start now; else it waits, appended to `skipped` when BLOCKED (it counts admission
        skips) or to `deferred` (loading, failed); True when it must hold the admission
        reservation (preempted, or skipped `max_admission_skips` times: nothing behind it
        starts, so the batch's adapters drain)."""
        verdict = self.admit(req.adapter)
        if verdict is Admission.READY:
            return None
        if verdict is not Admission.BLOCKED:
            deferred.append(req)
            return False
        skipped.append(req)
        return req.status == RequestStatus.PREEMPTED or req.num_skips >= self.max_admission_skips

    def pin(self, name: str) -> int:
        """A request of `name` joins the running batch: its slot (kept from eviction)."""
        self._pins[name] += 1
        self._idle.pop(name, None)
        return self.resident[name].slot

    def unpin(self, name: str) -> None:
        """A request of `name` left the running batch (finished or preempted)."""
        self._pins[name] -= 1
        if self._pins[name] <= 0:
            del self._pins[name]
            if name in self.resident:
                self._idle[name] = None  # most recently used last

    def poll(self) -> None:
        """Take finished loads: READY (idle until pinned), or a failure recorded."""
        for name, (slot, future, start) in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[name]
            try:
                weights, num_params = future.result()
            except Exception as e:  # a bad adapter, not a broken engine: its requests end with the message
                self._free.append(slot)
                self._failures[name] = f"{type(e).__name__}: {e}"
                self._counts[2] += 1
                log.warning("LoRA adapter %r did not load: %s", name, self._failures[name][:300])
                continue
            self.resident[name] = ResidentAdapter(name, slot, weights, next(self._load_ids), num_params)
            self._idle[name] = None
            self._counts[0] += 1
            self._load_s.append(time.perf_counter() - start)
            log.info("LoRA adapter %r loaded into slot %d (%d parameters, %.2f s)", name, slot, num_params,
                     self._load_s[-1])

    @property
    def has_failures(self) -> bool:
        return bool(self._failures)

    def end_failed(self, scheduler: Any, emit: Callable[[Any, tuple[str, str]], None]) -> None:
        """End every waiting request of an adapter whose load failed: `finished(error)`,
        code `adapter_load_failed` with the loader's message (`emit(request, error)`).
        The failure is then forgotten: a later request of that adapter loads it again."""
        failures, self._failures = self._failures, {}
        for req in [r for r in scheduler.requests.values() if r.adapter in failures and r.status != RequestStatus.RUNNING]:
            scheduler.finish(req.request_id, RequestStatus.FINISHED_ERROR)
            emit(req, (ErrorCode.ADAPTER_LOAD_FAILED, f"adapter {req.adapter!r} did not load: {failures[req.adapter]}"))

    def wait(self, timeout_s: float) -> None:
        """Block until a load ends or `timeout_s` passed (the engine has nothing else to
        run: it waits instead of spinning)."""
        futures = [f for _, f, _ in self._loading.values()]
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def wait_loads(self, timeout: float | None = None) -> None:
        """Block until the loads under way end (tests, tools; never the step path)."""
        for _, future, _ in list(self._loading.values()):
            with contextlib.suppress(Exception):  # recorded by poll()
                future.result(timeout)
        self.poll()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- slots -----------------------------------------------------------------------
    def _take_slot(self, for_name: str) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._idle:
            return None  # every slot loading or pinned
        victim, _ = self._idle.popitem(last=False)
        self._counts[1] += 1
        slot = self.resident.pop(victim).slot
        log.info("LoRA adapter %r evicted from slot %d (least recently used) for %r", victim, slot, for_name)
        return slot
