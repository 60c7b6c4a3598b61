"""How the worker talks to its engine: the same interface whether the engine core steps in
a thread of this process or in its own process (`worker.engine_process`).

Both clients take validated requests (`input.process` runs in the caller's thread pool,
then `submit` on the event loop), accept aborts, and deliver each step's `RequestOutput`
deltas to the loop with `call_soon_threadsafe`, in step order:

  ThreadEngineClient   an `Engine` stepped by one thread here (core + output processing on
                       that thread; the engine tests and injected engines use it)
  ProcessEngineClient  the core in a child process (`core_proc.py`); output processing
                       (detokenization, stop strings) runs on this process's reader thread,
                       which merges every step waiting in the pipe into one batch

Step metrics (`observe_step`) are recorded off the event loop in both.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import pickle
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import structlog

from worker.config import ServingTuning
from worker.engine.core_proc import (
    AbortRequests,
    AddRequests,
    EngineSpec,
    Failed,
    FinishRequests,
    FromCore,
    Idle,
    Ready,
    Shutdown,
    StepOutputs,
)
from worker.engine.input_processor import InputProcessor, ModelFacts
from worker.engine.output_processor import OutputProcessor
from worker.engine.outputs import EngineCoreRequest, RequestOutput
from worker.engine.threads import ThreadBudget

if TYPE_CHECKING:
    from worker.engine.engine import Engine
    from worker.obs.metrics import Metrics

log = structlog.get_logger(__name__)

IDLE_METRICS_INTERVAL_S = 0.5
OnOutputs = Callable[[list[RequestOutput]], None]
OnCrash = Callable[[BaseException], None]


class EngineCrashed(RuntimeError):
    """The engine core died (its process exited, or a step broke an invariant); the
    worker stops without committing the affected offsets, so its jobs are redelivered."""


class EngineClient(Protocol):
    """What the worker uses of its engine, whichever client runs it (`ThreadEngineClient`,
    `ProcessEngineClient`; `make_engine_client` picks one). The attributes are set once
    `start` returned; `submit`, `abort` and `wake` are called on the event loop."""

    input: InputProcessor | None  # validates and tokenizes requests (the caller's threads)
    tuning: ServingTuning  # the limits in force (resolved for the model once started)
    tokenizer: Any
    num_blocks: int  # KV blocks of the engine's cache
    device: str
    engine_threads: int  # torch threads the engine steps with
    forward: str  # how the engine's forward runs: compiled or eager, and why
    num_steps: int  # steps done so far
    last_tick: float  # time.monotonic() of the step loop's last turn (liveness)

    async def start(self, loop: asyncio.AbstractEventLoop, on_outputs: OnOutputs, on_crash: OnCrash) -> None:
        """Start stepping; each step's outputs reach `on_outputs` on `loop`, a crash
        `on_crash`. Raises EngineCrashed when the engine cannot start."""
        ...

    def submit(self, req: EngineCoreRequest) -> None:
        """Queue a request made by `input.process`. Raises RequestRejected (duplicate id,
        overloaded)."""
        ...

    def abort(self, request_id: str) -> None:
        """End a request: its KV cache is free at the next step boundary."""
        ...

    def wake(self) -> None:
        """New work: the step loop looks now."""
        ...

    @property
    def alive(self) -> bool:
        """The step loop (thread or process) runs."""
        ...

    def stop(self, timeout: float = 10.0) -> None:
        """Stop stepping (blocking; bounded by `timeout` and a few seconds more)."""
        ...


class ThreadEngineClient:
    """An `Engine` stepped by one thread of this process.

    Args:
        engine: the Engine (only this client's thread calls `step`).
        metrics: `observe_step` after every step, `observe_idle` every 0.5 s while idle.
    """

    def __init__(self, engine: Engine, metrics: Metrics | None = None) -> None:
        self.engine = engine
        self.input: InputProcessor = engine.input
        self.tuning: ServingTuning = engine.tuning
        self.tokenizer = engine.tokenizer
        self.num_blocks = engine.kv.num_blocks
        self.device = str(engine.runner.device)
        self._metrics = metrics
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inflight-engine", daemon=True)
        self.num_steps = 0
        self.last_tick = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_outputs: OnOutputs | None = None
        self._on_crash: OnCrash | None = None
        self.budget: ThreadBudget | None = None  # set when this client sized the process's threads
        self.engine_threads = 0
        report = getattr(engine, "compile_report", None)
        self.forward = report.describe() if report is not None else "eager"

    async def start(self, loop: asyncio.AbstractEventLoop, on_outputs: OnOutputs, on_crash: OnCrash) -> None:
        self._loop, self._on_outputs, self._on_crash = loop, on_outputs, on_crash
        self._thread.start()

    def submit(self, req: EngineCoreRequest) -> None:
        """Raises RequestRejected (duplicate id, overloaded)."""
        self.engine.submit(req)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.budget is not None:
            self.budget.close()

    def _run(self) -> None:
        engine, metrics = self.engine, self._metrics
        last_idle_report = 0.0
        try:
            while not self._stop.is_set():
                if not engine.has_unfinished():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    self.last_tick = now = time.monotonic()
                    if metrics is not None and now - last_idle_report >= IDLE_METRICS_INTERVAL_S:
                        last_idle_report = now
                        metrics.observe_idle(engine.kv_stats(), 0, 0)
                    continue
                outputs = engine.step()
                self.num_steps += 1
                self.last_tick = time.monotonic()
                if metrics is not None:
                    metrics.observe_step(engine.last_step_stats)
                if outputs:
                    self._loop.call_soon_threadsafe(self._on_outputs, outputs)
                if self.budget is not None:
                    self.budget.recheck()
        except BaseException as e:  # the engine is broken: tell the worker, which stops
            log.exception("engine step failed")
            self._loop.call_soon_threadsafe(self._on_crash, EngineCrashed(f"engine step failed: {e!r}"[:500]))


class ProcessEngineClient:
    """The engine core in a child process. `start` spawns it and waits for `Ready`
    (the model loads meanwhile; up to `ready_timeout_s`).

    Args:
        spec: builds the engine in the child, and the tokenizer here unless the child sends
            its own (`core_sends_tokenizer`).
        tuning: `serving_tuning` (input checks here must match the core's).
        metrics: step metrics, recorded on the reader thread.
        log_level: the child's log level.
    """

    def __init__(self, spec: EngineSpec, tuning: ServingTuning, metrics: Metrics | None = None, *,
                 log_level: str = "INFO", ready_timeout_s: float = 1800.0, engine_threads: int | None = None) -> None:
        self.spec = spec
        self._engine_threads = engine_threads
        self.engine_threads = 0  # what the core chose (Ready)
        self.forward = ""  # Ready's
        self.tuning = tuning
        self._metrics = metrics
        self._log_level = log_level
        self._ready_timeout_s = ready_timeout_s
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(FromCore).decode
        self._send_lock = threading.Lock()
        self._pending_adds: list[EngineCoreRequest] = []
        self._flush_scheduled = False
        self.num_steps = 0
        self.last_tick = time.monotonic()
        self._proc = None
        self._closing = False
        # set by start(), once the core process is ready
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_outputs: OnOutputs | None = None
        self._on_crash: OnCrash | None = None
        self._to_core = None
        self._from_core = None
        self._reader: threading.Thread | None = None
        self.tokenizer = None
        self.num_blocks = 0
        self.device = ""
        self.input: InputProcessor | None = None
        self.output: OutputProcessor | None = None

    async def start(self, loop: asyncio.AbstractEventLoop, on_outputs: OnOutputs, on_crash: OnCrash) -> None:
        """Raises:
        EngineCrashed: the core process failed to build the engine (the message says why)."""
        self._loop, self._on_outputs, self._on_crash = loop, on_outputs, on_crash
        self._proc, self._to_core, self._from_core = self.spec.start_core(self._log_level, self._engine_threads)
        if self.spec.core_sends_tokenizer:
            await asyncio.to_thread(_import_tokenizer_base)  # while the core loads the model
            ready = await asyncio.to_thread(self._wait_ready)
            tokenizer = await asyncio.to_thread(self._sent_tokenizer, ready)
        else:
            tokenizer = await asyncio.to_thread(self.spec.build_tokenizer)
            ready = await asyncio.to_thread(self._wait_ready)
        self.tokenizer = tokenizer
        self.num_blocks = ready.num_blocks
        self.device = ready.device
        self.engine_threads = ready.engine_threads
        self.forward = ready.forward
        facts = ModelFacts(vocab_size=ready.vocab_size, max_model_len=ready.max_model_len,
                           kv_capacity_tokens=ready.num_blocks * ready.block_size,
                           eos_token_ids=frozenset(ready.eos_token_ids), model_id=ready.model_id,
                           block_size=ready.block_size, sliding_window=ready.sliding_window, lora=ready.lora)
        self.tuning = self.tuning.for_model(ready.max_model_len)  # the core resolved the same limits
        self.input = InputProcessor(tokenizer, facts, self.tuning)
        self.output = OutputProcessor(tokenizer)
        self._reader = threading.Thread(target=self._read, name="inflight-engine-reader", daemon=True)
        self._reader.start()

    def _sent_tokenizer(self, ready: Ready) -> Any:
        """The tokenizer the core sent in `Ready`; the spec's own when none came or it does
        not unpickle here."""
        if ready.tokenizer:
            try:
                return pickle.loads(ready.tokenizer)  # from our own child process: trusted bytes
            except Exception as e:  # whatever the tokenizer's class raises while it is rebuilt
                log.warning("the engine core's tokenizer does not load here; loading it from the checkpoint",
                            error=f"{type(e).__name__}: {e}"[:300])
        return self.spec.build_tokenizer()

    def _wait_ready(self) -> Ready:
        if not self._from_core.poll(self._ready_timeout_s):
            raise EngineCrashed(f"the engine core did not start within {self._ready_timeout_s} s")
        try:
            msg = self._decode(self._from_core.recv_bytes())
        except EOFError:
            raise EngineCrashed(f"the engine core process exited with code {self._proc.exitcode}") from None
        if isinstance(msg, Failed):
            if msg.is_config_error:
                raise ValueError(msg.error)  # the worker's config-error path: one line, exit 2
            raise EngineCrashed(f"the engine core failed to start: {msg.error}")
        return msg

    def submit(self, req: EngineCoreRequest) -> None:
        """Queue a request for the core (sent once per loop iteration, batched). Call on the loop."""
        self.output.add(req.request_id, req.params.stop, len(req.prompt_token_ids), req.options.arrival_time)
        self._pending_adds.append(req)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush_adds)

    def _flush_adds(self) -> None:
        self._flush_scheduled = False
        adds, self._pending_adds = self._pending_adds, []
        if adds:
            self._send(AddRequests(adds))

    def abort(self, request_id: str) -> None:
        if self._pending_adds:
            self._flush_adds()  # an abort never overtakes its request
        self._send(AbortRequests([request_id]))

    def wake(self) -> None:
        pass  # the core process polls its pipe

    def _send(self, msg) -> None:
        data = self._encode(msg)
        with self._send_lock:
            try:
                self._to_core.send_bytes(data)
            except (BrokenPipeError, OSError) as e:
                if not self._closing:
                    log.warning("engine core unreachable", error=repr(e))

    @property
    def alive(self) -> bool:
        reader = self._reader
        return self._proc is not None and self._proc.is_alive() and reader is not None and reader.is_alive()

    def _read(self) -> None:
        """Reader thread: every message waiting is read and processed as one batch."""
        metrics = self._metrics
        conn = self._from_core
        try:
            while True:
                msgs = [self._decode(conn.recv_bytes())]
                while conn.poll(0):
                    msgs.append(self._decode(conn.recv_bytes()))
                self.last_tick = time.monotonic()
                core_outputs = []
                for msg in msgs:
                    if isinstance(msg, StepOutputs):
                        self.num_steps += 1
                        core_outputs.extend(msg.outputs)
                        if metrics is not None:
                            metrics.observe_step(msg.stats)
                    elif isinstance(msg, Idle):
                        if metrics is not None:
                            metrics.observe_idle(msg.kv, 0, 0)
                    elif isinstance(msg, Failed):
                        raise EngineCrashed(f"engine step failed: {msg.error}")
                if not core_outputs:
                    continue
                processed = self.output.process(core_outputs)
                if processed.finish:
                    self._send(FinishRequests([(rid, int(st)) for rid, st in processed.finish]))
                if processed.num_internal_errors and metrics is not None:
                    metrics.request_errors.labels("internal").inc(processed.num_internal_errors)
                if processed.outputs:
                    self._loop.call_soon_threadsafe(self._on_outputs, processed.outputs)
        except (EOFError, OSError):
            if not self._closing:
                code = self._proc.exitcode if self._proc is not None else None
                self._report_crash(EngineCrashed(f"the engine core process exited (code {code})"))
        except BaseException as e:
            if not self._closing:
                log.exception("engine output processing failed")
                self._report_crash(e if isinstance(e, EngineCrashed) else EngineCrashed(repr(e)[:500]))

    def _report_crash(self, exc: BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody left to tell
            self._loop.call_soon_threadsafe(self._on_crash, exc)

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the core process to end; kill it if it does not within `timeout`."""
        self._closing = True
        if self._proc is None:
            return
        self._send(Shutdown())
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        if self._reader is not None:  # it ends on the pipe's EOF now that the process is gone
            self._reader.join(5)
        for conn in (self._to_core, self._from_core):
            if conn is not None:
                conn.close()


def _import_tokenizer_base() -> None:
    """Import transformers' tokenizer classes (not torch: ~1.4 CPU-s) while the core loads
    the model, so unpickling the tokenizer it sends costs little once `Ready` comes."""
    with contextlib.suppress(ImportError):
        importlib.import_module("transformers.tokenization_utils_base")


async def make_engine_client(engine: Any, spec: EngineSpec | None, tuning: ServingTuning, metrics: Metrics,
                             use_process: bool, log_level: str = "INFO",
                             engine_threads: int | None = None) -> EngineClient:
    """The client for a worker: an injected `Engine` steps in a thread (its threads are
    the caller's business); else the spec's engine runs in its own process (`use_process`)
    or is built here (off the loop) and stepped in a thread, with its torch threads sized
    by `threads.ThreadBudget` (`engine_threads` = `worker.engine_threads` overrides)."""
    if engine is not None:
        return ThreadEngineClient(engine, metrics)
    if use_process:
        return ProcessEngineClient(spec, tuning, metrics, log_level=log_level, engine_threads=engine_threads)
    budget = ThreadBudget(own_process=False, setting=engine_threads)
    budget.start()
    client = ThreadEngineClient(await asyncio.to_thread(spec.build_engine), metrics)
    client.budget = budget
    client.engine_threads = budget.threads
    return client
