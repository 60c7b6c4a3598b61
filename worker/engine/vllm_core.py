"""vLLM's engine core behind Inflight's engine-process boundary (`model.engine: vllm`).

The worker talks to its engine core through two pipes of typed messages
(`core_proc.py`: add / abort / finish requests in; `Ready`, step outputs, idle ticks and
failures out). With `model.engine: vllm` the process on the other end runs vLLM's V1
`EngineCore` instead of Inflight's: the same loop (`core_proc.serve_core`), the same
messages, so everything in front of it — Kafka intake, claims, Redis streams,
detokenization and stop strings, cancels, metrics, the gateway — is unchanged.

    worker (our .venv)                          core process (model.vllm_python)
    ProcessEngineClient ──VllmStart, then ToCore──►  serve_core(VllmCore)
                        ◄──Ready / StepOutputs / Idle / Failed──  vllm.v1.engine.core.EngineCore

Why `EngineCore` and not `AsyncLLM`: the core is vLLM's step function (schedule,
execute, update) with no front-end of its own, which is exactly our per-step contract
(one `step()` between reading the pipe); `AsyncLLM` would add vLLM's own detokenizer,
output queues and a second process we would have to translate back out of.

vLLM pins its own torch, so the core runs in vLLM's interpreter (`model.vllm_python`),
not ours (`vllm_spec.VllmEngine.start_core` starts it with a `PYTHONPATH` holding only
this project's two pure-Python packages, `worker` and `schemas`: the messages need
msgspec and pydantic, which vLLM installs too). The child imports vLLM; of our torch code
only `worker.model.lora.lora_modules` (which projections take LoRA), applied to a model on
the meta device.

What maps, and how (docs/engines.md keeps the table users read):
  - prompts arrive tokenized (our input processing); vLLM's `InputProcessor` applies its
    generation-config defaults and EOS to the sampling parameters;
  - detokenization and stop strings stay in our front-end (`FinishRequests` → an abort
    here), so streamed text is the same with either engine;
  - a cancel is `EngineCore.abort_requests` at the next step boundary, reported as a
    `cancelled` output as our core does;
  - priority classes → `scheduling_policy="priority"` (lower value first, ours too);
  - a job's LoRA adapter → vLLM's `LoRARequest` for `<model.lora_dir>/<name>`, checked
    first by our input processing against the facts `Ready` carries (`vllm_requests`);
  - `serving_tuning` limits become vLLM's engine arguments (`derived_engine_args`,
    `engine_args`), which `model.vllm_args` overrides key by key.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from schemas.wire import FinishReason
from worker.config import ConfigError
from worker.engine.core_proc import Failed, Ready, ignore_group_signals, serve_core
from worker.engine.outputs import (
    EngineCoreOutput,
    EngineCoreRequest,
    KVStats,
    RequestTimes,
    StepStats,
    TokenLogprobs,
)
from worker.engine.request import RejectReason, RequestStatus
from worker.engine.vllm_requests import LoRAIds, logprobs, lora_facts, sampling_params
from worker.engine.vllm_spec import VllmStart

log = logging.getLogger(__name__)

CPU_KV_TOKENS = 16384  # serving_tuning.max_total_tokens' default on the CPU, as for our engine


def engine_args(start: VllmStart, on_cpu: bool) -> dict[str, Any]:
    """The keywords the core builds `EngineArgs` from. Our KV budget in tokens
    (`serving_tuning.max_total_tokens`; on the CPU 16384 when unset, as for our engine)
    becomes `kv_cache_memory_bytes`, unless `model.vllm_args` sizes the cache itself. On
    vLLM's CPU platform `gpu_memory_utilization` is a share of the machine's memory
    reserved at start (refused when that much is not free), so it is not derived there."""
    args = dict(start.derived)
    if on_cpu:
        args.pop("gpu_memory_utilization", None)
    tokens = start.kv_tokens or (CPU_KV_TOKENS if on_cpu else None)
    sized = {"kv_cache_memory_bytes", "gpu_memory_utilization", "num_gpu_blocks_override"} & start.user.keys()
    if tokens is not None and not sized:
        args["kv_cache_memory_bytes"] = _kv_bytes(start.model, start.user.get("dtype", args.get("dtype", "auto")),
                                                  tokens)
    return {**args, **start.user}


def _kv_bytes(model: str, dtype: str, tokens: int) -> int:
    """Bytes of K and V for `tokens` tokens of the checkpoint at `model` (4-byte elements
    unless `dtype` names a 2-byte one: an upper bound for `auto`)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model).get_text_config()
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    size = 2 if dtype in ("bfloat16", "float16", "half") else 4
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * size * tokens


_FINISH = {0: FinishReason.STOP, 1: FinishReason.LENGTH, 2: FinishReason.CANCELLED, 3: FinishReason.ERROR,
           4: FinishReason.STOP}  # vllm.v1.engine.FinishReason: STOP LENGTH ABORT ERROR REPETITION


class _Track:
    """What our outputs report of one request that vLLM does not keep for us."""

    __slots__ = ("arrival_time", "first_scheduled_time", "first_token_time", "num_cached_tokens", "num_preemptions",
                 "vllm_id")

    def __init__(self, arrival_time: float, vllm_id: str) -> None:
        self.arrival_time = arrival_time
        self.vllm_id = vllm_id
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.num_cached_tokens = 0  # prompt tokens vLLM's prefix cache served at first admission
        self.num_preemptions = 0


class VllmCore:
    """vLLM's `EngineCore` with the interface `core_proc.serve_core` steps (our
    `EngineCore`'s: add, abort, finish, step, has_unfinished, kv_stats, last_step_stats).

    Args:
        core: a built `vllm.v1.engine.core.EngineCore`.
        input_processor: vLLM's `InputProcessor` for the same config (sampling defaults, EOS).
        lora_dir: `model.lora_dir` (absolute), when vLLM was built with LoRA enabled: a
            request's adapter is `<lora_dir>/<name>`, checked by our input processing
            before it gets here (adapters.py).
    """

    def __init__(self, core: Any, input_processor: Any, lora_dir: str | None = None) -> None:
        from vllm.inputs import tokens_input
        from vllm.v1.engine import EngineCoreEventType

        self._loras = LoRAIds(lora_dir) if lora_dir is not None else None

        self._preempted = EngineCoreEventType.PREEMPTED
        self._core = core
        self._input = input_processor
        self._tokens_input = tokens_input
        self._tasks = core.get_supported_tasks()
        self._requests: dict[str, _Track] = {}  # our id -> its track
        self._ours: dict[str, str] = {}  # vLLM's internal id -> ours
        self._cancelled: list[str] = []  # aborted here: a `cancelled` output at the next step
        self._refused: list[EngineCoreOutput] = []  # vLLM refused them at add: `rejected` at the next step
        self._step = 0
        self._scheduled: dict[str, int] = {}  # vLLM id -> tokens scheduled in the last step
        self._decodes = 0
        sched = core.scheduler
        schedule = sched.schedule

        def recording_schedule(*args, **kwargs):  # the step's token counts, per request
            out = schedule(*args, **kwargs)
            self._scheduled = dict(out.num_scheduled_tokens)
            self._decodes = sum(1 for rid, n in self._scheduled.items()
                                if rid in sched.requests
                                and sched.requests[rid].num_computed_tokens - n >= sched.requests[rid].num_prompt_tokens)
            return out

        sched.schedule = recording_schedule
        self.last_step_stats = StepStats(0, time.time(), 0.0, 0, 0, 0, 0, 0, 0, 0, self.kv_stats())

    # ---- requests in ----------------------------------------------------------------------------
    def add(self, req: EngineCoreRequest) -> None:
        """Queue `req`; one vLLM's input processing refuses (a limit of its own, a
        constraint its back end rejects) ends `rejected` (`invalid_params`, vLLM's message)
        at the next step, as a request our core refuses after queueing does."""
        try:
            self._add(req)
        except Exception as e:  # VLLMValidationError is a ValueError; anything else from its checks too
            log.warning("vLLM refused request %s: %s", req.request_id, e)
            self._requests.pop(req.request_id, None)
            now = time.time()
            arrival = req.options.arrival_time or now
            self._refused.append(EngineCoreOutput(
                req.request_id, [], None, FinishReason.REJECTED, times=RequestTimes(arrival, None, None, now),
                error_code=RejectReason.INVALID_PARAMS.value, error_message=f"vLLM: {e}"[:1000]))

    def _add(self, req: EngineCoreRequest) -> None:
        o = req.options
        params = sampling_params(req)
        arrival = o.arrival_time if o.arrival_time is not None else time.time()
        lora = None
        if o.adapter is not None:
            if self._loras is None:  # our input processing refuses these first (no lora_dir)
                raise ValueError(f"adapter {o.adapter!r}: LoRA is not enabled")
            lora = self._loras.request(o.adapter)
        vreq = self._input.process_inputs(
            req.request_id, self._tokens_input(list(req.prompt_token_ids), cache_salt=o.cache_salt or None),
            params, self._tasks, arrival_time=arrival, lora_request=lora, priority=int(o.priority))
        self._input.assign_request_id(vreq)
        self._requests[req.request_id] = _Track(arrival, vreq.request_id)
        self._ours[vreq.request_id] = req.request_id
        request, wave = self._core.preprocess_add_request(vreq)
        self._core.add_request(request, wave)

    def abort(self, request_id: str) -> None:
        """Free its KV now (vLLM's abort); a `cancelled` output follows at the next step."""
        if self._end(request_id):
            self._cancelled.append(request_id)

    def finish(self, request_id: str, status: RequestStatus) -> None:
        """Output processing ended it (a stop string): free it, no output follows."""
        if self._end(request_id):
            track = self._requests.pop(request_id)
            self._ours.pop(track.vllm_id, None)

    def _end(self, request_id: str) -> bool:
        track = self._requests.get(request_id)
        if track is None:
            return False
        self._core.abort_requests([track.vllm_id])
        return True

    def has_unfinished(self) -> bool:
        return bool(self._cancelled or self._refused) or self._core.scheduler.has_requests()

    # ---- the step ---------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        start = time.time()
        t0 = time.perf_counter()
        self._scheduled, self._decodes = {}, 0
        outputs, self._refused = self._refused, []
        for rid in self._cancelled:
            outputs.append(self._final(rid, [], None, FinishReason.CANCELLED))
        self._cancelled = []
        preemptions = 0
        if self._core.scheduler.has_requests():
            by_client, executed = self._core.step_fn()
            self._core.post_step(model_executed=executed)
            now = time.time()
            for vid in self._scheduled:
                track = self._requests.get(self._ours.get(vid, ""))
                if track is not None and track.first_scheduled_time is None:
                    track.first_scheduled_time = start
            batch = by_client.get(0) if by_client else None
            for o in batch.outputs if batch is not None else ():
                rid = self._ours.get(o.request_id)
                if rid is None or rid not in self._requests:
                    continue  # aborted here: its `cancelled` output is made already
                track = self._requests[rid]
                for ev in o.events or ():
                    if ev.type == self._preempted:
                        track.num_preemptions += 1
                        preemptions += 1
                if o.new_token_ids and track.first_token_time is None:
                    track.first_token_time = now
                if o.prefill_stats is not None:  # on its first output only: its first admission's prefill
                    track.num_cached_tokens = o.prefill_stats.num_cached_tokens
                lps = logprobs(o.new_logprobs, len(o.new_token_ids))
                if o.finish_reason is None:
                    outputs.append(EngineCoreOutput(rid, list(o.new_token_ids), lps,
                                                    num_preemptions=track.num_preemptions))
                else:
                    outputs.append(self._final(rid, list(o.new_token_ids), lps, _FINISH[int(o.finish_reason)]))
        running, waiting = self._core.scheduler.get_request_counts()
        decode_tokens = self._decodes
        self._step += 1
        self.last_step_stats = StepStats(
            self._step, time.time(), time.perf_counter() - t0, running, waiting,
            sum(self._scheduled.values()) - decode_tokens, decode_tokens, preemptions, 0, 0, self.kv_stats(),
            forward_s=time.perf_counter() - t0)
        return outputs

    def _final(self, rid: str, new_ids: list[int], lps: list[TokenLogprobs] | None,
               reason: FinishReason) -> EngineCoreOutput:
        track = self._requests.pop(rid)
        self._ours.pop(track.vllm_id, None)
        times = RequestTimes(track.arrival_time, track.first_scheduled_time, track.first_token_time, time.time())
        return EngineCoreOutput(rid, new_ids, lps, reason, track.num_cached_tokens, track.num_preemptions, times)

    def kv_stats(self) -> KVStats:
        """Blocks of vLLM's cache: vLLM's free count includes cached (evictable) blocks,
        so `cached_blocks` is 0 here and they count as free."""
        pool = self._core.scheduler.kv_cache_manager.block_pool
        total = pool.num_gpu_blocks - 1  # vLLM keeps block 0 as its null block
        free = pool.get_num_free_blocks()
        return KVStats(total, max(0, total - free), free, 0, self._core.vllm_config.cache_config.block_size)


def share_forward_cpus(core: Any) -> set[int] | None:
    """On vLLM's CPU platform, bind every thread of this process to the CPUs its forward
    processes are bound to (`VLLM_CPU_OMP_THREADS_BIND`; by default all but the CPU vLLM
    reserves for the rest), and return them; None where there is nothing to bind to (no
    forward process of vLLM's multiprocess executor, or its CPUs are all this process may
    use anyway).

    Why: vLLM's CPU platform always runs the forward in a process of its multiprocess
    executor, and this process then waits for each step's result by spinning
    (`sched_yield`, for 1 s after every read of vLLM's shared-memory queue). On a CPU of
    its own that spin takes the CPU vLLM reserves for everything else, here the worker's
    front, Kafka, Redis and the gateway: at 8 req/s on 2 cores, bursts of requests took
    100-560 ms to their first token (TTFT p99 70-474 ms over four runs). Beside the
    forward, the two processes take turns: while one computes, the other yields to it
    (TTFT p99 45-56 ms, four runs; docs/engines.md). vLLM steps one batch at a time here
    (`EngineCore.step`), so the core's own work runs between forwards, not during one."""
    workers = getattr(core.model_executor, "workers", None) or ()
    try:
        cpus = set().union(*(os.sched_getaffinity(w.proc.pid) for w in workers))
        own = os.sched_getaffinity(0)
    except (AttributeError, OSError):  # not vLLM's multiprocess executor, or its worker is gone
        return None
    if not cpus or not cpus < own:
        return None
    for tid in os.listdir("/proc/self/task"):  # every thread: os.sched_setaffinity(0) binds only the caller
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that ended meanwhile
            continue
    return cpus


def _engine_config(start: VllmStart) -> Any:
    """vLLM's `VllmConfig` for `start` (model config read, arguments validated). Raises
    ConfigError naming `model.vllm_args` when vLLM refuses them."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    try:
        return EngineArgs(model=start.model, **engine_args(start, current_platform.is_cpu())).create_engine_config()
    except (TypeError, ValueError) as e:  # unknown keywords; values vLLM's config refuses (pydantic too)
        raise ConfigError(f"model.vllm_args: vLLM refused its engine arguments: {e}") from None


def build(start: VllmStart) -> tuple[VllmCore, Any]:
    """vLLM's engine core for `start` and the `Ready` facts. Raises ConfigError for
    arguments vLLM refuses (the message names `model.vllm_args`)."""
    import vllm
    from vllm.renderers import renderer_from_config
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.executor import Executor

    vllm_config = _engine_config(start)
    core = EngineCore(vllm_config, Executor.get_class(vllm_config), log_stats=True)
    renderer = renderer_from_config(vllm_config)
    model_config = vllm_config.model_config
    eos = {renderer.get_eos_token_id()}
    gen_eos = model_config.try_get_generation_config().get("eos_token_id")
    eos |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    cc = vllm_config.compilation_config
    forward = (f"vLLM {vllm.__version__} engine (compilation mode {cc.mode!s}, CUDA graphs {cc.cudagraph_mode!s}, "
               f"{'eager' if model_config.enforce_eager else 'not enforce_eager'})")
    vcore = VllmCore(core, InputProcessor(vllm_config, renderer), start.lora_dir)
    if vllm_config.device_config.device_type == "cpu" and (cpus := share_forward_cpus(core)):
        log.info("the engine core shares its forward's CPUs %s (it waits for each step by spinning)", sorted(cpus))
    kv = vcore.kv_stats()  # the blocks requests can use, as every step will report them
    ready = Ready(model_config.get_vocab_size(), model_config.max_model_len, kv.total_blocks, kv.block_size,
                  sorted(e for e in eos if e is not None), start.model, vllm_config.device_config.device_type,
                  model_config.get_sliding_window(), 0, lora_facts(start), forward)
    return vcore, ready


def check(start: VllmStart) -> dict[str, Any]:
    """vLLM's validation of `start`'s engine arguments and model config, without loading
    weights or starting workers (`inflight check`): what vLLM resolved. Raises
    ConfigError as `build` does."""
    import vllm

    config = _engine_config(start)
    m, p = config.model_config, config.parallel_config
    return {"vllm": vllm.__version__, "device": config.device_config.device_type,
            "architecture": (m.architectures or ["?"])[0], "dtype": str(m.dtype).removeprefix("torch."),
            "max_model_len": m.max_model_len, "tensor_parallel_size": p.tensor_parallel_size,
            "pipeline_parallel_size": p.pipeline_parallel_size, "quantization": m.quantization,
            "kv_cache_dtype": config.cache_config.cache_dtype, "lora": config.lora_config is not None}


def _check_main() -> int:
    """`python -m worker.engine.vllm_core --check`: `VllmStart` (msgpack) on stdin, the
    verdict as the last line of stdout (JSON: `check`'s facts, or {"error": ...}); exit
    0, 2 (a config error) or 1."""
    start = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=VllmStart)
    logging.basicConfig(level=start.log_level, stream=sys.stderr)
    try:
        verdict, rc = check(start), 0
    except (ConfigError, OSError) as e:  # OSError: a missing or unreadable checkpoint
        verdict, rc = {"error": str(e)[:2000]}, 2
    except Exception as e:
        verdict, rc = {"error": f"{type(e).__name__}: {e}"[:2000]}, 1
    sys.stdout.write("\n" + msgspec.json.encode(verdict).decode() + "\n")
    sys.stdout.flush()
    return rc


def main(argv: list[str] | None = None) -> int:
    """Main of the core process (`python -m worker.engine.vllm_core FD_IN FD_OUT` in vLLM's
    interpreter): read `VllmStart`, build, send `Ready` (or `Failed`), then
    `core_proc.serve_core` until `Shutdown` or the front-end goes away. With `--check`
    instead: `_check_main`."""
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--check"]:
        return _check_main()
    p = argparse.ArgumentParser(description="vLLM engine core process (started by the worker)")
    p.add_argument("fd_in", type=int)
    p.add_argument("fd_out", type=int)
    a = p.parse_args(argv)
    ignore_group_signals()  # the worker stops this process (core_proc.ignore_group_signals)
    conn_in, conn_out = Connection(a.fd_in, writable=False), Connection(a.fd_out, readable=False)
    start = msgspec.msgpack.decode(conn_in.recv_bytes(), type=VllmStart)
    logging.basicConfig(level=start.log_level, stream=sys.stderr,
                        format='{"level":"%(levelname)s","logger":"%(name)s","event":"%(message)s"}')
    encode = msgspec.msgpack.Encoder().encode
    try:
        core, ready = build(start)
        conn_out.send_bytes(encode(ready))
    except (ConfigError, FileNotFoundError, PermissionError) as e:
        log.error("vLLM engine core cannot start: %s", e)
        conn_out.send_bytes(encode(Failed(str(e)[:2000], is_config_error=True)))
        return 2
    except Exception as e:
        log.exception("vLLM engine core failed to start")
        conn_out.send_bytes(encode(Failed(f"{type(e).__name__}: {e}"[:2000])))
        return 1
    return serve_core(core, conn_in, conn_out)


if __name__ == "__main__":
    sys.exit(main())
