"""Inflight behind its OpenAI-compatible gateway vs `vllm serve`, both driven by
`vllm bench serve`, the load generator this field uses, on the same checkpoint and
limits, in one run.

Systems (each started, measured at every rate, stopped, before the next starts, so they
never share the cores; with `--rounds K` all are started together and measured in turn,
K rounds, the order reversed every other round: this box's speed drifts by up to 40%
between minutes, so only runs in the same minutes compare. An idle server's CPU while
another is measured is recorded, `idle_cores`, to show it stayed out of the way):
  inflight       `python -m worker gateway` + one `python -m worker worker` on the dev
                 stack's Kafka and Redis (fresh topics), the checkpoint on the CPU (or CUDA).
  inflight_vllm  the same gateway and worker with `model.engine: vllm` (vLLM's engine core
                 behind our queue layer, docs/engines.md), vLLM's defaults otherwise.
  vllm           `vllm serve` from vLLM's own venv (tools/setup_vllm.sh).
The three rows split the gap: `inflight_vllm / vllm` is what the queue layer (gateway,
Kafka, worker, Redis) costs on the same engine; `inflight / inflight_vllm` is the engines'
difference behind the same layer.
Load: `vllm bench serve --backend openai --endpoint /v1/completions --dataset-name random`
with fixed input and output lengths and `--ignore-eos`, greedy, at each `--rates` value
(requests/s, Poisson; `inf`: all at once, the saturation row). Both get the same
`--max-batch` running requests, `--budget` tokens per step, prefix caching off.

Writes results/bench_serve.json (every metric `vllm bench serve` saved, per system and
rate) and results/bench_serve.png, and prints the table: output tokens/s, TTFT / TPOT /
ITL p50 and p99 (ms), and Inflight's ratio to vLLM per rate.

    tools/setup_vllm.sh && tools/stack/devstack.sh up
    python -m tools.bench.serve                          # ~10 minutes here
    python -m tools.bench.serve --rates 4 --num-prompts 40 --systems inflight
    python -m tools.bench.serve --systems inflight_vllm vllm --rates 8 inf --rounds 5

With rounds, the table shows each system's median over the rounds and each ratio's
median; every round's ratio is printed and saved (`ratios_by_round`): an aim is held
when it holds round after round, not in one median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from tools.bench.connections import add_connection_args, connection_sections
from tools.bench.engine import VLLM_PYTHON, vllm_missing
from tools.bench.gateway import KEY, start_gateway, write_configs
from tools.bench.harness import DEFAULT_MODEL, default_device, ensure_model, free_port, machine, percentile

SERVED_NAME = "bench"
METRICS = ("ttft", "tpot", "itl")


class Server:
    """Processes answering OpenAI requests at http://127.0.0.1:`port`; logs to `log`."""

    def __init__(self, name: str, procs: list[subprocess.Popen], port: int, log) -> None:
        self.name, self.procs, self.port, self.log = name, procs, port, log

    def cpu_s(self) -> float:
        """CPU seconds used so far by its processes and their children (user + system);
        processes gone meanwhile count as 0."""
        import psutil

        total = 0.0
        for p in self.procs:
            try:
                proc = psutil.Process(p.pid)
                for q in [proc, *proc.children(recursive=True)]:
                    t = q.cpu_times()
                    total += t.user + t.system
            except psutil.Error:
                continue
        return total

    def wait_ready(self, timeout: float) -> None:
        """Until `GET /v1/models` answers 200 and one completion succeeds. Raises
        RuntimeError if a process exits, TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{self.name}: {p.args[:4]} exited with {p.returncode}; see {self.log.name}")
            try:
                self._completion()
                return
            except OSError:
                time.sleep(1.0)
        raise TimeoutError(f"{self.name} was not ready after {timeout:.0f} s; see {self.log.name}")

    def _completion(self) -> None:
        body = json.dumps({"model": SERVED_NAME, "prompt": [1, 2, 3], "max_tokens": 2}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.log.close()


def start_inflight(a, model: Path, device: str, tmp: Path, engine: str = "inflight",
                   tracing: dict | None = None) -> Server:
    """Gateway + one worker on `engine` (`model.engine`); `tracing`: both processes'
    `tracing` section (None: off)."""
    from worker.cli.topics import create_topics

    prefix = f"serve{uuid.uuid4().hex[:8]}"
    asyncio.run(create_topics(a.kafka, prefix, partitions=3, kafka=a.kafka_cfg))
    tuning = {"max_running_requests": a.max_batch, "max_batched_tokens": a.budget,
              "max_total_tokens": a.max_batch * a.max_model_len, "max_input_tokens": a.max_model_len,
              "max_output_tokens": a.max_model_len, "enable_prefix_caching": False}
    model_cfg = {"path": str(model), "device": device}
    if engine == "vllm":  # the dtype `vllm serve` gets below; vLLM's other defaults (compiled) as there
        model_cfg.update(engine="vllm", vllm_python=str(Path(a.vllm_python).absolute()),
                         dtype="float32" if device == "cpu" else "bfloat16")
    traced = {} if tracing is None else {"tracing": tracing}
    port, env = write_configs(a, prefix, tmp, {"model": model_cfg, "serving_tuning": tuning, **traced},
                              {"model_name": SERVED_NAME, "tokenizer": str(model)}, traced)
    name = "inflight" if engine == "inflight" else f"inflight_{engine}"
    log = open(Path(a.out) / f"bench_serve_{name}.log", "w")  # noqa: SIM115 (closed in Server.stop)
    worker = subprocess.Popen([sys.executable, "-m", "worker", "worker", "--config", str(tmp / "worker.yaml")],
                              stdout=log, stderr=subprocess.STDOUT, env=env)
    return Server(name, [worker, start_gateway(tmp, log, env)], port, log)


def start_vllm(a, model: Path, device: str) -> Server:
    port = free_port()
    log = open(Path(a.out) / "bench_serve_vllm.log", "w")  # noqa: SIM115 (closed in Server.stop)
    vllm = Path(a.vllm_python).with_name("vllm")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    argv = [str(vllm), "serve", str(model), "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
            "--port", str(port), "--api-key", KEY, "--dtype", "float32" if device == "cpu" else "bfloat16",
            "--max-num-seqs", str(a.max_batch), "--max-num-batched-tokens", str(a.budget),
            "--max-model-len", str(a.max_model_len), "--no-enable-prefix-caching", "--seed", "0"]
    return Server("vllm", [subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)], port, log)


def bench_one(a, server: Server, model: Path, rate: float, tmp: Path, tag: str = "") -> dict:
    """One `vllm bench serve` run at `rate` against `server`; its saved result JSON
    (`tag` tells rounds apart). Raises RuntimeError (with its output's tail) if it fails
    or a request failed."""
    name = f"{server.name}-{rate}{tag.replace(' ', '-')}.json"
    vllm = Path(a.vllm_python).with_name("vllm")
    argv = [str(vllm), "bench", "serve", "--backend", "openai", "--base-url", f"http://127.0.0.1:{server.port}",
            "--endpoint", "/v1/completions", "--model", SERVED_NAME, "--tokenizer", str(model),
            "--dataset-name", "random", "--random-input-len", str(a.input_len),
            "--random-output-len", str(a.output_len), "--num-prompts", str(a.num_prompts),
            "--request-rate", str(rate), "--ignore-eos", "--temperature", "0", "--seed", str(a.seed),
            "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,99",
            "--save-result", "--save-detailed", "--result-dir", str(tmp), "--result-filename", name, "--disable-tqdm"]
    env = {**os.environ, "OPENAI_API_KEY": KEY}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    server.log.write(f"\n==== vllm bench serve at {rate} req/s ====\n{proc.stdout}{proc.stderr}\n")
    server.log.flush()
    if proc.returncode != 0 or not (tmp / name).is_file():
        raise RuntimeError(f"vllm bench serve against {server.name} failed (exit {proc.returncode}):\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}")
    res = json.loads((tmp / name).read_text())
    if res.get("completed") != a.num_prompts:
        raise RuntimeError(f"{server.name} at {rate} req/s: {res.get('completed')}/{a.num_prompts} requests "
                           f"completed; errors: {[e for e in res.get('errors', []) if e][:3]}")
    # per-request lists left out but the first tokens' times (in request order: where a tail comes from)
    return {k: v for k, v in res.items() if not isinstance(v, list) or k == "ttfts"}


def _start(a, name: str, model: Path, device: str, tmp: Path) -> Server:
    """System `name` started (its config files in `tmp/name`), not yet ready."""
    if name == "vllm":
        return start_vllm(a, model, device)
    (tmp / name).mkdir(exist_ok=True)
    return start_inflight(a, model, device, tmp / name, "vllm" if name == "inflight_vllm" else "inflight")


def _measure(a, server: Server, model: Path, rate: str, tmp: Path, tag: str, idle: list[Server]) -> dict:
    """One rate against `server`: its result, row, and the cores the `idle` servers used
    meanwhile (CPU seconds over wall seconds, summed)."""
    before = [s.cpu_s() for s in idle]
    t0 = time.monotonic()
    res = bench_one(a, server, model, float(rate), tmp, tag)
    wall = time.monotonic() - t0
    idle_cores = sum(s.cpu_s() - b for s, b in zip(idle, before)) / wall
    print(f"{server.name} at {rate} req/s{tag}: {res['output_throughput']:.0f} output tok/s, "
          f"TTFT p50 {res['p50_ttft_ms']:.1f} ms")
    return {"res": res, "row": row(res), "idle_cores": idle_cores}


def measure_one_by_one(a, model: Path, device: str, tmp: Path) -> list[dict]:
    """Each system started, measured at every rate and stopped before the next: one round."""
    out: dict[str, dict] = {}
    for name in a.systems:
        server = _start(a, name, model, device, tmp)
        try:
            server.wait_ready(900)
            out[name] = {rate: _measure(a, server, model, rate, tmp, "", []) for rate in a.rates}
        finally:
            server.stop()
    return [out]


def measure_in_turn(a, model: Path, device: str, tmp: Path) -> list[dict]:
    """All systems started together, then `a.rounds` rounds, each measuring every system
    at every rate in turn (the order reversed every other round, so neither side always
    runs first)."""
    servers: list[Server] = []
    try:
        for name in a.systems:
            servers.append(_start(a, name, model, device, tmp))
            servers[-1].wait_ready(900)  # one start at a time: starts are CPU-bound
        rounds = []
        for k in range(a.rounds):
            order = servers if k % 2 == 0 else servers[::-1]
            out: dict[str, dict] = {}
            for server in order:
                idle = [s for s in servers if s is not server]
                out[server.name] = {rate: _measure(a, server, model, rate, tmp, f" round {k + 1}", idle)
                                    for rate in a.rates}
            rounds.append(out)
        return rounds
    finally:
        for server in servers:
            server.stop()


def _median_row(rows: list[dict]) -> dict:
    return {k: percentile([r[k] for r in rows], 50) for k in rows[0]}


def _ratios(a, results: dict[str, dict[str, dict]]) -> dict:
    """Output tokens/s and TTFT p50 of each pair of systems, per rate."""
    return {f"{x}_vs_{y}": {rate: {"output_tokens_per_s": results[x][rate]["output_tokens_per_s"]
                                   / results[y][rate]["output_tokens_per_s"],
                                   "ttft_p50": results[x][rate]["ttft_p50_ms"] / results[y][rate]["ttft_p50_ms"],
                                   "ttft_p50_minus_ms": results[x][rate]["ttft_p50_ms"]
                                   - results[y][rate]["ttft_p50_ms"]}
                            for rate in a.rates}
            for x, y in (("inflight", "vllm"), ("inflight_vllm", "vllm"), ("inflight", "inflight_vllm"))
            if x in results and y in results}


def row(res: dict) -> dict:
    """The table's fields of one result (milliseconds, tokens/s)."""
    out = {"output_tokens_per_s": res["output_throughput"], "requests_per_s": res["request_throughput"]}
    for m in METRICS:
        for q in ("p50", "p99"):
            out[f"{m}_{q}_ms"] = res[f"{q}_{m}_ms"]
    return out


def plot(report: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, by_rate in report["results"].items():
        rates = list(by_rate)
        axes[0].plot(rates, [by_rate[r]["output_tokens_per_s"] for r in rates], marker="o", label=name)
        axes[1].plot(rates, [by_rate[r]["ttft_p50_ms"] for r in rates], marker="o", label=f"{name} p50")
        axes[1].plot(rates, [by_rate[r]["ttft_p99_ms"] for r in rates], marker="x", ls="--", label=f"{name} p99")
    axes[0].set(xlabel="request rate (req/s; inf = all at once)", ylabel="output tokens / s")
    axes[1].set(xlabel="request rate (req/s; inf = all at once)", ylabel="TTFT (ms)", yscale="log")
    for ax in axes:
        ax.legend()
    fig.suptitle(f"vllm bench serve, random {report['input_len']} in / {report['output_len']} out, --ignore-eos")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def add_load_args(p: argparse.ArgumentParser) -> None:
    """What `start_inflight`, `start_vllm` and `bench_one` read: the checkpoint, the
    device, the limits both systems get, the `vllm bench serve` workload, vLLM's venv,
    the output folder, and the Kafka / Redis connection."""
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="HF checkpoint dir (the default is made if missing)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--num-prompts", type=int, default=200, help="requests per rate")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=32, help="running requests (both systems)")
    p.add_argument("--budget", type=int, default=2048, help="batched tokens per step (both systems)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-python", default=str(VLLM_PYTHON), help="interpreter of vLLM's venv (tools/setup_vllm.sh)")
    p.add_argument("--out", default="results")
    add_connection_args(p)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_load_args(p)
    p.add_argument("--systems", nargs="+", default=["inflight", "inflight_vllm", "vllm"],
                   choices=["inflight", "inflight_vllm", "vllm"])
    p.add_argument("--rates", nargs="+", default=["2", "8", "inf"], help="requests/s; inf: all at t=0")
    p.add_argument("--rounds", type=int, default=1,
                   help="1: each system alone, one after the other; K > 1: all started, measured in turn K times")
    p.add_argument("--worker-log-level", default="WARNING", choices=["WARNING", "INFO"],
                   help="INFO: the worker logs a line per job (its queue time and TTFT as the worker saw them)")
    a = p.parse_args(argv)
    a.kafka_cfg, a.redis_cfg = connection_sections(a)
    device = a.device if a.device != "auto" else default_device()
    model = ensure_model(Path(a.model)).resolve()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    if why := vllm_missing(Path(a.vllm_python)):
        print(f"bench_serve: needs vLLM's `vllm bench serve` as the load generator: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp_:
        runs = (measure_in_turn if a.rounds > 1 else measure_one_by_one)(a, model, device, Path(tmp_))
    results = {name: {rate: _median_row([r[name][rate]["row"] for r in runs]) for rate in a.rates}
               for name in a.systems}
    by_round = [_ratios(a, {name: {rate: r[name][rate]["row"] for rate in a.rates} for name in a.systems})
                for r in runs]
    ratios = {pair: {rate: {k: percentile([b[pair][rate][k] for b in by_round], 50) for k in by_rate[rate]}
                     for rate in a.rates}
              for pair, by_rate in by_round[0].items()}
    raw = [{name: {rate: r[name][rate]["res"] for rate in a.rates} for name in a.systems} for r in runs]
    idle = [{name: {rate: r[name][rate]["idle_cores"] for rate in a.rates} for name in a.systems} for r in runs]
    report = {"mode": "serve", "command": "python -m tools.bench.serve " + " ".join(argv or sys.argv[1:]),
              "machine": machine(), "model": str(model), "device": device, "input_len": a.input_len,
              "output_len": a.output_len, "num_prompts": a.num_prompts, "max_batch": a.max_batch, "budget": a.budget,
              "rounds": a.rounds, "results": results, "ratios": ratios, "ratios_by_round": by_round,
              "idle_cores_by_round": idle, "vllm_bench_serve": raw}
    out = Path(a.out) / "bench_serve.json"
    out.write_text(json.dumps(report, indent=2))
    plot(report, Path(a.out) / "bench_serve.png")
    head = f"{'system':<14}{'rate':>6}{'out tok/s':>11}" + "".join(f"{m + ' ' + q:>11}" for m in METRICS
                                                                  for q in ("p50", "p99"))
    print("\n" + head + "   (latencies in ms)")
    for name, by_rate in results.items():
        for rate, r in by_rate.items():
            print(f"{name:<14}{rate:>6}{r['output_tokens_per_s']:>11.0f}"
                  + "".join(f"{r[f'{m}_{q}_ms']:>11.1f}" for m in METRICS for q in ("p50", "p99")))
    for pair, by_rate in ratios.items():
        for rate, r in by_rate.items():
            each = "" if a.rounds == 1 else "; rounds: " + ", ".join(
                f"{b[pair][rate]['output_tokens_per_s']:.2f}x / {b[pair][rate]['ttft_p50_minus_ms']:+.1f} ms"
                for b in by_round)
            print(f"{pair.replace('_vs_', ' / ')} at {rate} req/s: output tok/s {r['output_tokens_per_s']:.2f}x, "
                  f"TTFT p50 {r['ttft_p50']:.2f}x ({r['ttft_p50_minus_ms']:+.1f} ms){each}")
    if a.rounds > 1:
        worst = max((c for r in idle for by_rate in r.values() for c in by_rate.values()), default=0.0)
        print(f"idle servers while another was measured: at most {worst:.2f} cores")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
