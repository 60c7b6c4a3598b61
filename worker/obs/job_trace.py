"""The trace of one attempt of one job at a worker (`JobTrace`): its CONSUMER span and
the timestamps of its phases, turned into finished spans when the job ends (the span
tree is drawn in `worker.obs.tracing`).

A worker traces hundreds of jobs a second, so no live SDK `Span` is kept per job: the
sampling decision and the ids are taken when the job is claimed (the SDK's sampler and
id generator), attributes and events gather in plain dicts and lists, and each span is
handed to the batch processor as a finished `ReadableSpan` with its own start and end
times (`SpanKit.emit`); that skips the SDK's per-call locking and validation (about 4x
cheaper per job on the loop). Only `OtelTracing.open_job` makes a JobTrace, so nothing
here runs, or imports OpenTelemetry, while tracing is off."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from worker.obs.trace_context import ACTIVE, context_from_headers, ns

if TYPE_CHECKING:
    from schemas.wire import Finished
    from worker.engine.outputs import RequestTimes


class SpanKit:
    """What building finished spans needs: the SDK classes, the provider's resource,
    sampler and id generator, the instrumentation scope and the span processor that
    queues them for export."""

    def __init__(self, provider: Any, processor: Any) -> None:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

        self.trace, self.Event, self.ReadableSpan, self.Link, self.SpanContext = trace, Event, ReadableSpan, Link, \
            SpanContext
        self.kinds = SpanKind
        self.error = lambda description: Status(StatusCode.ERROR, description)
        self.unset = Status(StatusCode.UNSET)
        self.sampled = TraceFlags(TraceFlags.SAMPLED)
        self.resource = provider.resource
        self.sampler = provider.sampler
        self.ids = provider.id_generator
        self.scope = InstrumentationScope("inflight")
        self.processor = processor

    def emit(self, name: str, context: Any, parent: Any, start: float, end: float, attributes: dict | None = None,
             events: Iterable = (), kind: Any = None, status: Any = None, links: Iterable = ()) -> None:
        """Queue one finished span (`start`, `end`: Unix s) for export."""
        self.processor.on_end(self.ReadableSpan(
            name=name, context=context, parent=parent, resource=self.resource, attributes=attributes or {},
            events=tuple(events), links=tuple(links), kind=kind or self.kinds.INTERNAL, status=status or self.unset,
            start_time=ns(start), end_time=ns(max(end, start)), instrumentation_scope=self.scope))

    def new_context(self, trace_id: int, trace_state: Any = None) -> Any:
        """A new span's context in trace `trace_id`, carrying `trace_state` (W3C: a span's
        trace state is its parent's unless the sampler changed it)."""
        return self.SpanContext(trace_id, self.ids.generate_span_id(), is_remote=False, trace_flags=self.sampled,
                                trace_state=trace_state)


class JobTrace:
    """The trace of one attempt of one job at this worker: its CONSUMER span (from when
    the record was read to when its offset is done) and the timestamps of its phases
    (Unix s), emitted as finished spans by `end`. Written on the event loop only.
    `trace_id` / `span_id`: hex ids of the CONSUMER span (log lines, exemplars)."""

    __slots__ = ("kit", "capture_content", "job_id", "name", "ctx", "parent", "start", "attrs", "events", "links",
                 "status", "trace_id", "span_id", "exemplar", "tokenize", "submitted", "engine", "terminal_at",
                 "published_at", "recorded", "ended")

    def __init__(self, kit: SpanKit, name: str, ctx: Any, parent: Any, start: float, attrs: dict, job_id: str,
                 capture_content: bool = False) -> None:
        self.kit = kit
        self.capture_content = capture_content
        self.job_id = job_id
        self.name = name
        self.ctx = ctx
        self.parent = parent  # the producer's SpanContext, or None (a new trace)
        self.start = start
        self.attrs = attrs
        self.events: list = []
        self.links: list = []
        self.status = None
        self.trace_id = format(ctx.trace_id, "032x")
        self.span_id = format(ctx.span_id, "016x")
        self.exemplar = {"trace_id": self.trace_id, "span_id": self.span_id}
        self.tokenize: tuple[float, float] | None = None
        self.submitted: float | None = None
        self.engine: RequestTimes | None = None
        self.terminal_at: float | None = None
        self.published_at: float | None = None
        self.recorded: tuple[float, float] | None = None
        self.ended = False

    @classmethod
    def open(cls, kit: SpanKit, name: str, parent_ctx: Any, start: float, attrs: dict, job_id: str,
             capture_content: bool = False) -> JobTrace | None:
        """Sample a new attempt (parent-based on the producer's context `parent_ctx`, an
        OpenTelemetry Context or None); None if not sampled."""
        parent = kit.trace.get_current_span(parent_ctx).get_span_context() if parent_ctx is not None else None
        trace_id = parent.trace_id if parent is not None else kit.ids.generate_trace_id()
        result = kit.sampler.should_sample(parent_ctx, trace_id, name, kit.kinds.CONSUMER, attrs)
        if not result.decision.is_sampled():
            return None
        if result.attributes:
            attrs.update(result.attributes)
        return cls(kit, name, kit.new_context(trace_id, result.trace_state), parent, start, attrs, job_id,
                   capture_content)

    def child(self, name: str, start: float, end: float, attributes: dict | None = None, events: Iterable = ()) -> None:
        """Emit a finished child span of the CONSUMER span (`start`, `end`: Unix s);
        `events`: (name, attributes, Unix s)."""
        kit = self.kit
        kit.emit(name, kit.new_context(self.ctx.trace_id, self.ctx.trace_state), self.ctx, start, end, attributes,
                 [kit.Event(n, a, ns(t)) for n, a, t in events])

    def event(self, name: str, attributes: dict | None = None, t: float | None = None) -> None:
        if not self.ended:
            self.events.append(self.kit.Event(name, attributes or {}, ns(t if t is not None else time.time())))

    def cancel_requested(self, headers: Iterable[tuple[str, bytes | None]] | None = None) -> None:
        """A cancel arrived: an event, and a link to the cancel's own span when its record
        carried a trace context."""
        self.event("cancel_requested")
        ctx = context_from_headers(headers) if headers else None
        if ctx is not None and not self.ended:
            kit = self.kit
            self.links.append(kit.Link(kit.trace.get_current_span(ctx).get_span_context(), {"inflight.link": "cancel"}))

    def engine_done(self, times: RequestTimes | None) -> None:
        """The engine's last output for the job: its timestamps (and traced events)."""
        self.engine = times

    def terminated(self, held: Any, term: Finished, now: float) -> None:
        """The terminal event `term` was drafted: outcome attributes and events."""
        self.terminal_at = now
        a = self.attrs
        reason = held.finish_reason.value if held.finish_reason is not None else "error"
        a["gen_ai.response.finish_reasons"] = (reason,)
        a["inflight.finish_reason"] = reason
        if held.first_token_time is not None:
            self.event("first_token", None, held.first_token_time)
        if held.cancel_time_mono is not None or reason == "cancelled":
            self.event("cancelled", None, now)
        err = held.error
        if err is not None:
            a["error.type"] = err.code
            if reason in ("error", "rejected"):
                self.status = self.kit.error(f"{err.code}: {err.message}"[:500])
            self.event(reason if reason == "rejected" else "error",
                       {"inflight.error_code": err.code, "inflight.error_message": err.message[:500]}, now)
        if held.dead_letter is not None:
            a["inflight.dead_letter"] = held.dead_letter[0]
        usage = term.usage
        if usage is not None:
            a["gen_ai.usage.input_tokens"] = usage.prompt_tokens
            a["gen_ai.usage.output_tokens"] = usage.completion_tokens
            if usage.cached_prompt_tokens is not None:
                a["inflight.prefix_cache_hit_tokens"] = usage.cached_prompt_tokens
        t = term.timings
        if t is not None:
            for key, value in (("inflight.queue_time_s", t.queue_s), ("inflight.ttft_s", t.ttft_s),
                               ("inflight.tpot_s", t.tpot_s), ("inflight.e2e_s", t.e2e_s)):
                if value is not None:
                    a[key] = value
        if held.summary.get("preemptions"):
            a["inflight.preemptions"] = held.summary["preemptions"]
        if self.capture_content:
            a["gen_ai.output.messages"] = term.text

    def end(self, now: float, outcome: str | None = None) -> None:
        """The job is done here (offset done) or given up (`outcome`: `handed_back`,
        `lost`): emit the phase spans and the CONSUMER span."""
        if self.ended:
            return
        ACTIVE.pop(self.job_id, None)
        if self.tokenize is not None:
            self.child("tokenize", *self.tokenize)
        times = self.engine
        if self.submitted is not None:
            first_sched = times.first_scheduled_time if times is not None else None
            queue_end = first_sched if first_sched is not None else (times.finished_time if times else now)
            self.child("engine.queue", self.submitted, queue_end)
            engine_events = (times.events or ()) if times is not None else ()
            if first_sched is not None:
                chunks = [("prefill_chunk", {"inflight.tokens": e.tokens}, e.time) for e in engine_events
                          if e.name == "prefill_chunk"]
                first_tok = times.first_token_time
                self.child("prefill", first_sched, first_tok if first_tok is not None else times.finished_time,
                           {"inflight.chunks": len(chunks)}, chunks)
                if first_tok is not None:
                    self.child("decode", first_tok, times.finished_time)
            for e in engine_events:
                if e.name == "preempted":
                    self.event("preempted", {"inflight.reason": e.reason, "inflight.computed_tokens": e.tokens}, e.time)
                elif e.name != "prefill_chunk":
                    self.event(e.name, {"inflight.reason": e.reason} if e.reason else None, e.time)
        if self.terminal_at is not None and self.published_at is not None:
            self.child("publish", self.terminal_at, self.published_at)
        if self.recorded is not None:
            self.child("results.write", *self.recorded)
        if outcome is not None:
            self.attrs["inflight.outcome"] = outcome
        self.event(outcome or "offset_done", None, now)
        self.ended = True
        self.events.sort(key=lambda e: e.timestamp)
        kit = self.kit
        kit.emit(self.name, self.ctx, self.parent, self.start, now, self.attrs, self.events, kit.kinds.CONSUMER,
                 self.status, self.links)
