"""What a forward that raises does to the step (the rules of `EngineCore.step`): out of
memory preempts the batch by recompute and halves the step token budget, which doubles
back after `OOM_BACKOFF_RECOVERY_STEPS` good steps; any other exception runs each request
of the batch once more alone, so one poison request cannot take its neighbours with it.
Runs on the engine thread, between the forward and the update.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker.config import ServingTuning
from worker.engine import batch
from worker.engine.kv_host import KVCopyError
from worker.engine.outputs import (
    EngineCoreOutput,
    ModelRunnerOutput,
    Runner,
    ScheduledRequest,
    SchedulerOutput,
)
from worker.engine.request import ErrorCode, RequestStatus
from worker.engine.scheduler import Scheduler
from worker.obs.errors import one_line

OOM_BACKOFF_RECOVERY_STEPS = 64  # successful steps before the token budget doubles back

# torch >= 2.5 exposes the CUDA OOM as torch.OutOfMemoryError (alias of torch.cuda.OutOfMemoryError)
OutOfMemoryError = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

log = logging.getLogger("worker.engine.core")


def job_fields(job_ids: list[str], limit: int = 20) -> dict:
    """`extra` of a log line about several requests: their ids (the first `limit`) and
    how many (rendered as `job_ids` / `num_jobs` fields by `worker.obs.log`)."""
    return {"job_ids": list(job_ids[:limit]), "num_jobs": len(job_ids)}


@dataclass(slots=True)
class Failures:
    """What failed in one step (folded into its StepStats)."""

    num_failed_forwards: int = 0
    num_oom_retried: int = 0
    num_oom_failed: int = 0
    num_internal_errors: int = 0


class ForwardFailures:
    """The failure rules for one engine core, and the token budget they lower.

    Args:
        scheduler, runner, tuning: the core's.
        final_output: makes a request's last output (`EngineCore._final_output`).
    """

    def __init__(self, scheduler: Scheduler, runner: Runner, tuning: ServingTuning,
                 final_output: Callable[..., EngineCoreOutput]) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.tuning = tuning
        self._final_output = final_output
        self.budget_cap: int | None = None  # lowered step token budget after an OOM
        self._steps_since_oom = 0

    def after_success(self) -> None:
        """A forward succeeded: the budget doubles back after enough of them."""
        if self.budget_cap is not None:
            self._steps_since_oom += 1
            if self._steps_since_oom >= OOM_BACKOFF_RECOVERY_STEPS:
                self._steps_since_oom = 0
                self.budget_cap *= 2
                if self.budget_cap >= self.tuning.max_batched_tokens:
                    self.budget_cap = None

    def recover(
        self, sched: SchedulerOutput, e: Exception, outputs: list[EngineCoreOutput], failed: Failures
    ) -> tuple[SchedulerOutput, ModelRunnerOutput] | None:
        """The forward of `sched` raised `e`: out of memory -> back off (`_handle_oom`);
        else each request runs once more alone, here. `sched` holds no placeholder
        (`batch.resolve_placeholders`). Returns the part of the batch whose forward
        succeeded and its output (to apply), or None.

        Raises:
            KVCopyError: `e` is one (the host tier's copies failed: registered blocks may
                not hold their content, so nothing is retried; the core stops).
        """
        if isinstance(e, KVCopyError):
            raise e
        failed.num_failed_forwards += 1
        batch.unschedule(sched)  # progress back to before the step; retries mark theirs again
        if isinstance(e, OutOfMemoryError):
            self._handle_oom(sched.scheduled, sched.num_scheduled_tokens, e, outputs, failed)
            return None
        if len(sched.scheduled) == 1:
            self._fail_internal(sched.scheduled[0], e, outputs, failed)
            return None
        log.warning("forward of step %d (%d requests, %d tokens) failed; running each request alone",
                    sched.step, len(sched.scheduled), sched.num_scheduled_tokens, exc_info=e,
                    extra=job_fields([x.request_id for x in sched.scheduled]))
        ok: list[ScheduledRequest] = []
        ok_reqs = []
        merged = ModelRunnerOutput(sampled_token_ids={})
        num_decodes = 0
        for i, (s, req) in enumerate(zip(sched.scheduled, sched.requests)):
            is_decode = i < sched.num_decodes
            alone = SchedulerOutput(step=sched.step, scheduled=[s], num_scheduled_tokens=s.num_tokens,
                                    num_decodes=int(is_decode), requests=[req],
                                    num_spec_tokens=s.num_tokens if s.draft else 0)
            batch.reschedule(alone)
            try:
                out = self.runner.execute(alone)
            except OutOfMemoryError as e:
                failed.num_failed_forwards += 1
                batch.unschedule(alone)
                self._handle_oom([s], s.num_tokens, e, outputs, failed)
            except Exception as e:
                failed.num_failed_forwards += 1
                batch.unschedule(alone)
                self._fail_internal(s, e, outputs, failed)
            else:
                ok.append(s)
                ok_reqs.append(req)
                num_decodes += is_decode
                merged.sampled_token_ids.update(out.sampled_token_ids)
                merged.logprobs.update(out.logprobs)
                merged.mask_s += out.mask_s
        if not ok:
            return None
        return SchedulerOutput(sched.step, ok, sum(s.num_tokens for s in ok), num_decodes, ok_reqs,
                               num_spec_tokens=sum(s.num_tokens for s in ok if s.draft)), merged

    def _fail_internal(
        self, s: ScheduledRequest, exc: Exception, outputs: list[EngineCoreOutput], failed: Failures
    ) -> None:
        """End a request whose forward raised (alone): finished(error, internal); blocks freed."""
        log.error("request %s failed in its forward", s.request_id, exc_info=exc, extra={"job_id": s.request_id})
        req = self.scheduler.finish(s.request_id, RequestStatus.FINISHED_ERROR)
        if req is not None:
            outputs.append(self._final_output(req, [], error=(ErrorCode.INTERNAL, one_line(exc))))
            failed.num_internal_errors += 1

    def _handle_oom(
        self, scheduled: list[ScheduledRequest], num_tokens: int, exc: BaseException,
        outputs: list[EngineCoreOutput], failed: Failures,
    ) -> None:
        """Preempt (retry) or fail each request of a forward of `num_tokens` tokens that
        ran out of memory; free their blocks; halve the token budget."""
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        self.budget_cap = max(1, num_tokens // 2)
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
                    self.budget_cap, extra=job_fields([x.request_id for x in scheduled]))
