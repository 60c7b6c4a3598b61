"""Where a first token's time goes through the queue layer, hop by hop (issue 44's
"report where the rest of the time goes between gateway, Kafka, worker, engine and Redis").

Starts Inflight's gateway and one worker as `tools.bench.serve` does (dev stack's Kafka
and Redis, the CPU bench model), with tracing on at 100% sampling (spans over OTLP/JSON
to `tools.bench.tracing`'s collector stand-in, recording them to a file), and a Redis
subscriber in its own process that notes when each job's events reach a client of Redis.
Then `vllm bench serve` at `--rate` (the load `tools.bench.serve` measures TTFT at).

Per request, from the gateway's HTTP span start (milliseconds; medians over requests,
p90 beside): the produce sent and acknowledged, the worker's read of the record, its
claim, input processing (tokenize), the engine's queue, the first token in the engine
(end of `prefill`), at the worker's front (`first_token` event), at the Redis
subscriber (the first event after it), and at the client (`vllm bench serve`'s TTFT,
matched to the traces in request order; it also holds the client's own HTTP time to the
gateway). Tracing costs some CPU: the TTFT here is a little above an untraced run's.
With `--vllm` (the default when vLLM's venv exists), `vllm serve` on the same checkpoint
and limits is measured at the same rate in the same run, after Inflight: its TTFT p50 is
the line the hops are to be read against.

    tools/setup_vllm.sh && tools/stack/devstack.sh up
    python -m tools.bench.first_token                  # 8 req/s, 200 requests, then vllm serve (~4 min)
    python -m tools.bench.first_token --rate 1 --num-prompts 40 --no-vllm

Writes results/bench_first_token.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from tools.bench import serve
from tools.bench.connections import connection_sections
from tools.bench.engine import vllm_missing
from tools.bench.harness import default_device, ensure_model, machine, percentile
from tools.bench.tracing import discard_sink

LISTENER = """
import sys, time, redis
p = redis.Redis.from_url(sys.argv[1]).pubsub()
p.psubscribe(sys.argv[3] + ":*")
out = open(sys.argv[2], "w")
for m in p.listen():
    if m["type"] == "pmessage":
        out.write(f"{time.time():.6f} {m['channel'].decode()}\\n")
        out.flush()
"""

# (label, where the time is read): a span's start or end, or an event of the trace
MARKS = (
    ("produce sent (gateway)", ("send", "start")),
    ("produce acknowledged", ("send", "end")),
    ("record read by the worker", ("read_ahead", "start")),
    ("claim sent", ("claim", "start")),
    ("claim answered", ("claim", "end")),
    ("tokenize start", ("tokenize", "start")),
    ("input processed, submitted to the engine", ("engine.queue", "start")),
    ("first scheduled (prefill starts)", ("engine.queue", "end")),
    ("first token in the engine", ("prefill", "end")),
    ("first token at the worker's front", ("event", "first_token")),
)


def spans_by_trace(path: Path) -> dict[str, list[dict]]:
    """OTLP/JSON export bodies (one per line) → spans per trace id."""
    out: dict[str, list[dict]] = defaultdict(list)
    for line in path.read_text().splitlines():
        for rs in json.loads(line).get("resourceSpans", []):
            for ss in rs.get("scopeSpans", []):
                for sp in ss.get("spans", []):
                    out[sp["traceId"]].append(sp)
    return out


def request_marks(spans: list[dict]) -> dict | None:
    """One request's times (Unix s) by `MARKS` label, its job id and its HTTP start;
    None for a trace without the gateway's HTTP span or the worker's first token."""
    http = [s for s in spans if s["name"].startswith("POST ")]
    consumer = [s for s in spans if s["name"].startswith("process ")]
    if not http or not consumer:
        return None
    by_name = {s["name"]: s for s in spans}
    events = {e["name"]: int(e["timeUnixNano"]) for s in spans for e in s.get("events", [])}
    times = {}
    for label, (name, which) in MARKS:
        if name == "event":
            ns = events.get(which)
        else:
            sp = next((s for n, s in by_name.items() if n == name or n.startswith(name + " ")), None)
            ns = None if sp is None else int(sp["startTimeUnixNano" if which == "start" else "endTimeUnixNano"])
        if ns is not None:
            times[label] = ns / 1e9
    if "first token at the worker's front" not in times:
        return None
    attrs = {a["key"]: a["value"].get("stringValue") for a in consumer[0].get("attributes", [])}
    return {"job_id": attrs.get("inflight.job_id"), "start": int(http[0]["startTimeUnixNano"]) / 1e9, "times": times}


def published(path: Path) -> dict[str, list[float]]:
    """Times (Unix s) each job's channel got a message, by job id."""
    out: dict[str, list[float]] = defaultdict(list)
    for line in path.read_text().splitlines():
        t, channel = line.split()
        out[channel.rsplit(":job:", 1)[-1]].append(float(t))
    return out


def breakdown(traces: dict[str, list[dict]], pubs: dict[str, list[float]], ttfts_s: list[float]) -> dict:
    """Medians and p90s (ms from the HTTP span's start) per mark, over the requests."""
    reqs = sorted((m for m in map(request_marks, traces.values()) if m is not None), key=lambda m: m["start"])
    reqs = reqs[len(reqs) - len(ttfts_s):] if len(reqs) > len(ttfts_s) else reqs  # the readiness request first
    rows: dict[str, list[float]] = defaultdict(list)
    for m, ttft in zip(reqs, ttfts_s[-len(reqs):] if reqs else []):
        for label, t in m["times"].items():
            rows[label].append((t - m["start"]) * 1e3)
        front = m["times"]["first token at the worker's front"]
        after = [t for t in sorted(pubs.get(m["job_id"], [])) if t >= front - 0.002]
        if after:
            rows["first token at a Redis subscriber"].append((after[0] - m["start"]) * 1e3)
        rows["first token at the client (TTFT)"].append(ttft * 1e3)
    order = [label for label, _ in MARKS] + ["first token at a Redis subscriber", "first token at the client (TTFT)"]
    return {label: {"p50_ms": percentile(rows[label], 50), "p90_ms": percentile(rows[label], 90), "n": len(rows[label])}
            for label in order if rows.get(label)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_load_args(p)
    p.add_argument("--rate", default="8", help="requests/s (Poisson)")
    p.add_argument("--no-vllm", dest="vllm", action="store_false", help="leave out the `vllm serve` baseline")
    a = p.parse_args(argv)
    a.kafka_cfg, a.redis_cfg = connection_sections(a)
    if why := vllm_missing(Path(a.vllm_python)):
        print(f"first_token: needs vLLM's `vllm bench serve` as the load generator: {why}", file=sys.stderr)
        return 2
    device = a.device if a.device != "auto" else default_device()
    model = ensure_model(Path(a.model)).resolve()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        spans, pubs = tmp / "spans.jsonl", tmp / "published.txt"
        spans.touch()
        pubs.touch()
        with discard_sink(record=spans) as endpoint:
            server = serve.start_inflight(a, model, device, tmp, tracing={
                "enabled": True, "endpoint": endpoint, "protocol": "http/json", "sample_ratio": 1.0})
            try:
                listener = subprocess.Popen([sys.executable, "-c", LISTENER, a.redis_cfg.url, str(pubs),
                                             server_prefix(tmp)])
                try:
                    server.wait_ready(600)
                    res = serve.bench_one(a, server, model, float(a.rate), tmp)
                finally:
                    listener.terminate()
            finally:
                server.stop()  # the worker and gateway export their last spans as they stop
                time.sleep(1.0)
        table = breakdown(spans_by_trace(spans), published(pubs), res["ttfts"])
        base = vllm_ttft(a, model, device, tmp) if a.vllm else None
    report = {"command": "python -m tools.bench.first_token " + " ".join(argv or sys.argv[1:]), "machine": machine(),
              "model": str(model), "device": device, "rate": a.rate, "num_prompts": a.num_prompts,
              "input_len": a.input_len, "output_len": a.output_len, "ttft_p50_ms_vllm_bench": res["p50_ttft_ms"],
              "vllm_serve": base, "marks": table}
    out = Path(a.out) / "bench_first_token.json"
    out.write_text(json.dumps(report, indent=2))
    print(f"\n{'from the gateway taking the request to':<46}{'p50 ms':>9}{'p90 ms':>9}{'step p50':>10}")
    last = 0.0
    for label, r in sorted(table.items(), key=lambda kv: kv[1]["p50_ms"]):  # in time order (the ack comes late)
        print(f"{label:<46}{r['p50_ms']:>9.2f}{r['p90_ms']:>9.2f}{r['p50_ms'] - last:>+10.2f}")
        last = r["p50_ms"]
    if base is not None:
        print(f"vllm serve, same rate and run: TTFT p50 {base['ttft_p50_ms']:.2f} ms, p90 {base['ttft_p90_ms']:.2f} "
              f"(Inflight's {res['p50_ttft_ms']:.2f} ms here: {res['p50_ttft_ms'] / base['ttft_p50_ms']:.2f}x, "
              "tracing on)")
    print(f"wrote {out}")
    return 0


def vllm_ttft(a, model: Path, device: str, tmp: Path) -> dict:
    """`vllm serve` (`tools.bench.serve.start_vllm`) under the same `vllm bench serve` load:
    its TTFT p50 and p90 (ms), the baseline of the hops."""
    server = serve.start_vllm(a, model, device)
    try:
        server.wait_ready(900)
        res = serve.bench_one(a, server, model, float(a.rate), tmp, " vllm")
    finally:
        server.stop()
    return {"ttft_p50_ms": res["p50_ttft_ms"], "ttft_p90_ms": percentile([t * 1e3 for t in res["ttfts"]], 90)}


def server_prefix(tmp: Path) -> str:
    """The Redis key prefix `serve.start_inflight` gave this run (its worker.yaml)."""
    import yaml

    return yaml.safe_load((tmp / "worker.yaml").read_text())["redis"]["key_prefix"]


if __name__ == "__main__":
    raise SystemExit(main())
