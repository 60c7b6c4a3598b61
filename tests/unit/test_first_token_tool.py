"""`tools.bench.first_token` reads a request's hops from its trace (OTLP/JSON as a
collector receives it) and a Redis subscriber's notes, and matches the client's TTFTs to
the traces in request order; the readiness request's trace, first, is left out."""

from __future__ import annotations

import json

from tools.bench.first_token import breakdown, published, spans_by_trace

T0 = 1_800_000_000.0  # a request's HTTP span start, Unix s


def span(name: str, start_ms: float, end_ms: float, events=(), attrs=None) -> dict:
    return {"name": name, "startTimeUnixNano": str(int((T0 + start_ms / 1e3) * 1e9)),
            "endTimeUnixNano": str(int((T0 + end_ms / 1e3) * 1e9)),
            "events": [{"name": n, "timeUnixNano": str(int((T0 + t / 1e3) * 1e9))} for n, t in events],
            "attributes": [{"key": k, "value": {"stringValue": v}} for k, v in (attrs or {}).items()]}


def trace(job_id: str, shift_ms: float) -> list[dict]:
    """One request's spans, all of it `shift_ms` after T0."""
    s = shift_ms
    spans = [span("POST /v1/completions", s, s + 200),
            span("send inflight.jobs.normal", s + 0.5, s + 4.0),
            span("process inflight.jobs.normal", s + 3.0, s + 210, [("first_token", s + 21.0)],
                 {"inflight.job_id": job_id}),
            span("read_ahead", s + 3.0, s + 3.2), span("claim", s + 3.2, s + 5.0),
            span("tokenize", s + 3.4, s + 5.2), span("engine.queue", s + 5.2, s + 7.0),
            span("prefill", s + 7.0, s + 20.5), span("decode", s + 20.5, s + 200)]
    for sp in spans:
        sp["traceId"] = job_id
    return spans


def test_hops_are_read_from_the_traces_and_matched_to_the_client_in_request_order(tmp_path):
    spans, pubs = tmp_path / "spans.jsonl", tmp_path / "published.txt"
    body = {"resourceSpans": [{"scopeSpans": [{"spans": trace("ready", -5000) + trace("a", 0) + trace("b", 1000)}]}]}
    spans.write_text(json.dumps(body) + "\n")
    pubs.write_text(f"{T0 + 0.010:.6f} p:t:x:job:a\n{T0 + 0.0219:.6f} p:t:x:job:a\n{T0 + 1.0218:.6f} p:t:x:job:b\n")
    table = breakdown(spans_by_trace(spans), published(pubs), [0.0255, 0.0245])
    ms = {label: round(r["p50_ms"], 2) for label, r in table.items()}
    assert ms["produce sent (gateway)"] == 0.5 and ms["produce acknowledged"] == 4.0
    assert ms["record read by the worker"] == 3.0 and ms["claim answered"] == 5.0
    assert ms["first scheduled (prefill starts)"] == 7.0 and ms["first token in the engine"] == 20.5
    assert ms["first token at the worker's front"] == 21.0
    assert ms["first token at a Redis subscriber"] == 21.85  # the first message after the front's: 21.9, 21.8
    assert ms["first token at the client (TTFT)"] == 25.0 and table["first token at the client (TTFT)"]["n"] == 2
