"""The trace of one attempt of one job at a worker (`JobTrace`): its CONSUMER span and
the timestamps of its phases, turned into finished spans when the job ends (the span
tree is drawn in `worker.obs.tracing`).

A worker traces hundreds of jobs a second, so no live SDK `Span` is kept per job: the
sampling decision and the ids are taken when the job is claimed (the SDK's sampler and
id generator), attributes and events gather in plain dicts and lists, and each span is
handed on as a finished record (`worker.obs.span_records`; the phase spans as one
`Children` record) with its own start and end times (`SpanKit`): no SDK object is built
on the event loop, and the encoding and the export run in the trace export process
(`worker.obs.trace_export`). Only `OtelTracing.open_job` makes a JobTrace, so nothing
here runs, or imports OpenTelemetry, while tracing is off."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from worker.obs.span_records import (
    CONSUMER,
    ERROR,
    INTERNAL,
    UNSET,
    Children,
    SpanRecord,
    link_of,
    trace_bytes,
)
from worker.obs.trace_context import ACTIVE, context_from_headers, ns

if TYPE_CHECKING:
    from schemas.wire import Finished
    from worker.engine.outputs import RequestTimes


class SpanKit:
    """What building finished spans needs: the provider's sampler and id generator, and
    the sink that takes the finished spans as records (the export process's pipe,
    `worker.obs.trace_export.ExportProcess`, or an in-process `RecordBatcher`)."""

    def __init__(self, provider: Any, sink: Any) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        self.trace, self.kinds = trace, SpanKind
        self.sampler = provider.sampler
        self.ids = provider.id_generator
        self.sink = sink

    def emit(self, name: str, trace_id: bytes, span_id: int, parent_id: int, parent_remote: bool, trace_state: str,
             start: float, end: float, attributes: dict | None = None, events: list | None = None,
             kind: int = INTERNAL, status: tuple[int, str | None] | None = None, links: list | None = None) -> None:
        """Hand one finished span (`start`, `end`: Unix s; `events`: (name, Unix ns,
        attributes)) to the sink."""
        code, description = status or (UNSET, None)
        self.sink.put(SpanRecord(name, trace_id, span_id, parent_id, parent_remote, trace_state, kind, ns(start),
                                 ns(max(end, start)), attributes or {}, events or [], links or [], code, description))

    def emit_children(self, trace_id: bytes, parent_id: int, trace_state: str, spans: list) -> None:
        """Hand finished INTERNAL children of one parent to the sink as one record
        (`spans`: (name, start, end, attributes, events), Unix s; see `Children`)."""
        if spans:
            self.sink.put(Children(trace_id, parent_id, trace_state, spans))


class JobTrace:
    """The trace of one attempt of one job at this worker: its CONSUMER span (from when
    the record was read to when its offset is done) and the timestamps of its phases
    (Unix s), emitted as finished spans by `end`. Written on the event loop only.
    `trace_id` / `span_id`: hex ids of the CONSUMER span (log lines, exemplars)."""

    __slots__ = ("kit", "capture_content", "job_id", "name", "tid", "sid", "state", "parent", "start", "attrs",
                 "events", "links", "status", "trace_id", "span_id", "exemplar", "tokenize", "submitted", "engine",
                 "terminal_at", "published_at", "recorded", "ended")

    def __init__(self, kit: SpanKit, name: str, trace_id: int, span_id: int, trace_state: str, parent: Any,
                 start: float, attrs: dict, job_id: str, capture_content: bool = False) -> None:
        self.kit = kit
        self.capture_content = capture_content
        self.job_id = job_id
        self.name = name
        self.tid = trace_bytes(trace_id)
        self.sid = span_id
        self.state = trace_state  # W3C header value; every span of the job carries it (W3C: the parent's)
        self.parent = parent  # the producer's SpanContext, or None (a new trace)
        self.start = start
        self.attrs = attrs
        self.events: list[tuple[str, int, dict]] = []
        self.links: list = []
        self.status: tuple[int, str] | None = None
        self.trace_id = format(trace_id, "032x")
        self.span_id = format(span_id, "016x")
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
        state = result.trace_state
        return cls(kit, name, trace_id, kit.ids.generate_span_id(), state.to_header() if state else "", parent,
                   start, attrs, job_id, capture_content)

    def children(self, spans: list) -> None:
        """Emit finished child spans of the CONSUMER span, as one record: (name, start,
        end, attributes, events) each, times in Unix s, events as (name, Unix s, attributes)."""
        self.kit.emit_children(self.tid, self.sid, self.state, spans)

    def event(self, name: str, attributes: dict | None = None, t: float | None = None) -> None:
        if not self.ended:
            self.events.append((name, ns(t if t is not None else time.time()), attributes or {}))

    def cancel_requested(self, headers: Iterable[tuple[str, bytes | None]] | None = None) -> None:
        """A cancel arrived: an event, and a link to the cancel's own span when its record
        carried a trace context."""
        self.event("cancel_requested")
        ctx = context_from_headers(headers) if headers else None
        if ctx is not None and not self.ended:
            self.links.append(link_of(self.kit.trace.get_current_span(ctx).get_span_context(),
                                      {"inflight.link": "cancel"}))

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
                self.status = (ERROR, f"{err.code}: {err.message}"[:500])
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
        phases: list = []
        if self.tokenize is not None:
            phases.append(("tokenize", *self.tokenize, _NONE, ()))
        times = self.engine
        if self.submitted is not None:
            first_sched = times.first_scheduled_time if times is not None else None
            queue_end = first_sched if first_sched is not None else (times.finished_time if times else now)
            phases.append(("engine.queue", self.submitted, queue_end, _NONE, ()))
            engine_events = (times.events or ()) if times is not None else ()
            if first_sched is not None:
                chunks = [("prefill_chunk", e.time, {"inflight.tokens": e.tokens}) for e in engine_events
                          if e.name == "prefill_chunk"]
                first_tok = times.first_token_time
                phases.append(("prefill", first_sched, first_tok if first_tok is not None else times.finished_time,
                               {"inflight.chunks": len(chunks)}, chunks))
                if first_tok is not None:
                    phases.append(("decode", first_tok, times.finished_time, _NONE, ()))
            for e in engine_events:
                if e.name == "preempted":
                    self.event("preempted", {"inflight.reason": e.reason, "inflight.computed_tokens": e.tokens}, e.time)
                elif e.name != "prefill_chunk":
                    self.event(e.name, {"inflight.reason": e.reason} if e.reason else None, e.time)
        if self.terminal_at is not None and self.published_at is not None:
            phases.append(("publish", self.terminal_at, self.published_at, _NONE, ()))
        if self.recorded is not None:
            phases.append(("results.write", *self.recorded, _NONE, ()))
        self.children(phases)
        if outcome is not None:
            self.attrs["inflight.outcome"] = outcome
        self.event(outcome or "offset_done", None, now)
        self.ended = True
        self.events.sort(key=_event_time)
        parent = self.parent
        self.kit.emit(self.name, self.tid, self.sid, parent.span_id if parent is not None else 0, parent is not None,
                      self.state, self.start, now, self.attrs, self.events, CONSUMER, self.status, self.links)


_NONE: dict = {}  # a phase without attributes (never written)


def _event_time(event: tuple[str, int, dict]) -> int:
    return event[1]
