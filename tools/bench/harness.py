"""What the benchmarks share: the benchmark checkpoints and per-device sizes, the header
every result file starts with (what ran, on which machine and model), percentiles, and a
worker started as its own process with its metrics scraped. The benchmarks of this
folder import from here; none imports another benchmark's internals."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from tools.bench.connections import worker_sections

DEFAULT_MODEL = Path(".cache/models/bench-llama")
GPU_MODEL = Path(".cache/models/bench-llama-1b")
WEIGHTS_MODEL = Path(".cache/models/bench-llama-160m")
TRAINED_MODEL = Path(".cache/models/bench-llama-trained")  # the CPU shape, trained briefly: text-like output
COPY_MODEL = Path(".cache/models/bench-llama-copy")  # written, not trained: copies spans of its prompt
# random-init Llama shapes: small for the CPU; ~160M parameters (fp32 weights of 640 MB,
# more than the benchmark box's caches) for what weight formats change; ~1.1B for a GPU
MODEL_SHAPES = {
    DEFAULT_MODEL: dict(arch="llama", vocab_size=2048, hidden=256, layers=4, heads=8, kv_heads=4, max_len=2048),
    WEIGHTS_MODEL: dict(arch="llama", vocab_size=8192, hidden=1024, layers=12, heads=16, kv_heads=4, max_len=2048),
    GPU_MODEL: dict(arch="llama", vocab_size=32000, hidden=2048, layers=20, heads=32, kv_heads=8, max_len=4096),
    TRAINED_MODEL: dict(arch="llama", vocab_size=2048, hidden=256, layers=4, heads=8, kv_heads=4, max_len=2048,
                        train_steps=600),
}


def report_header(mode: str, a, model: Path, device: str) -> dict:
    """The fields every result file starts with: what ran, where, on which model."""
    return {"mode": mode, "command": a.command_line, "machine": machine(), "model": str(model), "device": device,
            "dtype": str(torch_dtype(device)).removeprefix("torch.")}


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def ensure_model(path: Path) -> Path:
    """Make the benchmark checkpoint at `path` if missing (shapes in MODEL_SHAPES, the
    copy model by tools/make_copy_model.py; other paths must already exist)."""
    if Path(path) == COPY_MODEL and not (path / "config.json").is_file():
        from tools.make_copy_model import make_copy_model

        return make_copy_model(path)
    if not (path / "config.json").is_file():
        from tools.make_model import make_checkpoint

        shape = MODEL_SHAPES.get(Path(path), MODEL_SHAPES[DEFAULT_MODEL])
        make_checkpoint(path, corpus_chars=600_000, **shape)
    return path


# Sizes per device; a full run of each benchmark fits in ~5 minutes on the 2-core CPU box
# (scaled-down lengths) and on one H100/H200 (real ShareGPT lengths, ~1.1B model, bf16).
DEVICE_DEFAULTS = {
    "cpu": dict(scale=4.0, max_batch=32, budget=512, max_input=512, max_output=512),
    "cuda": dict(scale=1.0, max_batch=64, budget=2048, max_input=1024, max_output=512),
}


def apply_device_defaults(a, device: str) -> None:
    """Fill the size arguments left unset (None) with DEVICE_DEFAULTS[device]."""
    for k, v in DEVICE_DEFAULTS[device].items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


# ---- results ------------------------------------------------------------------------------
PCTS = (50, 95, 99)


def write_report(report: dict, out_dir: str | Path, name: str) -> Path:
    """Write `report` as `out_dir/name` (indented JSON, folders made) and say where."""
    out = Path(out_dir) / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return out


def step_bench_args(p, running: list[int], rounds: int) -> None:
    """The flags of a benchmark whose engines take turns on one decode step
    (`decode_step`, `interleaved_ms`): --model (the CPU benchmark model by default, made if
    missing), --running (`running` by default), --threads, --rounds (`rounds`),
    --iterations, --out."""
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="HF checkpoint dir (the CPU benchmark model is made "
                                                               "if missing)")
    p.add_argument("--running", type=int, nargs="+", default=running)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--rounds", type=int, default=rounds, help="turns each step takes")
    p.add_argument("--iterations", type=int, default=10, help="steps timed per turn")
    p.add_argument("--out", default="results")


def step_bench_start(a) -> tuple[Path, dict]:
    """Apply `step_bench_args`' --threads, make the model if missing, print the thread
    count; the checkpoint and the result file's header (machine, model, rounds, steps per
    round, torch threads)."""
    if a.threads:
        torch.set_num_threads(a.threads)
    path = ensure_model(Path(a.model))
    print(f"torch threads: {torch.get_num_threads()}")
    return path, {"machine": machine(), "model": str(path), "rounds": a.rounds, "iterations_per_round": a.iterations,
                  "torch_threads": torch.get_num_threads()}


def decode_step(path: Path, running: int, context: int | None = None,
                **model) -> tuple[Callable[[], object], list[int], str]:
    """An engine's decode step at `running` requests (contexts of 64-192 tokens, or of
    `context` tokens each), ready to run again and again (its `ModelRunner.execute` on the
    same step), the ids it samples, and how the forward runs. `model`: `ModelConfig`
    fields (compile, quantization, ...)."""
    from schemas.params import SamplingParams
    from worker.config import EngineConfig, ModelConfig, ServingTuning
    from worker.engine import Engine

    lo, hi = (64, 193) if context is None else (context, context + 1)
    cfg = EngineConfig(model=ModelConfig(device="cpu", **model), serving_tuning=ServingTuning(
        max_running_requests=running, max_total_tokens=running * (hi + 207), max_batched_tokens=4096,
        enable_prefix_caching=False, async_scheduling=False))
    engine = Engine.from_pretrained(str(path), cfg)
    runner = engine.runner
    steps = []
    real = runner.execute

    def spy(sched):
        steps.append(sched)
        return real(sched)

    runner.execute = spy
    rng = random.Random(0)
    for i in range(running):
        prompt = [rng.randrange(5, engine.facts.vocab_size) for _ in range(rng.randrange(lo, hi))]
        engine.add_request(f"r{i}", prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=64,
                                                                                  ignore_eos=True))
    while not steps or steps[-1].num_decodes < running:
        engine.step()
    sched = steps[-1]
    ids = [t for new in real(sched).sampled_token_ids.values() for t in new]
    return (lambda: real(sched)), ids, engine.compile_report.describe()


def interleaved_ms(steps: dict[str, Callable[[], object]], rounds: int, per_round: int) -> dict[str, list[float]]:
    """Median ms of each step per round, the steps taking turns round after round (this
    box moves a step's time by up to 2x between minutes: only steps timed side by side
    compare)."""
    out: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times = []
            for _ in range(per_round):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            out[name].append(statistics.median(times) * 1000)
    return out


def percentile(values: list[float], q: float) -> float:
    """The `q`-th percentile (0-100) of `values`, linear interpolation between the two
    nearest ranks (numpy's default method); NaN for no values. The one percentile of
    the benchmarks: every figure they report (`percentiles`, the tiering rounds, the
    gateway's paths) comes from here."""
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values, dtype=float), q))


def percentiles(values: list[float]) -> dict | None:
    """{p50, p95, p99, mean} (`percentile`), or None for no values."""
    if not values:
        return None
    out = {f"p{p}": percentile(values, p) for p in PCTS}
    out["mean"] = float(np.mean(values))
    return out


# ---- the worker process -------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerProcess:
    """`python -m worker worker` configured through INFLIGHT_* variables; logs to a file.
    `env` adds or overrides variables."""

    def __init__(self, a, model: Path, device: str, prefix: str, log_path: Path,
                 env_over: dict[str, str] | None = None) -> None:
        self.port = free_port()
        env = dict(os.environ)
        env.update({
            "INFLIGHT_MODEL__PATH": str(model),
            "INFLIGHT_MODEL__DEVICE": device,
            "INFLIGHT_MODEL__ATTENTION_BACKEND": a.backend,
            "INFLIGHT_KAFKA__BOOTSTRAP_SERVERS": a.kafka,
            "INFLIGHT_KAFKA__TOPIC_PREFIX": prefix,
            "INFLIGHT_KAFKA__GROUP_ID": f"{prefix}-workers",
            "INFLIGHT_KAFKA__COMMIT_INTERVAL_MS": "200",
            "INFLIGHT_REDIS__URL": a.redis,
            "INFLIGHT_REDIS__KEY_PREFIX": prefix,
            "INFLIGHT_SERVING_TUNING__MAX_RUNNING_REQUESTS": str(a.max_batch),
            "INFLIGHT_SERVING_TUNING__MAX_BATCHED_TOKENS": str(a.budget),
            "INFLIGHT_SERVING_TUNING__MAX_TOTAL_TOKENS": str(kv_tokens(a)),
            "INFLIGHT_SERVING_TUNING__ENABLE_PREFIX_CACHING": "false",
            "INFLIGHT_METRICS__PORT": str(self.port),
            "INFLIGHT_METRICS__HOST": "127.0.0.1",
            "INFLIGHT_METRICS__CHECK_INTERVAL_S": "1",
        })
        env.update(env_over or {})
        argv = [sys.executable, "-m", "worker", "worker"]
        if a.config:  # connection security of the file; the INFLIGHT_* variables above override the rest
            argv += ["--config", a.config]
            env.update(worker_sections(a.kafka_cfg, a.redis_cfg)[2])  # secret values given inline, if any
        self.log = open(log_path, "w")  # noqa: SIM115  (closed in stop)
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    async def metrics_by_tenant(self) -> dict[str, float]:
        """Output tokens served per `tenant` label (tenant_tokens_total, kind generation)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = await asyncio.to_thread(http_get, f"http://127.0.0.1:{self.port}/metrics")
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "tenant_tokens_total" and s.labels.get("kind") == "generation":
                    out[s.labels["tenant"]] = out.get(s.labels["tenant"], 0.0) + s.value
        return out

    async def metrics(self) -> dict[str, float]:
        """Scrape /metrics: {name{labels}: value} summed over label sets by bare name too."""
        from prometheus_client.parser import text_string_to_metric_families

        text = await asyncio.to_thread(http_get, f"http://127.0.0.1:{self.port}/metrics")
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    async def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the worker exited with {self.proc.returncode}; see {self.log.name}")
            try:
                await asyncio.to_thread(http_get, f"http://127.0.0.1:{self.port}/readyz")
                m = await self.metrics()
                if m.get("kafka_assigned_partitions", 0) > 0:
                    return
            except OSError:
                pass
            await asyncio.sleep(0.5)
        raise TimeoutError(f"the worker was not ready within {timeout} s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def http_get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def kv_tokens(a) -> int:
    return a.max_batch * (a.max_input + a.max_output)


# ---- one rate -----------------------------------------------------------------------------
