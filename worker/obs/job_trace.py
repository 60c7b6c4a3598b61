"""The trace of one attempt of one job at a worker (`JobTrace`): its CONSUMER span and
the timestamps of its phases, turned into child spans when the job ends (the span tree
is drawn in `worker.obs.tracing`). Only `OtelTracing.open_job` makes one, so nothing
here runs, or imports OpenTelemetry, while tracing is off."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from worker.obs.trace_context import ACTIVE, context_from_headers, ns

if TYPE_CHECKING:
    from schemas.wire import Finished
    from worker.engine.outputs import RequestTimes


class JobTrace:
    """The trace of one attempt of one job at this worker: its CONSUMER span (started
    when the record was read, ended when its offset is done) and the timestamps of its
    phases (Unix seconds), turned into child spans at the end. Written on the event loop
    only. `tracing`: the `OtelTracing` that made it (its tracer). `trace_id` / `span_id`:
    hex ids of the CONSUMER span (log lines, exemplars)."""

    __slots__ = ("tracing", "span", "job_id", "trace_id", "span_id", "exemplar", "tokenize", "submitted",
                 "engine", "engine_events", "terminal_at", "published_at", "recorded", "ended", "num_preemptions")

    def __init__(self, tracing: Any, span: Any, job_id: str) -> None:
        self.tracing = tracing
        self.span = span
        self.job_id = job_id
        sc = span.get_span_context()
        self.trace_id = format(sc.trace_id, "032x")
        self.span_id = format(sc.span_id, "016x")
        self.exemplar = {"trace_id": self.trace_id, "span_id": self.span_id}
        self.tokenize: tuple[float, float] | None = None
        self.submitted: float | None = None
        self.engine: RequestTimes | None = None
        self.engine_events: list = []
        self.terminal_at: float | None = None
        self.published_at: float | None = None
        self.recorded: tuple[float, float] | None = None
        self.ended = False
        self.num_preemptions = 0

    def child(self, name: str, start: float, end: float, attributes: dict[str, Any] | None = None,
              events: Iterable[tuple[str, dict[str, Any], float]] = ()) -> None:
        """A finished child span of the CONSUMER span, from `start` to `end` (Unix s)."""
        trace = self.tracing._trace
        span = self.tracing.tracer.start_span(name, context=trace.set_span_in_context(self.span),
                                              start_time=ns(start), attributes=attributes)
        for ev_name, ev_attrs, t in events:
            span.add_event(ev_name, ev_attrs, ns(t))
        span.end(end_time=ns(max(end, start)))

    def event(self, name: str, attributes: dict[str, Any] | None = None, t: float | None = None) -> None:
        if not self.ended:
            self.span.add_event(name, attributes or {}, ns(t if t is not None else time.time()))

    def cancel_requested(self, headers: Iterable[tuple[str, bytes | None]] | None = None) -> None:
        """A cancel arrived: an event, and a link to the cancel's own trace when its record
        carried one."""
        self.event("cancel_requested")
        ctx = context_from_headers(headers) if headers else None
        if ctx is not None and not self.ended:
            self.span.add_link(self.tracing._trace.get_current_span(ctx).get_span_context(),
                               {"inflight.link": "cancel"})

    def engine_done(self, times: RequestTimes | None) -> None:
        """The engine's last output for the job: its timestamps (and traced events)."""
        self.engine = times
        if times is not None and times.events:
            self.engine_events = list(times.events)

    def terminated(self, held: Any, term: Finished, now: float) -> None:
        """The terminal event `term` was drafted: outcome attributes and events."""
        self.terminal_at = now
        span = self.span
        reason = held.finish_reason.value if held.finish_reason is not None else "error"
        span.set_attribute("gen_ai.response.finish_reasons", [reason])
        span.set_attribute("inflight.finish_reason", reason)
        if held.first_token_time is not None:
            span.add_event("first_token", {}, ns(held.first_token_time))
        if held.cancel_time_mono is not None or reason == "cancelled":
            span.add_event("cancelled", {}, ns(now))
        err = held.error
        if err is not None:
            span.set_attribute("error.type", err.code)
            if reason in ("error", "rejected"):
                from opentelemetry.trace import Status, StatusCode

                span.set_status(Status(StatusCode.ERROR, f"{err.code}: {err.message}"[:500]))
            span.add_event(reason if reason == "rejected" else "error",
                           {"inflight.error_code": err.code, "inflight.error_message": err.message[:500]}, ns(now))
        if held.dead_letter is not None:
            span.set_attribute("inflight.dead_letter", held.dead_letter[0])
        usage = term.usage
        if usage is not None:
            span.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
            if usage.cached_prompt_tokens is not None:
                span.set_attribute("inflight.prefix_cache_hit_tokens", usage.cached_prompt_tokens)
        timings = term.timings
        if timings is not None:
            for name in ("queue_s", "ttft_s", "tpot_s", "e2e_s"):
                value = getattr(timings, name)
                if value is not None:
                    span.set_attribute(f"inflight.{name.replace('queue_s', 'queue_time_s')}", value)
        if held.summary.get("preemptions"):
            span.set_attribute("inflight.preemptions", held.summary["preemptions"])
        if self.tracing.capture_content:
            span.set_attribute("gen_ai.output.messages", term.text)

    def end(self, now: float, outcome: str | None = None) -> None:
        """The job is done here (offset done) or given up (`outcome`: `handed_back`,
        `lost`): build the phase spans, end the CONSUMER span, export."""
        if self.ended:
            return
        self.ended = True
        ACTIVE.pop(self.job_id, None)
        span = self.span
        if self.tokenize is not None:
            self.child("tokenize", *self.tokenize)
        times = self.engine
        if self.submitted is not None:
            first_sched = times.first_scheduled_time if times is not None else None
            queue_end = first_sched if first_sched is not None else (times.finished_time if times else now)
            self.child("engine.queue", self.submitted, queue_end)
            if times is not None and first_sched is not None:
                chunks = [("prefill_chunk", {"inflight.tokens": e.tokens}, e.time) for e in self.engine_events
                          if e.name == "prefill_chunk"]
                first_tok = times.first_token_time
                self.child("prefill", first_sched, first_tok if first_tok is not None else times.finished_time,
                           {"inflight.chunks": len(chunks)}, chunks)
                if first_tok is not None:
                    self.child("decode", first_tok, times.finished_time)
            for e in self.engine_events:
                if e.name == "preempted":
                    span.add_event("preempted", {"inflight.reason": e.reason, "inflight.computed_tokens": e.tokens},
                                   ns(e.time))
                elif e.name != "prefill_chunk":
                    span.add_event(e.name, {"inflight.reason": e.reason} if e.reason else {}, ns(e.time))
        if self.terminal_at is not None and self.published_at is not None:
            self.child("publish", self.terminal_at, self.published_at)
        if self.recorded is not None:
            self.child("results.write", *self.recorded)
        if outcome is not None:
            span.add_event(outcome, {}, ns(now))
            span.set_attribute("inflight.outcome", outcome)
        else:
            span.add_event("offset_done", {}, ns(now))
        span.end(end_time=ns(now))
