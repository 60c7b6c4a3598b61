"""Engine: the public API every other part (worker, benchmarks, demo) uses.

Threading: `add_request` and `abort` may be called from any thread; they validate
and tokenize in the caller's thread and hand over through thread-safe deques.
`step` runs on one thread (the engine thread) and is the only code that touches the
scheduler, KV cache and model. New requests and aborts take effect at the next step
boundary; an aborted request's KV blocks are free when that `step` returns.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from schemas.params import SamplingParams
from worker.config import EngineConfig, ModelConfig, ServingTuning
from worker.engine.kv_cache import KVCacheManager
from worker.engine.outputs import (
    CompletionOutput,
    KVStats,
    ModelRunnerOutput,
    RequestOutput,
    RequestTimes,
    ScheduledRequest,
    SchedulerOutput,
    StepStats,
    TokenLogprobs,
    Usage,
)
from worker.engine.request import (
    FINISH_REASONS,
    ErrorCode,
    Priority,
    RejectReason,
    Request,
    RequestRejected,
    RequestStatus,
)
from worker.engine.scheduler import Scheduler

if TYPE_CHECKING:
    from worker.model.detokenizer import IncrementalDetokenizer
    from worker.model.loader import LoadedModel
    from worker.model.runner import ModelRunner

CPU_DEFAULT_KV_TOKENS = 16384
OOM_BACKOFF_RECOVERY_STEPS = 64  # successful steps before the token budget doubles back

log = logging.getLogger(__name__)


def job_fields(job_ids: list[str], limit: int = 20) -> dict:
    """`extra` of a log line about several requests: their ids (the first `limit`) and
    how many (rendered as `job_ids` / `num_jobs` fields by `worker.log`)."""
    return {"job_ids": list(job_ids[:limit]), "num_jobs": len(job_ids)}

# torch >= 2.5 exposes the CUDA OOM as torch.OutOfMemoryError (alias of torch.cuda.OutOfMemoryError)
OutOfMemoryError = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


@dataclass(slots=True)
class _Failures:
    """What failed in one step (folded into its StepStats)."""

    num_failed_forwards: int = 0
    num_oom_retried: int = 0
    num_oom_failed: int = 0
    num_internal_errors: int = 0


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message`, at most `limit` characters (no traceback)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}"[:limit] if lines else type(exc).__name__


def kv_cache_blocks(loaded: LoadedModel, tuning: ServingTuning) -> int:
    """KV blocks the engine allocates for `loaded` (call after the model is on its device).

    Capacity in tokens: `tuning.max_total_tokens` if set; else on CUDA
    `gpu_memory_utilization` x the device's free memory / `kv_bytes_per_token`; else
    `CPU_DEFAULT_KV_TOKENS`. Rounded down to whole blocks of `kv_block_size` tokens.
    """
    from worker.model.runner import ModelRunner

    per_token = ModelRunner.kv_bytes_per_token(loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, loaded.dtype)
    if tuning.max_total_tokens is not None:
        kv_tokens = tuning.max_total_tokens
    elif loaded.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(loaded.device)
        kv_tokens = int(free * tuning.gpu_memory_utilization) // per_token
    else:
        kv_tokens = CPU_DEFAULT_KV_TOKENS
    return kv_tokens // tuning.kv_block_size


class Engine:
    """Continuous-batching generation engine over a paged KV cache.

    Build with `Engine.from_pretrained(path, config)`. Typical loop:

        engine.add_request("a", prompt="Hello", params=SamplingParams(max_tokens=8))
        while engine.has_unfinished():
            for out in engine.step():
                print(out.request_id, out.text, out.finish_reason)
    """

    def __init__(self, loaded: LoadedModel, runner: ModelRunner, config: EngineConfig, num_blocks: int) -> None:
        from worker.model.detokenizer import IncrementalDetokenizer

        self._detok_cls = IncrementalDetokenizer
        self.config = config
        self.tuning = config.serving_tuning
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self._decoder = getattr(loaded.tokenizer, "backend_tokenizer", None) or loaded.tokenizer
        self.runner = runner
        self.max_model_len = loaded.max_model_len
        self.kv = KVCacheManager(
            num_blocks,
            self.tuning.kv_block_size,
            enable_prefix_caching=self.tuning.enable_prefix_caching,
            namespace=loaded.model_id.encode(),
        )
        self.scheduler = Scheduler(self.tuning, self.kv)
        self._new: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._live_ids: set[str] = set()
        self._live_lock = threading.Lock()
        self._arrival = itertools.count()
        self._detoks: dict[str, IncrementalDetokenizer] = {}
        self._logprobs: dict[str, list[TokenLogprobs]] = {}
        self._deadlines: list[tuple[float, str]] = []  # (deadline, request id) heap, engine thread
        self._budget_cap: int | None = None  # lowered token budget after an OOM
        self._steps_since_oom = 0
        self.last_step_stats: StepStats | None = None

    # ---- construction --------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, config: EngineConfig | None = None) -> Engine:
        """Load a local Hugging Face checkpoint directory and size the KV cache.

        KV capacity: `serving_tuning.max_total_tokens` if set; else on CUDA
        `gpu_memory_utilization` of the free memory after loading; else 16384 tokens.
        """
        from worker.model.kernels import get_backend
        from worker.model.loader import load_model
        from worker.model.runner import ModelRunner

        config = config or EngineConfig()
        model_cfg = ModelConfig(**{**_struct_dict(config.model), "path": path})
        config = EngineConfig(model=model_cfg, serving_tuning=config.serving_tuning)
        loaded = load_model(model_cfg)
        tuning = config.serving_tuning
        num_blocks = kv_cache_blocks(loaded, tuning)
        runner = ModelRunner(
            loaded.model,
            num_blocks=num_blocks,
            block_size=tuning.kv_block_size,
            num_layers=loaded.num_layers,
            num_kv_heads=loaded.num_kv_heads,
            head_dim=loaded.head_dim,
            device=loaded.device,
            dtype=loaded.dtype,
            backend=get_backend(model_cfg.attention_backend, loaded.device.type),
        )
        return cls(loaded, runner, config, num_blocks)

    # ---- requests in (any thread) ----------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        params: SamplingParams | None = None,
        priority: Priority | str = Priority.NORMAL,
        cache_salt: str = "",
        tenant: str | None = None,
        arrival_time: float | None = None,
        deadline: float | None = None,
    ) -> int:
        """Validate, tokenize and queue a request; it joins the batch at the next step.

        Exactly one of `prompt` (text), `prompt_token_ids`, `messages` (chat, rendered
        with the tokenizer's chat template). `cache_salt` (e.g. the tenant) keeps its
        prefix-cache blocks apart from other salts. `tenant` is whose share and quotas
        the request counts against (`serving_tuning.tenants`; None: the tenant `""`).
        `arrival_time` and `deadline` are
        wall-clock seconds (`time.time()`); a request still waiting (never scheduled) at
        its deadline ends with `finish_reason="expired"`, `error_code="deadline_passed"`.

        BOS: the ids of a text prompt or of chat messages never start with more than one
        BOS id. A text that already begins with the BOS text (`"<s>Paris…"`), tokenized by
        a tokenizer that prepends BOS, gives two (as transformers' `encode` does): the
        leading duplicates are dropped and one BOS is kept (logged at debug level); the
        same holds for a chat template whose output starts with repeated BOS.
        `prompt_token_ids` are used exactly as given.

        Returns:
            the number of prompt tokens (after the BOS rule).

        Raises:
            RequestRejected: with a `RejectReason`; the request was not queued.
        """
        params = params or SamplingParams()
        try:
            prio = Priority.parse(priority)
        except ValueError as e:
            raise RequestRejected(request_id, RejectReason.INVALID_PARAMS, str(e)) from None
        ids = self._tokenize(request_id, prompt, prompt_token_ids, messages)
        max_tokens = self._check_limits(request_id, ids, params, tenant or "")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        req = Request(
            request_id,
            ids,
            params,
            max_tokens=max_tokens,
            priority=prio,
            eos_token_ids=self.loaded.eos_token_ids,
            arrival_seq=next(self._arrival),
            arrival_time=time.time() if arrival_time is None else arrival_time,
            cache_salt=cache_salt.encode(),
            tenant=tenant or "",
            generator=generator,
        )
        req.deadline = deadline
        with self._live_lock:
            if request_id in self._live_ids:
                raise RequestRejected(request_id, RejectReason.DUPLICATE_REQUEST_ID, "a request with this id is unfinished")
            if self.tuning.overload_policy == "reject":
                busy = self.scheduler.num_running + self.scheduler.num_waiting + len(self._new)
                if busy >= self.tuning.max_running_requests:
                    raise RequestRejected(
                        request_id, RejectReason.OVERLOADED, f"{busy} requests in flight, no free slot"
                    )
            self._live_ids.add(request_id)
            self._new.append(req)
        return len(ids)

    def abort(self, request_id: str) -> None:
        """Cancel a request. Its blocks are freed and a `cancelled` output is emitted by
        the next `step`. Unknown or finished ids are ignored."""
        self._aborts.append(request_id)

    def _tokenize(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: Sequence[int] | None,
        messages: list[dict[str, Any]] | None,
    ) -> list[int]:
        given = [x is not None for x in (prompt, prompt_token_ids, messages)]
        if sum(given) != 1:
            raise RequestRejected(
                request_id, RejectReason.INVALID_PROMPT, "give exactly one of prompt, prompt_token_ids, messages"
            )
        if prompt is not None:
            ids = self.tokenizer.encode(prompt, add_special_tokens=True) if prompt else []
        elif messages is not None:
            if not messages:
                ids = []
            else:
                try:
                    ids = list(
                        self.tokenizer.apply_chat_template(
                            messages, add_generation_prompt=True, tokenize=True, return_dict=False
                        )
                    )
                except Exception as e:  # template errors are the producer's input errors
                    raise RequestRejected(request_id, RejectReason.INVALID_PROMPT, f"chat template failed: {e}") from e
        else:
            ids = list(prompt_token_ids or [])
            vocab = self.loaded.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise RequestRejected(
                    request_id, RejectReason.INVALID_PROMPT, f"token ids out of range [0, {vocab}): {bad[:5]}"
                )
        if not ids:
            raise RequestRejected(request_id, RejectReason.EMPTY_PROMPT, "the prompt has no tokens")
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if prompt_token_ids is None and bos is not None and len(ids) > 1 and ids[1] == bos and ids[0] == bos:
            n = next((i for i, t in enumerate(ids) if t != bos), len(ids))
            log.debug("request %s: prompt starts with %d BOS ids; keeping one", request_id, n,
                      extra={"job_id": request_id})
            ids = ids[n - 1 :]
        return ids

    def _check_limits(self, request_id: str, ids: list[int], params: SamplingParams, tenant: str = "") -> int:
        """Admission checks that do not depend on load. Returns the resolved max_tokens."""
        t = self.tuning
        n = len(ids)
        if n > t.max_input_tokens:
            raise RequestRejected(
                request_id, RejectReason.PROMPT_TOO_LONG, f"prompt has {n} tokens, max_input_tokens is {t.max_input_tokens}"
            )
        if params.max_tokens is None:
            max_tokens = min(t.max_output_tokens, self.max_model_len - n)
        else:
            max_tokens = params.max_tokens
            if max_tokens > t.max_output_tokens:
                raise RequestRejected(
                    request_id,
                    RejectReason.INVALID_PARAMS,
                    f"params.max_tokens {max_tokens} exceeds max_output_tokens {t.max_output_tokens}",
                )
        if max_tokens < 1 or n + max_tokens > self.max_model_len:
            raise RequestRejected(
                request_id,
                RejectReason.EXCEEDS_CONTEXT,
                f"prompt {n} + max_tokens {max_tokens} tokens exceed the model context of {self.max_model_len}",
            )
        capacity = self.kv.num_blocks * self.kv.block_size
        if n + max_tokens > capacity:
            raise RequestRejected(
                request_id,
                RejectReason.EXCEEDS_KV_CAPACITY,
                f"prompt {n} + max_tokens {max_tokens} tokens can never fit the KV cache of {capacity} tokens",
            )
        quota = t.tenant_policy(tenant).max_kv_blocks
        if quota is not None and n + max_tokens > quota * self.kv.block_size:
            raise RequestRejected(
                request_id,
                RejectReason.EXCEEDS_KV_CAPACITY,
                f"prompt {n} + max_tokens {max_tokens} tokens can never fit tenant {tenant!r}'s quota of "
                f"{quota} KV blocks ({quota * self.kv.block_size} tokens)",
            )
        return max_tokens

    # ---- the step (engine thread) ----------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self._new) or bool(self._aborts) or self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Apply queued requests and aborts, run one forward, return per-request deltas.

        A forward that raises does not propagate; it ends no request that did not cause it:
          - out of memory (`torch.OutOfMemoryError`, CUDA's OOM): every request of the
            batch is preempted by recompute and retried, at most
            `serving_tuning.max_oom_retries` times each, then finished with
            `finish_reason="error"`, `error_code="oom"`; the step token budget is halved
            and recovers by doubling after `OOM_BACKOFF_RECOVERY_STEPS` good steps;
          - any other exception: if the batch holds several requests, each is run once
            more alone, in this step, so one poison request cannot take its neighbours
            with it; a request whose forward raises alone (or that was alone) ends with
            `finish_reason="error"`, `error_code="internal"` and a one-line message
            (type and first line; the traceback goes to the log only). An out of memory
            in a lone retry follows the rule above for that request.
        An exception while turning a request's token into output (detokenization) ends
        that request the same way. Ended requests' blocks are free when `step` returns,
        and the engine keeps serving. Exceptions elsewhere (scheduler or KV bookkeeping)
        are broken invariants and propagate; the engine is then unusable.

        After every call `last_step_stats` describes the step (see `StepStats`).
        """
        t0 = time.perf_counter()
        outputs: list[RequestOutput] = []
        while self._new:
            req = self._new.popleft()
            self.scheduler.add(req)
            self._detoks[req.request_id] = self._detok_cls(self._decoder, req.params.stop)
            if req.deadline is not None:
                heapq.heappush(self._deadlines, (req.deadline, req.request_id))
        if self._deadlines and self._deadlines[0][0] < time.time():
            self._expire_waiting(outputs)
        while self._aborts:
            req = self.scheduler.finish(self._aborts.popleft(), RequestStatus.FINISHED_ABORTED)
            if req is not None:
                outputs.append(self._final_output(req, [], ""))
        failed = _Failures()
        num_decode = num_prefill = 0  # tokens computed by forwards that succeeded
        preempted_before = self.scheduler.num_preemptions_total
        if self.scheduler.has_unfinished():
            sched = self.scheduler.schedule(self._budget_cap)
            if sched.num_scheduled_tokens > 0:
                done = self._forward(sched, outputs, failed)
                if done is not None:
                    ok, runner_out = done
                    self._after_forward(ok, runner_out, outputs, failed)
                    num_decode = ok.num_decodes
                    num_prefill = ok.num_scheduled_tokens - num_decode
        self.last_step_stats = StepStats(
            step=self.scheduler.step_count,
            time=time.time(),
            duration_s=time.perf_counter() - t0,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting + len(self._new),
            num_prefill_tokens=num_prefill,
            num_decode_tokens=num_decode,
            num_preemptions=self.scheduler.num_preemptions_total - preempted_before - failed.num_oom_retried,
            num_oom_retried=failed.num_oom_retried,
            num_oom_failed=failed.num_oom_failed,
            kv=self.kv.stats(),
            num_internal_errors=failed.num_internal_errors,
            num_failed_forwards=failed.num_failed_forwards,
        )
        return outputs

    def _forward(
        self, sched: SchedulerOutput, outputs: list[RequestOutput], failed: _Failures
    ) -> tuple[SchedulerOutput, ModelRunnerOutput] | None:
        """Run the step's forward under the failure rules of `step`. Returns the part of
        the batch whose forward succeeded and its runner output, or None if none did."""
        try:
            return sched, self.runner.execute(sched)
        except OutOfMemoryError as e:
            failed.num_failed_forwards += 1
            self._handle_oom(sched.scheduled, sched.num_scheduled_tokens, e, outputs, failed)
            return None
        except Exception as e:
            failed.num_failed_forwards += 1
            if len(sched.scheduled) == 1:
                self._fail_internal(sched.scheduled[0], e, outputs, failed)
                return None
            log.warning("forward of step %d (%d requests, %d tokens) failed; running each request alone",
                        sched.step, len(sched.scheduled), sched.num_scheduled_tokens, exc_info=True,
                        extra=job_fields([x.request_id for x in sched.scheduled]))
        ok: list[ScheduledRequest] = []
        merged = ModelRunnerOutput(sampled_token_ids={})
        num_decodes = 0
        for i, s in enumerate(sched.scheduled):
            is_decode = i < sched.num_decodes
            alone = SchedulerOutput(step=sched.step, scheduled=[s], num_scheduled_tokens=s.num_tokens,
                                    num_decodes=int(is_decode))
            try:
                out = self.runner.execute(alone)
            except OutOfMemoryError as e:
                failed.num_failed_forwards += 1
                self._handle_oom([s], s.num_tokens, e, outputs, failed)
            except Exception as e:
                failed.num_failed_forwards += 1
                self._fail_internal(s, e, outputs, failed)
            else:
                ok.append(s)
                num_decodes += is_decode
                merged.sampled_token_ids.update(out.sampled_token_ids)
                merged.logprobs.update(out.logprobs)
        if not ok:
            return None
        num_tokens = sum(s.num_tokens for s in ok)
        return SchedulerOutput(sched.step, ok, num_tokens, num_decodes, sched.preempted_ids), merged

    def _fail_internal(
        self, s: ScheduledRequest, exc: Exception, outputs: list[RequestOutput], failed: _Failures
    ) -> None:
        """End a request whose forward raised (alone): finished(error, internal); blocks freed."""
        log.error("request %s failed in its forward", s.request_id, exc_info=exc, extra={"job_id": s.request_id})
        req = self.scheduler.finish(s.request_id, RequestStatus.FINISHED_ERROR)
        if req is not None:
            outputs.append(self._final_output(req, [], "", error=(ErrorCode.INTERNAL, _one_line(exc))))
            failed.num_internal_errors += 1

    def _expire_waiting(self, outputs: list[RequestOutput]) -> None:
        """Requests never scheduled yet whose deadline passed end `expired` (KV untouched);
        a deadline does not cut a request that has started."""
        now = time.time()
        while self._deadlines and self._deadlines[0][0] < now:
            deadline, rid = heapq.heappop(self._deadlines)
            req = self.scheduler.requests.get(rid)
            if req is None or req.status != RequestStatus.WAITING:
                continue
            self.scheduler.finish(rid, RequestStatus.FINISHED_EXPIRED)
            message = f"deadline {deadline} passed while the request waited"
            outputs.append(self._final_output(req, [], "", error=(ErrorCode.DEADLINE_PASSED, message)))

    def _after_forward(
        self, sched: SchedulerOutput, runner_out: ModelRunnerOutput, outputs: list[RequestOutput],
        failed: _Failures,
    ) -> None:
        if self._budget_cap is not None:
            self._steps_since_oom += 1
            if self._steps_since_oom >= OOM_BACKOFF_RECOVERY_STEPS:
                self._steps_since_oom = 0
                self._budget_cap *= 2
                if self._budget_cap >= self.tuning.max_batched_tokens:
                    self._budget_cap = None
        now = time.time()
        for req in self.scheduler.update_from_output(sched, runner_out):
            rid = req.request_id
            token_id = req.all_token_ids[-1]
            if req.first_token_time is None:
                req.first_token_time = now
            lp = runner_out.logprobs.get(rid)
            try:
                if lp is not None:
                    self._logprobs.setdefault(rid, []).append(lp)
                detok = self._detoks[rid]
                # A token that ended the request by EOS / stop_token_ids is not part of the text.
                delta = detok.add([token_id]) if req.status != RequestStatus.FINISHED_STOPPED else ""
                if detok.stopped and not req.is_finished:
                    self.scheduler.finish(rid, RequestStatus.FINISHED_STOPPED)
                if req.is_finished:
                    outputs.append(self._final_output(req, [token_id], delta, lp))
                else:
                    outputs.append(RequestOutput(rid, [token_id], delta, logprobs=[lp] if lp else None))
            except Exception as e:  # this request's output cannot be produced: end it, keep the others
                log.error("request %s failed turning token %d into output", rid, token_id, exc_info=True,
                          extra={"job_id": rid})
                self.scheduler.finish(rid, RequestStatus.FINISHED_ERROR)  # no-op if the token had ended it
                self._detoks.pop(rid, None)  # its held-back text cannot be decoded: no flush
                err = (ErrorCode.INTERNAL, _one_line(e))
                outputs.append(self._final_output(req, [token_id], "", lp, err, RequestStatus.FINISHED_ERROR))
                failed.num_internal_errors += 1

    def _handle_oom(
        self, scheduled: list[ScheduledRequest], num_tokens: int, exc: BaseException,
        outputs: list[RequestOutput], failed: _Failures,
    ) -> None:
        """Preempt (retry) or fail each request of a forward of `num_tokens` tokens that
        ran out of memory; free their blocks; halve the token budget."""
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        self._budget_cap = max(1, num_tokens // 2)
        self._steps_since_oom = 0
        retried = num_failed = 0
        for s in scheduled:
            req = self.scheduler.requests.get(s.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            req.num_ooms += 1
            if req.num_ooms > self.tuning.max_oom_retries:
                self.scheduler.finish(req.request_id, RequestStatus.FINISHED_ERROR)
                message = f"out of memory in {req.num_ooms} steps of this request: {_one_line(exc)}"
                outputs.append(self._final_output(req, [], "", error=(ErrorCode.OOM, message)))
                num_failed += 1
            else:
                self.scheduler.preempt(req.request_id)
                retried += 1
        failed.num_oom_retried += retried
        failed.num_oom_failed += num_failed
        log.warning("out of memory in step %d (%d tokens, %d requests): %d retried, %d failed; token budget now %d",
                    self.scheduler.step_count, num_tokens, len(scheduled), retried, num_failed,
                    self._budget_cap, extra=job_fields([x.request_id for x in scheduled]))

    def _final_output(
        self,
        req: Request,
        new_ids: list[int],
        delta: str,
        lp: TokenLogprobs | None = None,
        error: tuple[str, str] | None = None,
        status: RequestStatus | None = None,
    ) -> RequestOutput:
        """The request's last output. `status` overrides the terminal status the
        scheduler gave it (a request whose last token could not be turned into output)."""
        rid = req.request_id
        detok = self._detoks.pop(rid, None)
        if detok is not None:
            delta += detok.flush()
        self._logprobs.pop(rid, None)
        with self._live_lock:
            self._live_ids.discard(rid)
        return RequestOutput(
            rid,
            new_ids,
            delta,
            finished=True,
            finish_reason=FINISH_REASONS[req.status if status is None else status],
            usage=Usage(req.num_prompt_tokens, req.num_output_tokens, req.num_cached_tokens),
            logprobs=[lp] if lp else None,
            num_preemptions=req.num_preemptions,
            times=RequestTimes(req.arrival_time, req.first_scheduled_time, req.first_token_time, time.time()),
            error_code=str(error[0]) if error else None,
            error_message=error[1] if error else None,
        )

    # ---- conveniences ----------------------------------------------------------------
    def kv_stats(self) -> KVStats:
        """Block counts of the KV cache (engine thread; a snapshot)."""
        return self.kv.stats()

    def generate(
        self,
        prompts: Iterable[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Priority | str = Priority.NORMAL,
    ) -> list[CompletionOutput]:
        """Run a batch of prompts (text or token id lists) to completion, in order.

        Raises:
            RequestRejected: for the first prompt that is rejected (none is run then).
        """
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        base = f"generate-{next(self._arrival)}"
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        for rid, p, sp in zip(ids, prompts, params):
            if isinstance(p, str):
                self.add_request(rid, p, params=sp, priority=priority)
            else:
                self.add_request(rid, prompt_token_ids=list(p), params=sp, priority=priority)
        prompt_ids: dict[str, list[int]] = {r.request_id: list(r.all_token_ids) for r in self._new if r.request_id in ids}
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        texts: dict[str, list[str]] = {rid: [] for rid in ids}
        lps: dict[str, list[TokenLogprobs]] = {rid: [] for rid in ids}
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.request_id not in tokens:
                    continue
                tokens[out.request_id].extend(out.new_token_ids)
                texts[out.request_id].append(out.text)
                if out.logprobs:
                    lps[out.request_id].extend(out.logprobs)
                if out.finished:
                    done[out.request_id] = out
        return [
            CompletionOutput(
                request_id=rid,
                prompt_token_ids=prompt_ids[rid],
                token_ids=tokens[rid],
                text="".join(texts[rid]),
                finish_reason=done[rid].finish_reason or "",
                usage=done[rid].usage or Usage(len(prompt_ids[rid]), len(tokens[rid])),
                logprobs=lps[rid] or None,
            )
            for rid in ids
        ]

    def check_invariants(self) -> None:
        """Raise RuntimeError if KV bookkeeping is inconsistent (call from the engine thread)."""
        self.kv.check_invariants()
        if not self.scheduler.has_unfinished() and self.kv.stats().used_blocks != 0:
            raise RuntimeError(f"no unfinished requests but {self.kv.stats().used_blocks} KV blocks in use")


def _struct_dict(s: Any) -> dict[str, Any]:
    import msgspec

    return msgspec.structs.asdict(s)
