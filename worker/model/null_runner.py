"""A model runner that runs no model: for scheduler benchmarks and pure-logic tests.

It honours the runner contract (a token for every request whose chunk ends its known
tokens) and produces deterministic tokens, so everything above the model (scheduler,
KV cache manager, detokenizer, engine outputs) runs exactly as in production.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from worker.engine.outputs import ModelRunnerOutput, RunnerCapabilities, ScheduledRequest, SchedulerOutput
from worker.engine.speculative import num_accepted


def default_next_token(s: ScheduledRequest, vocab_size: int, avoid: frozenset[int]) -> int:
    """A deterministic function of the request's tokens so far (never a token in `avoid`)."""
    ids = s.all_token_ids
    return _hash_token(len(ids), ids[-1], ids[0], vocab_size, avoid)


def _hash_token(num_tokens: int, last: int, first: int, vocab_size: int, avoid: frozenset[int]) -> int:
    h = (num_tokens * 1_000_003 + last * 7919 + first) % vocab_size
    while h in avoid:
        h = (h + 1) % vocab_size
    return h


class EmulatedDevice:
    """An asynchronous device that takes `step_s` seconds per step, as a GPU stream does:
    `launch` returns at once with the time the step's result will be ready; a step
    launched while another runs starts when that one ends (one queue); `wait` blocks
    until a result is ready, sleeping (which releases the GIL, as a CUDA sync does).
    `busy_s()` is the device time spent so far (a step still running counts up to now).
    Thread-safe."""

    def __init__(self, step_s: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.step_s = step_s
        self._clock = clock
        self._lock = threading.Lock()
        self._busy_until = 0.0
        self._busy_s = 0.0  # every launched step's full time
        self.num_steps = 0

    def launch(self) -> float:
        """Queue one step; returns when its result is ready (clock seconds)."""
        with self._lock:
            start = max(self._clock(), self._busy_until)
            self._busy_until = start + self.step_s
            self._busy_s += self.step_s
            self.num_steps += 1
            return self._busy_until

    def wait(self, ready: float) -> None:
        delay = ready - self._clock()
        if delay > 0:
            time.sleep(delay)

    def busy_s(self) -> float:
        with self._lock:
            return self._busy_s - max(0.0, self._busy_until - self._clock())


class _Launched:
    """A launched null step: `result()` waits for the emulated device, then returns."""

    __slots__ = ("_out", "_ready", "_device")

    def __init__(self, out: ModelRunnerOutput, ready: float | None, device: EmulatedDevice | None) -> None:
        self._out, self._ready, self._device = out, ready, device

    def result(self) -> ModelRunnerOutput:
        if self._ready is not None:
            self._device.wait(self._ready)
        return self._out


class NullRunner:
    """Drop-in for ModelRunner without a model.

    Args:
        vocab_size: token ids are drawn from `[0, vocab_size)`.
        next_token: optional `f(scheduled_request) -> token_id`; default: a hash of its tokens so far.
        avoid: token ids the default never produces (e.g. EOS, so lengths are exact).
        device_ms: emulated device time per step, milliseconds (`EmulatedDevice`); 0 =
            no device time (the step is pure host work).
    """

    def __init__(
        self,
        vocab_size: int,
        next_token: Callable[[ScheduledRequest], int] | None = None,
        avoid: frozenset[int] = frozenset(),
        device_ms: float = 0.0,
    ) -> None:
        self.device = torch.device("cpu")
        self.vocab_size = vocab_size
        self._next = next_token
        self._avoid = avoid
        self.emulated = EmulatedDevice(device_ms / 1000) if device_ms > 0 else None
        # asynchronous steps pay only with an emulated device (the default of async_scheduling)
        self.capabilities = RunnerCapabilities(async_launch=True, device_time=True,
                                               overlaps_host=self.emulated is not None, speculation=True)
        self.lora = None  # no adapters
        self._last_sampled: dict[str, int] = {}  # the previous step's tokens (the "device" memory)
        self.launch_host_s = 0.0  # seconds `launch` spent computing tokens on the caller's thread

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Launch the step on the emulated device (if any), compute its tokens, wait for it."""
        return self._start(sched).result()

    def launch(self, sched: SchedulerOutput, after: _Launched | None = None) -> _Launched:
        """Start the step without waiting for it (the engine core's asynchronous steps):
        its tokens are computed now, its result is ready when the emulated device has run
        it (at once without a device). A placeholder input is the token the previous
        launch computed for that request (`after`'s; a null step never fails)."""
        t0 = time.perf_counter()
        try:
            return self._start(sched)
        finally:  # a real runner hands the step to its forward thread; this one computes it here
            self.launch_host_s += time.perf_counter() - t0

    def _start(self, sched: SchedulerOutput) -> _Launched:
        ready = self.emulated.launch() if self.emulated is not None else None
        last = self._last_sampled
        sampled: dict[str, int] = {}  # the plain decodes' tokens: next step's placeholder inputs
        out: dict[str, list[int]] = {}
        for s in sched.scheduled:
            if not s.samples_token:
                continue
            rid = s.request_id
            if s.draft:  # a token per position; the verification keeps the confirmed run (speculative.py)
                xs = [self._token(row, last) for row in s.verify_rows(with_history=True)]
                out[rid] = xs[: 1 + num_accepted(xs, s.draft)]
            else:
                out[rid] = [self._token(s, last)]
                sampled[rid] = out[rid][0]
        self._last_sampled = sampled
        return _Launched(ModelRunnerOutput(sampled_token_ids=out), ready, self.emulated)

    def _token(self, s: ScheduledRequest, last: dict[str, int]) -> int:
        """The token decode / last chunk `s` samples (`last`: the previous step's tokens,
        the inputs of placeholders)."""
        if self._next is not None:
            return self._next(s.resolved(last[s.request_id]) if s.has_placeholder else s)
        ids = s.all_token_ids
        if s.has_placeholder:  # history = the first start_pos ids + the token in flight
            return _hash_token(s.start_pos + 1, last[s.request_id], ids[0], self.vocab_size, self._avoid)
        end = s.start_pos + len(s.token_ids)
        return _hash_token(end, ids[end - 1], ids[0], self.vocab_size, self._avoid)

    def device_busy_s(self) -> float:
        """Seconds the (emulated) device has been busy; 0 without one."""
        return self.emulated.busy_s() if self.emulated is not None else 0.0


class LetterTokenizer:
    """Token id i decodes to one letter; enough for the detokenizer in benchmarks."""

    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i % 26) for i in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 26 for c in text]


def null_engine(
    config=None,
    *,
    vocab_size: int = 32000,
    eos_token_ids: frozenset[int] = frozenset({0}),
    max_model_len: int = 4096,
    tokenizer=None,
    next_token: Callable[[ScheduledRequest], int] | None = None,
    device_ms: float = 0.0,
):
    """An Engine over a NullRunner (no model, no torch compute): same scheduler, KV
    manager, detokenizer and outputs as a real engine. `device_ms`: emulated device time
    per step (`EmulatedDevice`), for benchmarks of the host work around the device."""
    from worker.config import EngineConfig
    from worker.engine.engine import CPU_DEFAULT_KV_TOKENS, Engine
    from worker.model.capability import KVLayout
    from worker.model.loader import LoadedModel

    config = config or EngineConfig()
    tuning = config.serving_tuning
    loaded = LoadedModel(
        model=None,
        tokenizer=tokenizer or LetterTokenizer(),
        eos_token_ids=frozenset(eos_token_ids),
        max_model_len=max_model_len,
        kv_layout=KVLayout(()),
        vocab_size=vocab_size,
        device=torch.device("cpu"),
        dtype=torch.float32,
        model_id="null",
    )
    runner = NullRunner(vocab_size, next_token, avoid=frozenset(eos_token_ids), device_ms=device_ms)
    num_blocks = (tuning.max_total_tokens or CPU_DEFAULT_KV_TOKENS) // tuning.kv_block_size
    return Engine(loaded, runner, config, num_blocks)
