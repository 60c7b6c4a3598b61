"""EngineCore: the step loop over the scheduler, the KV cache and the model runner
(vLLM V1's `EngineCore`). It takes validated `EngineCoreRequest`s and produces token ids
(`EngineCoreOutput`), no text: input processing and detokenization live outside it
(`input_processor.py`, `output_processor.py`), so it can run in its own process with the device while the
caller's process does everything else.

Threading: `add` and `abort` may be called from any thread (thread-safe deques, applied
at the next step boundary); `step` and `finish` run on one thread, the only code that
touches the scheduler, the KV cache and the model. An aborted request's KV blocks are
free when the `step` that applied the abort returns.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from worker.config import ServingTuning
from worker.engine.kv_cache import KVCacheManager
from worker.engine.kv_window import SlidingWindowKVCacheManager
from worker.engine.outputs import (
    EngineCoreOutput,
    EngineCoreRequest,
    KVStats,
    ModelRunnerOutput,
    RequestTimes,
    Runner,
    ScheduledRequest,
    SchedulerOutput,
    StepStats,
)
from worker.engine.request import FINISH_REASONS, ErrorCode, Priority, Request, RequestStatus
from worker.engine.scheduler import Scheduler
from worker.obs.errors import one_line

OOM_BACKOFF_RECOVERY_STEPS = 64  # successful steps before the token budget doubles back

log = logging.getLogger(__name__)

# torch >= 2.5 exposes the CUDA OOM as torch.OutOfMemoryError (alias of torch.cuda.OutOfMemoryError)
OutOfMemoryError = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def job_fields(job_ids: list[str], limit: int = 20) -> dict:
    """`extra` of a log line about several requests: their ids (the first `limit`) and
    how many (rendered as `job_ids` / `num_jobs` fields by `worker.obs.log`)."""
    return {"job_ids": list(job_ids[:limit]), "num_jobs": len(job_ids)}


@dataclass(slots=True)
class _Failures:
    """What failed in one step (folded into its StepStats)."""

    num_failed_forwards: int = 0
    num_oom_retried: int = 0
    num_oom_failed: int = 0
    num_internal_errors: int = 0


class EngineCore:
    """Args:
    runner: the model runner (`Runner` protocol), owner of the KV tensors.
    tuning: `serving_tuning`.
    num_blocks: KV blocks of the cache.
    eos_token_ids: ids that end generation (unless `ignore_eos`).
    model_id: namespace of prefix-cache hashes.
    sliding_window: W when every layer of the model reads only the last W positions
        (blocks behind it are freed: `kv_window.py`); None otherwise.
    """

    def __init__(self, runner: Runner, tuning: ServingTuning, num_blocks: int, eos_token_ids: frozenset[int],
                 model_id: str, sliding_window: int | None = None) -> None:
        self.runner = runner
        self.tuning = tuning
        self.eos_token_ids = eos_token_ids
        if sliding_window is None:
            self.kv = KVCacheManager(num_blocks, tuning.kv_block_size,
                                     enable_prefix_caching=tuning.enable_prefix_caching, namespace=model_id.encode())
        else:
            self.kv = SlidingWindowKVCacheManager(
                num_blocks, tuning.kv_block_size, sliding_window=sliding_window, max_chunk=tuning.max_batched_tokens,
                enable_prefix_caching=tuning.enable_prefix_caching, namespace=model_id.encode())
        self.scheduler = Scheduler(tuning, self.kv)
        self._new: deque[EngineCoreRequest] = deque()
        self._aborts: deque[str] = deque()
        self._arrival = itertools.count()
        self._deadlines: list[tuple[float, str]] = []  # (deadline, request id) heap
        self._budget_cap: int | None = None  # lowered token budget after an OOM
        self._steps_since_oom = 0
        self.last_step_stats: StepStats | None = None
        self._forward_total_s = 0.0  # device time of runners that do not measure it themselves
        self._runner_busy = getattr(runner, "device_busy_s", None)

    # ---- requests in (any thread) ----------------------------------------------------
    def add(self, req: EngineCoreRequest) -> None:
        """Queue a validated request; it joins the batch at the next step."""
        self._new.append(req)

    def abort(self, request_id: str) -> None:
        """Cancel a request: blocks freed and a `cancelled` output at the next step.
        Unknown or finished ids are ignored."""
        self._aborts.append(request_id)

    def finish(self, request_id: str, status: RequestStatus) -> None:
        """End a request that output processing ended (stop string, output error): its
        blocks are freed now and no output follows (the caller made the final one).
        Call from the stepping thread, between steps. Unknown or finished ids are ignored."""
        self.scheduler.finish(request_id, status)

    @property
    def num_queued(self) -> int:
        return len(self._new)

    def has_unfinished(self) -> bool:
        return bool(self._new) or bool(self._aborts) or self.scheduler.has_unfinished()

    def kv_stats(self) -> KVStats:
        """Block counts of the KV cache (a snapshot)."""
        return self.kv.stats()

    # ---- the step (one thread) -----------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Apply queued requests, aborts and finishes, run one forward, return per-request
        token outputs.

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
        Ended requests' blocks are free when `step` returns, and the core keeps serving.
        Exceptions elsewhere (scheduler or KV bookkeeping) are broken invariants and
        propagate; the core is then unusable.

        After every call `last_step_stats` describes the step (see `StepStats`).
        """
        t0 = time.perf_counter()
        outputs: list[EngineCoreOutput] = []
        sched_ = self.scheduler
        while self._new:
            sched_.add(self._make_request(self._new.popleft()))
        if self._deadlines and self._deadlines[0][0] < time.time():
            self._expire_waiting(outputs)
        while self._aborts:
            req = sched_.finish(self._aborts.popleft(), RequestStatus.FINISHED_ABORTED)
            if req is not None:
                outputs.append(self._final_output(req, []))
        failed = _Failures()
        num_decode = num_prefill = 0  # tokens computed by forwards that succeeded
        forward_s = 0.0
        preempted_before = sched_.num_preemptions_total
        if sched_.has_unfinished():
            sched = sched_.schedule(self._budget_cap)
            if sched.num_scheduled_tokens > 0:
                f0 = time.perf_counter()
                done = self._forward(sched, outputs, failed)
                forward_s = time.perf_counter() - f0
                if done is not None:
                    ok, runner_out = done
                    self._after_forward(ok, runner_out, outputs)
                    num_decode = ok.num_decodes
                    num_prefill = ok.num_scheduled_tokens - num_decode
        self._forward_total_s += forward_s
        self.last_step_stats = StepStats(
            step=sched_.step_count,
            time=time.time(),
            duration_s=time.perf_counter() - t0,
            num_running=sched_.num_running,
            num_waiting=sched_.num_waiting + len(self._new),
            num_prefill_tokens=num_prefill,
            num_decode_tokens=num_decode,
            num_preemptions=sched_.num_preemptions_total - preempted_before - failed.num_oom_retried,
            num_oom_retried=failed.num_oom_retried,
            num_oom_failed=failed.num_oom_failed,
            kv=self.kv.stats(),
            num_internal_errors=failed.num_internal_errors,
            num_failed_forwards=failed.num_failed_forwards,
            forward_s=forward_s,
            device_busy_s=self._runner_busy() if self._runner_busy is not None else self._forward_total_s,
        )
        return outputs

    def _make_request(self, r: EngineCoreRequest) -> Request:
        generator = None
        if r.params.seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(r.params.seed)
        req = Request(r.request_id, r.prompt_token_ids, r.params, max_tokens=r.max_tokens, priority=Priority(r.priority),
                      eos_token_ids=self.eos_token_ids, arrival_seq=next(self._arrival), arrival_time=r.arrival_time,
                      cache_salt=r.cache_salt.encode(), tenant=r.tenant, generator=generator)
        req.deadline = r.deadline
        if r.deadline is not None:
            heapq.heappush(self._deadlines, (r.deadline, r.request_id))
        return req

    def _forward(
        self, sched: SchedulerOutput, outputs: list[EngineCoreOutput], failed: _Failures
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
        return SchedulerOutput(sched.step, ok, sum(s.num_tokens for s in ok), num_decodes), merged

    def _fail_internal(
        self, s: ScheduledRequest, exc: Exception, outputs: list[EngineCoreOutput], failed: _Failures
    ) -> None:
        """End a request whose forward raised (alone): finished(error, internal); blocks freed."""
        log.error("request %s failed in its forward", s.request_id, exc_info=exc, extra={"job_id": s.request_id})
        req = self.scheduler.finish(s.request_id, RequestStatus.FINISHED_ERROR)
        if req is not None:
            outputs.append(self._final_output(req, [], error=(ErrorCode.INTERNAL, one_line(exc))))
            failed.num_internal_errors += 1

    def _expire_waiting(self, outputs: list[EngineCoreOutput]) -> None:
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
            outputs.append(self._final_output(req, [], error=(ErrorCode.DEADLINE_PASSED, message)))

    def _after_forward(self, sched: SchedulerOutput, runner_out: ModelRunnerOutput,
                       outputs: list[EngineCoreOutput]) -> None:
        if self._budget_cap is not None:
            self._steps_since_oom += 1
            if self._steps_since_oom >= OOM_BACKOFF_RECOVERY_STEPS:
                self._steps_since_oom = 0
                self._budget_cap *= 2
                if self._budget_cap >= self.tuning.max_batched_tokens:
                    self._budget_cap = None
        now = time.time()
        logprobs = runner_out.logprobs
        for req in self.scheduler.update_from_output(sched, runner_out):
            if req.first_token_time is None:
                req.first_token_time = now
            token_id = req.all_token_ids[-1]
            lp = logprobs.get(req.request_id)
            if req.is_finished:
                outputs.append(self._final_output(req, [token_id], lp))
            else:
                outputs.append(EngineCoreOutput(req.request_id, [token_id], [lp] if lp is not None else None))

    def _handle_oom(
        self, scheduled: list[ScheduledRequest], num_tokens: int, exc: BaseException,
        outputs: list[EngineCoreOutput], failed: _Failures,
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
                message = f"out of memory in {req.num_ooms} steps of this request: {one_line(exc)}"
                outputs.append(self._final_output(req, [], error=(ErrorCode.OOM, message)))
                num_failed += 1
            else:
                self.scheduler.preempt(req.request_id)
                retried += 1
        failed.num_oom_retried += retried
        failed.num_oom_failed += num_failed
        log.warning("out of memory in step %d (%d tokens, %d requests): %d retried, %d failed; token budget now %d",
                    self.scheduler.step_count, num_tokens, len(scheduled), retried, num_failed,
                    self._budget_cap, extra=job_fields([x.request_id for x in scheduled]))

    @staticmethod
    def _final_output(req: Request, new_ids: list[int], lp=None, error: tuple[str, str] | None = None) -> EngineCoreOutput:
        return EngineCoreOutput(
            req.request_id, new_ids, [lp] if lp is not None else None, FINISH_REASONS[req.status],
            req.num_cached_tokens, req.num_preemptions,
            RequestTimes(req.arrival_time, req.first_scheduled_time, req.first_token_time, time.time()),
            str(error[0]) if error else None, error[1] if error else None,
        )

    def check_invariants(self) -> None:
        """Raise RuntimeError if KV bookkeeping is inconsistent (call from the stepping thread)."""
        self.kv.check_invariants()
        if not self.scheduler.has_unfinished() and self.kv.stats().used_blocks != 0:
            raise RuntimeError(f"no unfinished requests but {self.kv.stats().used_blocks} KV blocks in use")
