"""The engine core in its own process (vLLM V1's EngineCoreProc): a busy loop that owns
the model, the KV cache and the scheduler, fed and drained through two pipes of
msgpack-encoded messages, so the worker's I/O (Kafka, Redis, detokenization, metrics)
never shares a GIL with the step loop.

    front-end ──AddRequests / AbortRequests / FinishRequests / Shutdown──► core process
    front-end ◄──Ready / StepOutputs / Idle / Failed────────────────────── core process

Between two steps the core applies every message waiting in its pipe (so a cancel frees
KV at the next step boundary), then steps; while idle it blocks on the pipe and sends an
`Idle` tick every 0.5 s (liveness and gauges). The pipe closing (the front-end died) ends
the process; a signal to the process group does not (`ignore_group_signals`). An
`EngineSpec` says how to start the child, build the engine in it and its tokenizer in
the front-end: `PretrainedEngine` (Inflight's engine) is pickled to a spawned child (as
CUDA requires), which loads the tokenizer with the model and sends it back pickled in
`Ready`, so the front-end never imports torch (transformers' `AutoTokenizer` does: ~4.5
CPU-s and ~550 MB of the front's start on the 2-core box); `vllm_spec.VllmEngine` runs vLLM's engine core
in vLLM's own interpreter (another transformers) behind the same messages and the same
loop (`serve_core`), and the front-end builds that tokenizer itself.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import pickle
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, ClassVar, Protocol

import msgspec

from worker.config import EngineConfig
from worker.engine.adapters import LoRAFacts
from worker.engine.outputs import EngineCoreOutput, EngineCoreRequest, KVStats, StepStats
from worker.engine.request import RequestStatus
from worker.obs.exits import exit_now

IDLE_TICK_S = 0.5


# ---- messages -------------------------------------------------------------------------------
class AddRequests(msgspec.Struct, tag="add", array_like=True):
    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class FinishRequests(msgspec.Struct, tag="finish", array_like=True):
    """Requests output processing ended (stop string, output error): (id, RequestStatus)."""

    items: list[tuple[str, int]]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """The engine is built: what the front-end's input processing must know of it."""

    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    eos_token_ids: list[int]
    model_id: str
    device: str
    sliding_window: int | None = None
    engine_threads: int = 0  # torch intra-op threads the core uses (threads.py)
    lora: LoRAFacts | None = None  # LoRA adapters served (adapters.py)
    forward: str = ""  # how the forward runs: compiled or eager and why (`CompileReport.describe`)
    tokenizer: bytes = b""  # the core's tokenizer, pickled (`EngineSpec.core_sends_tokenizer`); b"": none sent


class StepOutputs(msgspec.Struct, tag="step", array_like=True):
    outputs: list[EngineCoreOutput]
    stats: StepStats


class Idle(msgspec.Struct, tag="idle", array_like=True):
    kv: KVStats


class Failed(msgspec.Struct, tag="failed", array_like=True):
    """The core could not start or a step broke. `is_config_error`: the engine could not
    be built from its settings (model path, device, an architecture the load check
    refused), which the worker reports as a config error (exit 2), not a crash."""

    error: str
    is_config_error: bool = False


ToCore = AddRequests | AbortRequests | FinishRequests | Shutdown
FromCore = Ready | StepOutputs | Idle | Failed


class CoreProcess(Protocol):
    """The core process as the client handles it (`multiprocessing.Process`'s methods)."""

    pid: int | None
    exitcode: int | None

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...

    def kill(self) -> None: ...


class EngineSpec(Protocol):
    """How to build the engine (in the core process, or in this one for the thread
    client), its tokenizer (in the front-end), and how to start the core process.
    `core_sends_tokenizer`: the core process pickles the engine's own tokenizer into
    `Ready` (same Python environment on both sides), and the front-end calls
    `build_tokenizer` only when that fails."""

    core_sends_tokenizer: ClassVar[bool]

    def build_engine(self) -> Any: ...

    def build_tokenizer(self) -> Any: ...

    def start_core(self, log_level: str, engine_threads: int | None) -> tuple[CoreProcess, Connection, Connection]:
        """Start the core process: (process, pipe to it, pipe from it)."""
        ...


class CoreLike(Protocol):
    """What `serve_core` steps: our `EngineCore`, or vLLM's behind `vllm_core.VllmCore`."""

    last_step_stats: StepStats

    def add(self, req: EngineCoreRequest) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def finish(self, request_id: str, status: RequestStatus) -> None: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[EngineCoreOutput]: ...

    def kv_stats(self) -> KVStats: ...


class SpawnedCore:
    """`EngineSpec.start_core` for specs of Inflight's engine (and test engines): a
    spawned child (as CUDA requires) running `run_engine_core` with the spec pickled."""

    core_sends_tokenizer: ClassVar[bool] = False

    def start_core(self, log_level: str, engine_threads: int | None):
        ctx = multiprocessing.get_context("spawn")
        to_core_r, to_core = ctx.Pipe(duplex=False)
        from_core, from_core_w = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=run_engine_core, name="inflight-engine-core", daemon=True,
                           args=(self, to_core_r, from_core_w, log_level, engine_threads))
        proc.start()
        to_core_r.close()
        from_core_w.close()
        return proc, to_core, from_core


@dataclass(frozen=True)
class PretrainedEngine(SpawnedCore):
    """A local Hugging Face checkpoint on Inflight's engine (`Engine.from_pretrained`),
    which loads the checkpoint's tokenizer beside the model: the core sends it."""

    core_sends_tokenizer: ClassVar[bool] = True
    path: str
    config: EngineConfig

    def build_engine(self):
        from worker.engine import Engine

        return Engine.from_pretrained(self.path, self.config)

    def build_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path, local_files_only=True)


# ---- the core process ---------------------------------------------------------------------
def ignore_group_signals() -> None:
    """SIGINT and SIGTERM do nothing in a core process: its front-end owns its lifetime
    (`Shutdown`; the pipe's end when the front-end is gone; SIGKILL past the stop's bound).
    A signal to the whole process group (Ctrl-C in a terminal, systemd stopping a unit's
    control group, `kill -- -PGID`) reaches the core as well as the worker, and its default
    action ended the core at once, in the middle of the drain the worker starts on the same
    signal (the running jobs it lets finish were handed back instead; Ctrl-C also printed a
    `KeyboardInterrupt` traceback). A no-op handler, not SIG_IGN: processes the core
    starts (inductor's compile workers) get the default actions back at their exec."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _ignored)


def _ignored(signum: int, frame: object) -> None:
    logging.getLogger("worker.engine.core_proc").debug(
        "signal %s ignored: the worker stops the engine core", signal.Signals(signum).name)


def run_engine_core(spec: EngineSpec, conn_in: Connection, conn_out: Connection, log_level: str = "INFO",
                    engine_threads: int | None = None) -> None:
    """Main of the core process: ignore group signals (`ignore_group_signals`), size its
    threads (`threads.ThreadBudget`; `engine_threads` = `worker.engine_threads`), build
    the engine, send `Ready`, step until `Shutdown` or the front-end goes away. A broken
    invariant is reported as `Failed` and ends it."""
    from worker.engine.gc_tuning import tune_gc
    from worker.engine.threads import ThreadBudget
    from worker.obs.log import setup_logging

    ignore_group_signals()
    setup_logging(log_level)
    with contextlib.suppress(ImportError):  # no progress bars among the JSON log lines
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    log = logging.getLogger("worker.engine.core_proc")
    encode = msgspec.msgpack.Encoder().encode
    budget = ThreadBudget(own_process=True, setting=engine_threads)
    try:
        budget.start()
        engine = spec.build_engine()
        core = engine.core
        loaded = engine.loaded
        tune_gc()  # the model and its imports are loaded: freeze them out of the collector's scans
        conn_out.send_bytes(encode(Ready(loaded.vocab_size, loaded.max_model_len, core.kv.num_blocks,
                                         core.kv.block_size, sorted(loaded.eos_token_ids), loaded.model_id,
                                         str(core.runner.device), loaded.kv_layout.sliding_window,
                                         budget.threads, engine.facts.lora, engine.compile_report.describe(),
                                         pickled_tokenizer(engine) if spec.core_sends_tokenizer else b"")))
    except (ValueError, FileNotFoundError, PermissionError) as e:  # UnsupportedModel and ConfigError are ValueErrors
        log.error("engine core cannot start: %s", e)
        conn_out.send_bytes(encode(Failed(str(e)[:2000], is_config_error=True)))
        return
    except Exception as e:
        log.exception("engine core failed to start")
        conn_out.send_bytes(encode(Failed(f"{type(e).__name__}: {e}"[:2000])))
        return
    code = serve_core(core, conn_in, conn_out, after_step=budget.recheck, on_close=budget.close)
    exit_now(code)  # the worker waits on this exit; the interpreter's teardown took seconds under load


def pickled_tokenizer(engine: Any) -> bytes:
    """`engine.tokenizer` pickled for the front-end, or b"" when it does not pickle (a
    tokenizer of a checkpoint's own code may hold what pickle refuses: the front-end then
    loads its own, `EngineSpec.build_tokenizer`)."""
    try:
        return pickle.dumps(engine.tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # pickle raises what the object's __reduce__ raises
        logging.getLogger("worker.engine.core_proc").info(
            "the tokenizer does not pickle (%s): the front-end loads its own", f"{type(e).__name__}: {e}"[:300])
        return b""


def serve_core(core: CoreLike, conn_in: Connection, conn_out: Connection, after_step=None, on_close=None) -> int:
    """Step `core` between the pipes until `Shutdown` (returns 0) or the front-end goes
    away: every message waiting is applied before each step (a cancel frees KV at the
    next step boundary); `Idle` ticks while there is nothing to step. A step that raises
    is reported as `Failed` and ends the process (exit 1). `after_step()` runs after each
    step, `on_close()` at the end."""
    log = logging.getLogger("worker.engine.core_proc")
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(ToCore).decode
    last_tick = 0.0
    try:
        while True:
            busy = core.has_unfinished()
            if conn_in.poll(0 if busy else IDLE_TICK_S):
                while True:  # every message waiting now, then step
                    msg = decode(conn_in.recv_bytes())
                    if isinstance(msg, AddRequests):
                        for r in msg.requests:
                            core.add(r)
                    elif isinstance(msg, AbortRequests):
                        for rid in msg.request_ids:
                            core.abort(rid)
                    elif isinstance(msg, FinishRequests):
                        for rid, status in msg.items:
                            core.finish(rid, RequestStatus(status))
                    else:
                        return 0
                    if not conn_in.poll(0):
                        break
            if not core.has_unfinished():
                now = time.monotonic()
                if now - last_tick >= IDLE_TICK_S:
                    last_tick = now
                    conn_out.send_bytes(encode(Idle(core.kv_stats())))
                continue
            outputs = core.step()
            conn_out.send_bytes(encode(StepOutputs(outputs, core.last_step_stats)))
            if after_step is not None:
                after_step()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return 0  # the front-end went away
    except Exception as e:
        log.exception("engine step failed")
        with contextlib.suppress(OSError):
            conn_out.send_bytes(encode(Failed(f"{type(e).__name__}: {e}"[:2000])))
        if on_close is not None:
            on_close()
        exit_now(1)  # as a stopped core ends: logs and streams flushed, no teardown
    finally:
        if on_close is not None:
            on_close()
