"""EngineCore: the step loop over the scheduler, the KV cache and the model runner
(vLLM V1's `EngineCore`). It takes validated `EngineCoreRequest`s and produces token ids
(`EngineCoreOutput`), no text: input processing and detokenization live outside it
(`input_processor.py`, `output_processor.py`), so it can run in its own process with the device while the
caller's process does everything else.

Threading: `add` and `abort` may be called from any thread (thread-safe deques, applied
at the next step boundary); `step` and `finish` run on one thread, the only code that
touches the scheduler and the KV cache. An aborted request's KV blocks are free when the
`step` that applied the abort returns.

Asynchronous steps (`serving_tuning.async_scheduling`): step N+1 is scheduled and
launched behind step N while N runs, its decodes fed N's tokens on the device (the
rules: `forward.py`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque

import torch

from worker.config import ServingTuning
from worker.engine import batch
from worker.engine.arrivals import Arrivals
from worker.engine.draft import Drafter
from worker.engine.failures import Failures, ForwardFailures
from worker.engine.forward import start_forward
from worker.engine.kv_cache import KVCacheManager
from worker.engine.kv_host import KVCopyError
from worker.engine.kv_window import SlidingWindowKVCacheManager
from worker.engine.outputs import (
    EngineCoreOutput,
    EngineCoreRequest,
    HostKVStepStats,
    KVStats,
    ModelRunnerOutput,
    RequestTimes,
    Runner,
    SchedulerOutput,
    SpecStepStats,
    StepHandle,
    StepStats,
)
from worker.engine.request import FINISH_REASONS, ErrorCode, Request, RequestStatus
from worker.engine.scheduler import Scheduler
from worker.engine.structured import GrammarCompiler

log = logging.getLogger(__name__)


class EngineCore:
    """The step loop: schedule, run the forward, apply its tokens; validated requests in, token ids out (no text).

    Args:
        runner: the model runner (`Runner` protocol), owner of the KV tensors.
        tuning: `serving_tuning`.
        num_blocks: KV blocks of the cache.
        eos_token_ids: ids that end generation (unless `ignore_eos`).
        model_id: namespace of prefix-cache hashes.
        sliding_window: W when every layer of the model reads only the last W positions
            (blocks behind it are freed: `kv_window.py`); None otherwise.
        grammars: compiles the grammars of constrained requests (`structured.py`); None:
            a request with a grammar ends `rejected`.
        drafter: the draft model of `speculative.method: draft` (`draft.py`); without one
            that method is off.

    Structured outputs: a request with a grammar waits outside the scheduler until its
    grammar is compiled (on the compiler's thread; cached by content), then joins it like
    any new request; so a step never waits for a compile. Aborts and deadlines reach it
    while it waits (`arrivals.py`).
    """

    def __init__(self, runner: Runner, tuning: ServingTuning, num_blocks: int, eos_token_ids: frozenset[int],
                 model_id: str, sliding_window: int | None = None, grammars: GrammarCompiler | None = None,
                 drafter: Drafter | None = None) -> None:
        self._runner = runner
        self.tuning = tuning
        self.eos_token_ids = eos_token_ids
        state_slots = runner.capabilities.state_slots
        if state_slots and tuning.enable_prefix_caching:
            log.info("prefix caching is off: the model keeps recurrent state per request, which is not a set "
                     "of blocks a prefix could share (worker/model/recurrent.py)")
        prefix_caching = tuning.enable_prefix_caching and not state_slots
        if sliding_window is None:
            self.kv = KVCacheManager(num_blocks, tuning.kv_block_size, enable_prefix_caching=prefix_caching,
                                     namespace=model_id.encode(), host_slots=runner.capabilities.host_kv_slots,
                                     state_slots=state_slots)
        else:
            self.kv = SlidingWindowKVCacheManager(
                num_blocks, tuning.kv_block_size, sliding_window=sliding_window, max_chunk=tuning.max_batched_tokens,
                enable_prefix_caching=prefix_caching, namespace=model_id.encode(), state_slots=state_slots)
        self.scheduler = Scheduler(tuning, self.kv)
        if self.scheduler.speculation is not None and (sliding_window is not None
                                                       or not runner.capabilities.speculation):
            log.warning("serving_tuning.speculative is off: %s", "the model is windowed (its KV behind the window "
                        "is freed as progress advances, which a rejected draft would take back)"
                        if sliding_window is not None else "this model runner does not verify drafts")
            self.scheduler.speculation = None
        spec = self.scheduler.speculation
        if spec is not None and spec.config.method == "draft" and drafter is None:
            log.warning("serving_tuning.speculative is off: method 'draft' and no draft model loaded")
            self.scheduler.speculation = None
        self.drafter = drafter if self.scheduler.speculation is not None else None
        # the proposer's counters at the last step's end
        self._spec_before = self.scheduler.speculation.stats.copy() if self.scheduler.speculation else None
        self._traced = False  # a traced request was added: prefill chunks are recorded from then on
        self._aborts: deque[str] = deque()
        self._arrival = itertools.count()
        self.failures = ForwardFailures(self.scheduler, runner, tuning, self._final_output)
        self.last_step_stats: StepStats | None = None
        self._forward_total_s = 0.0  # device time of runners that do not measure it themselves
        # speculative decoding runs sequential steps: a draft is proposed from the request's known tokens
        self.async_scheduling = (tuning.async_scheduling if tuning.async_scheduling is not None
                                 else runner.capabilities.overlaps_host) and self.scheduler.speculation is None
        self._in_flight: deque[tuple[SchedulerOutput, StepHandle]] = deque()  # launched, not applied (async)
        # steps run ahead: a table changed in place by the next schedule must not reach the step in flight
        self.scheduler.steps_ahead = self.async_scheduling
        self.scheduler.copy_block_tables = self.async_scheduling and self.kv.changes_tables_in_place
        self.arrivals = Arrivals(self.scheduler, grammars, self._make_request, self._final_output)
        self._mask_s = 0.0  # this step's structured-output mask seconds
        self._kv_copy_s = 0.0  # this step's host-tier copy seconds
        self._host_before = (0, 0)  # the host tier's saved and loaded block counts at the last step's end

    @property
    def runner(self) -> Runner:
        return self._runner

    @runner.setter
    def runner(self, runner: Runner) -> None:
        """Swap the model runner (tests, benchmarks); between steps only."""
        self._runner = runner
        self.failures.runner = runner

    # ---- requests in (any thread) ----------------------------------------------------
    def add(self, req: EngineCoreRequest) -> None:
        """Queue a validated request; it joins the batch at the next step."""
        self.arrivals.add(req)

    def abort(self, request_id: str) -> None:
        """Cancel a request: blocks freed, a `cancelled` output next step (unknown ids: no-op)."""
        self._aborts.append(request_id)

    def finish(self, request_id: str, status: RequestStatus) -> None:
        """End a request that output processing ended (stop string, output error): blocks
        freed now (a step in flight computes on without it, its token dropped: forward.py
        says why that is safe), no output follows (the caller made the final one). From the
        stepping thread, between steps; unknown or finished ids are ignored."""
        if self.arrivals.compiling.pop(request_id) is None:
            self.scheduler.finish(request_id, status)

    @property
    def num_queued(self) -> int:
        return self.arrivals.num_queued

    def has_unfinished(self) -> bool:
        return (bool(self.arrivals) or bool(self._aborts) or self.scheduler.has_unfinished()
                or bool(self._in_flight))

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
        failed = Failures()
        self._mask_s = self._kv_copy_s = 0.0
        preempted_before = self.scheduler.num_preemptions_total
        capped_before = self.scheduler.long_prefills.num_capped_total
        long_before = self.scheduler.long_prefills.num_tokens_total
        if self.async_scheduling:
            done, forward_s = self._step_async(outputs, failed)
        else:
            done, forward_s = self._step_sync(outputs, failed)
        num_decode = done.num_decodes + done.num_spec_tokens if done is not None else 0  # of forwards that succeeded
        num_prefill = done.num_scheduled_tokens - num_decode if done is not None else 0
        self._forward_total_s += forward_s
        sched_ = self.scheduler
        hits, misses, compile_s, num_constrained = self.arrivals.compiling.stats(sched_.requests.values())
        self.last_step_stats = StepStats(
            step=sched_.step_count,
            time=time.time(),
            duration_s=time.perf_counter() - t0,
            num_running=sched_.num_running,
            num_waiting=sched_.num_waiting + len(self.arrivals),
            num_prefill_tokens=num_prefill,
            num_decode_tokens=num_decode,
            num_preemptions=sched_.num_preemptions_total - preempted_before - failed.num_oom_retried,
            num_oom_retried=failed.num_oom_retried,
            num_oom_failed=failed.num_oom_failed,
            kv=self.kv.stats(),
            num_internal_errors=failed.num_internal_errors,
            num_failed_forwards=failed.num_failed_forwards,
            forward_s=forward_s,
            device_busy_s=(self._runner.device_busy_s() if self._runner.capabilities.device_time
                           else self._forward_total_s),
            num_constrained=num_constrained, mask_s=self._mask_s,
            grammar_cache_hits=hits,
            grammar_cache_misses=misses,
            grammar_compile_s=compile_s,
            num_long_prefill_capped=sched_.long_prefills.num_capped_total - capped_before,
            num_long_prefill_tokens=sched_.long_prefills.num_tokens_total - long_before,
            lora=sched_.loras.step_stats() if sched_.loras is not None else None,
            spec=self._spec_step_stats(),
            host_kv=self._host_step_stats(),
        )
        stats = self.last_step_stats
        if stats.spec is not None and done is not None and num_prefill == 0 and not failed.num_failed_forwards:
            # a decode-only step: what it cost, with or without guesses (the step-cost rule)
            sched_.speculation.cost.observe(stats.spec.num_drafts > 0, len(done.scheduled) + stats.spec.num_accepted_tokens,
                                            stats.duration_s)
        return outputs

    def _host_step_stats(self) -> HostKVStepStats | None:
        """The host tier's copies since the last step (None: no tier)."""
        host = self.kv.host
        if host is None:
            return None
        saved, loaded = host.num_saved - self._host_before[0], host.num_loaded - self._host_before[1]
        self._host_before = (host.num_saved, host.num_loaded)
        slot_bytes = self._runner.capabilities.host_kv_slot_bytes
        return HostKVStepStats(saved, loaded, saved * slot_bytes, loaded * slot_bytes, self._kv_copy_s)

    def _spec_step_stats(self) -> SpecStepStats | None:
        """The proposer's counters since the last step (None: speculation is off)."""
        spec = self.scheduler.speculation
        if spec is None:
            return None
        out = spec.stats.since(self._spec_before)
        self._spec_before = spec.stats.copy()
        return out

    def _step_sync(self, outputs: list[EngineCoreOutput], failed: Failures) -> tuple[SchedulerOutput | None, float]:
        """apply queued work -> schedule -> forward -> update. Returns the part of the
        batch whose forward succeeded (None if none ran) and the forward's seconds."""
        self._apply_queued(outputs)
        sched_ = self.scheduler
        if not sched_.has_unfinished():
            self._await_grammars()
            return None, 0.0
        sched = sched_.schedule(self.failures.budget_cap)
        if sched.num_scheduled_tokens == 0:
            self._await_grammars()
            return None, 0.0
        f0 = time.perf_counter()
        if self.drafter is not None:  # the draft model's guesses, in the blocks just scheduled
            self.drafter.fill(sched)
        try:  # the forward, under the failure rules of `step`
            done = sched, self.runner.execute(sched)
        except Exception as e:
            done = self.failures.recover(sched, e, outputs, failed)
        forward_s = time.perf_counter() - f0
        if done is None:
            return None, forward_s
        self._after_forward(done[0], done[1], outputs)
        return done[0], forward_s

    def _step_async(self, outputs: list[EngineCoreOutput], failed: Failures) -> tuple[SchedulerOutput | None, float]:
        """apply queued work -> launch a step if none is in flight -> schedule and launch
        the next one behind it (its decodes' inputs are placeholders for the tokens the
        one in flight samples) -> wait for the oldest -> apply it (`forward.py`).
        Returns what `_step_sync` returns; the seconds are those spent waiting."""
        self._apply_queued(outputs)
        in_flight = self._in_flight
        if not in_flight:
            launched = self._launch_next()
            if launched is None:
                self._await_grammars()
                return None, 0.0
            in_flight.append(launched)
        if len(in_flight) == 1 and self._runner.capabilities.async_launch:
            ahead = self._launch_next(after=in_flight[0][1])
            if ahead is not None:
                in_flight.append(ahead)
        sched, handle = in_flight.popleft()
        f0 = time.perf_counter()
        try:
            done = sched, handle.result()
        except Exception as e:  # the forward failed: discard what was launched behind it, then the sequential rules
            self._discard_in_flight()
            done = self.failures.recover(batch.resolve_placeholders(sched), e, outputs, failed)
        forward_s = time.perf_counter() - f0
        if done is None:
            return None, forward_s
        self._after_forward(done[0], done[1], outputs)
        return done[0], forward_s

    def _discard_in_flight(self) -> None:
        """Wait for every launched step and take it back unapplied (after a failure of the
        one before them: the runner skips them, `StepSkipped`, running their host-tier
        copies still). A `KVCopyError` among them propagates (the core stops)."""
        while self._in_flight:
            sched, handle = self._in_flight.pop()
            try:
                handle.result()
            except KVCopyError:
                raise
            except Exception:  # skipped, or failed behind the failure being handled
                pass
            batch.unschedule(sched)

    def _launch_next(self, after: StepHandle | None = None) -> tuple[SchedulerOutput, StepHandle] | None:
        """Schedule the next step and start its forward without waiting (`runner.launch`,
        or a forward run here for a runner without one), behind the step `after` in
        flight if any. None if nothing is scheduled."""
        sched_ = self.scheduler
        if not sched_.has_unfinished():
            return None
        sched = sched_.schedule(self.failures.budget_cap)
        if sched.num_scheduled_tokens == 0:
            return None
        return sched, start_forward(self.runner, sched, after)

    def _apply_queued(self, outputs: list[EngineCoreOutput]) -> None:
        """New requests (those with a grammar once it is compiled), expired deadlines
        (`arrivals.py`), aborts (in that order)."""
        sched_ = self.scheduler
        self.arrivals.move_on(outputs)
        self._apply_aborts(outputs)
        if sched_.loras is not None and sched_.loras.has_failures:  # waiting requests of an adapter that failed to load
            sched_.loras.end_failed(sched_, lambda req, err: outputs.append(self._final_output(req, [], error=err)))

    def _await_grammars(self) -> None:  # nothing else to run: wait (bounded) for a compile or an adapter's load
        if (pending := self.arrivals.compiling or self.scheduler.loras) is not None:
            pending.wait(0.005)

    def _apply_aborts(self, outputs: list[EngineCoreOutput]) -> None:
        """Finish the aborted requests (after the queued adds: an abort of a request added
        in the same window finds it)."""
        while self._aborts:
            rid = self._aborts.popleft()
            if self.arrivals.end_compiling(rid, RequestStatus.FINISHED_ABORTED, outputs):
                continue
            req = self.scheduler.finish(rid, RequestStatus.FINISHED_ABORTED)
            if req is not None:
                outputs.append(self._final_output(req, []))

    def _make_request(self, r: EngineCoreRequest) -> Request:
        """The scheduler's request for `r`: arrival order, EOS ids, a generator on the
        runner's device when seeded."""
        generator = None
        if r.params.seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(r.params.seed)
        self._traced |= r.options.traced
        return Request.from_core_request(r, eos_token_ids=self.eos_token_ids, arrival_seq=next(self._arrival),
                                         generator=generator)

    def _after_forward(self, sched: SchedulerOutput, runner_out: ModelRunnerOutput,
                       outputs: list[EngineCoreOutput]) -> None:
        self.failures.after_success()
        self._mask_s += runner_out.mask_s
        self._kv_copy_s += runner_out.kv_copy_s
        now = time.time()
        logprobs = runner_out.logprobs
        if self._traced:  # prefill chunks of traced requests (none is looked for before one came)
            batch.note_prefill_chunks(sched, now)
        finished = RequestStatus.FINISHED_STOPPED  # and every status after it
        append = outputs.append
        for req, num_new in self.scheduler.update_from_output(sched, runner_out):
            if req.first_token_time is None:
                req.first_token_time = now
            new_ids = req.all_token_ids[-num_new:]
            lps = logprobs.get(req.request_id) if logprobs else None
            if lps is not None:
                lps = lps[:num_new]
            if req.status >= finished:
                error = None
                if req.status == RequestStatus.FINISHED_ERROR and req.grammar is not None:
                    error = (ErrorCode.INTERNAL, f"structured output: {req.grammar.error}")
                append(self._final_output(req, new_ids, lps, error))
            else:
                append(EngineCoreOutput(req.request_id, new_ids, lps))

    @staticmethod
    def _final_output(req: Request, new_ids: list[int], lps: list | None = None,
                      error: tuple[str, str] | None = None) -> EngineCoreOutput:
        return EngineCoreOutput(
            req.request_id, new_ids, lps, FINISH_REASONS[req.status],
            req.num_cached_tokens, req.num_preemptions,
            RequestTimes(req.arrival_time, req.first_scheduled_time, req.first_token_time, time.time(), req.trace),
            str(error[0]) if error else None, error[1] if error else None, req.stop_in_text,
        )

    def check_invariants(self) -> None:
        """Raise RuntimeError if KV bookkeeping is inconsistent (call from the stepping thread)."""
        self.kv.check_invariants()
        if not self.scheduler.has_unfinished() and self.kv.stats().used_blocks != 0:
            raise RuntimeError(f"no unfinished requests but {self.kv.stats().used_blocks} KV blocks in use")
