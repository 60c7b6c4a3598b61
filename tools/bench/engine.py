"""Engine benchmarks, each reporting ratios measured in one run on one machine.

  throughput  Inflight's engine (default settings, with the other kind of steps, and
              with its forward eager: `model.compile: off`; the engines compile before
              the clock starts) vs vLLM's offline engine (its CPU or CUDA build in its
              own venv, tools/setup_vllm.sh; skipped with a message when absent) vs transformers
              `generate` in static batches of the same size vs transformers' own
              continuous batching manager: same model, same requests (all submitted at
              t=0, EOS ignored so every system produces the same useful tokens), same
              running-request and step-token limits, KV enough for every request
              (vLLM's CPU cache is sized in GiB), prefix caching off. Output
              tokens/s counts only requested tokens; greedy agreement with Inflight's
              ids per system (identical requests, median first divergence).
              On CUDA (auto-detected) it uses bf16 and a random-init ~1B Llama.
  scheduler   CPU time per engine step with a no-op model runner at 64 / 256 / 1024
              running requests (all decoding), split into schedule + bookkeeping and
              detokenization/outputs; then preemptions and prefill tokens computed vs
              needed (recompute) on KV-pressure scenarios (issue 10's inputs and an
              overloaded random mix, issue 26's preempted streams, prefix caching off so
              recompute is not hidden) with the longest gap between two tokens of a
              request in steps;
              then fair share off vs on at 256 / 1024 running over --tenants tenants
              with churn (requests end every step, a backlog refills the slots).

Writes JSON (and a PNG for throughput) under --out, prints a table.

    python -m tools.bench.engine throughput --num-requests 256 --max-batch 32
    python -m tools.bench.engine scheduler
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from tools.bench.harness import (
    DEFAULT_MODEL,
    DEVICE_DEFAULTS,
    GPU_MODEL,
    apply_device_defaults,
    default_device,
    ensure_model,
    machine,
    report_header,
    torch_dtype,
    write_report,
)
from tools.bench.workloads import KINDS, TextTokens, make_workload


# ---- throughput ---------------------------------------------------------------------------
def run_inflight(path: Path, work, max_batch: int, kv_tokens: int, budget: int, pbar, device: str = "cpu",
                 backend: str = "auto", async_scheduling: bool | None = None,
                 compile_mode: str = "auto", cuda_graphs: str = "auto",
                 on_engine=None, max_model_len: int | None = None,
                 speculative=None) -> tuple[float, dict[str, list[int]]]:
    """Inflight's `Engine` over `work` offline: (seconds, greedy ids per request).
    `on_engine(engine)` is called once it is built (e.g. to read its `compile_report`);
    `max_model_len`: `model.max_model_len` (None: the checkpoint's); `speculative`:
    `serving_tuning.speculative` (None: off)."""
    from schemas.params import SamplingParams
    from worker.config import EngineConfig, ModelConfig, ServingTuning
    from worker.engine import Engine
    from worker.engine.gc_tuning import tune_gc

    extra = {} if speculative is None else {"speculative": speculative}
    tuning = ServingTuning(max_running_requests=max_batch, max_total_tokens=kv_tokens, max_batched_tokens=budget,
                           enable_prefix_caching=False, async_scheduling=async_scheduling,
                           **extra)  # limits: the model's context
    cfg = EngineConfig(model=ModelConfig(device=device, attention_backend=backend, compile=compile_mode,
                                         cuda_graphs=cuda_graphs, max_model_len=max_model_len),
                       serving_tuning=tuning)
    engine = Engine.from_pretrained(str(path), cfg)
    if on_engine is not None:
        on_engine(engine)
    tune_gc()  # as the worker's engine process does after start-up
    _sync(device)
    t0 = time.perf_counter()
    for r in work:
        engine.add_request(r.request_id, prompt_token_ids=r.prompt_token_ids,
                           params=SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True))
    produced = 0
    ids: dict[str, list[int]] = {r.request_id: [] for r in work}
    while engine.has_unfinished():
        for out in engine.step():
            produced += len(out.new_token_ids)
            ids[out.request_id].extend(out.new_token_ids)
            pbar.update(len(out.new_token_ids))
    _sync(device)
    elapsed = time.perf_counter() - t0
    assert produced == sum(r.max_tokens for r in work), (produced, sum(r.max_tokens for r in work))
    return elapsed, ids


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _hf_model(path: Path, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype(device), attn_implementation="sdpa")
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None  # ignore EOS, as the other systems do
    return model


def run_hf_static(path: Path, work, max_batch: int, pbar, device: str = "cpu") -> tuple[float, dict[str, list[int]]]:
    model = _hf_model(path, device)
    _sync(device)
    out_ids: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(work), max_batch):
            batch = work[i : i + max_batch]
            longest = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.zeros(len(batch), longest, dtype=torch.long)
            mask = torch.zeros(len(batch), longest, dtype=torch.long)
            for j, r in enumerate(batch):  # left padding
                ids[j, longest - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
                mask[j, longest - len(r.prompt_token_ids) :] = 1
            new = max(r.max_tokens for r in batch)
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, pad_token_id=0)
            assert out.shape[1] == longest + new
            for j, r in enumerate(batch):
                out_ids[r.request_id] = out[j, longest : longest + r.max_tokens].tolist()
            pbar.update(sum(r.max_tokens for r in batch))
    _sync(device)
    return time.perf_counter() - t0, out_ids


def run_hf_continuous(path: Path, work, max_batch: int, kv_tokens: int, budget: int, pbar,
                      device: str = "cpu") -> tuple[float, dict[str, list[int]]]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = _hf_model(path, device)
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in work), eos_token_id=None, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=kv_tokens // 16, max_batch_tokens=budget,
                                  max_requests_per_batch=max_batch)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    ids: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    manager.start()
    try:
        for r in work:
            manager.add_request(r.prompt_token_ids, request_id=r.request_id, max_new_tokens=r.max_tokens)
        done = 0
        produced = 0
        while done < len(work):
            res = manager.get_result(timeout=60)
            if res is None:
                raise RuntimeError("transformers continuous batching stopped producing results")
            if res.is_finished():
                done += 1
                produced += len(res.generated_tokens)
                ids[res.request_id] = list(res.generated_tokens)
                pbar.update(len(res.generated_tokens))
    finally:
        manager.stop(block=True)
    elapsed = time.perf_counter() - t0
    assert produced == sum(r.max_tokens for r in work), (produced, sum(r.max_tokens for r in work))
    return elapsed, ids


VLLM_PYTHON = Path(".cache/vllm-venv/bin/python")


def vllm_missing(python: Path) -> str | None:
    """Why vLLM cannot run (its venv is absent), or None."""
    if not python.is_file():
        return f"no vLLM interpreter at {python}: make it with tools/setup_vllm.sh"
    return None


def run_vllm(python: Path, path: Path, work, max_batch: int, kv_tokens: int, budget: int, pbar,
             device: str = "cpu") -> tuple[float, dict[str, list[int]]]:
    """vLLM's offline engine on the same requests and limits, in its own interpreter
    (`tools/bench/vllm_peer.py`). Raises RuntimeError with vLLM's last output if it fails."""
    import subprocess
    import tempfile

    from transformers import AutoConfig

    max_len = AutoConfig.from_pretrained(path).max_position_embeddings
    with tempfile.TemporaryDirectory() as tmp:
        job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job.write_text(json.dumps({
            "model": str(Path(path).resolve()), "dtype": str(torch_dtype(device)).removeprefix("torch."),
            "max_batch": max_batch, "budget": budget, "kv_tokens": kv_tokens, "max_model_len": max_len,
            "requests": [{"id": r.request_id, "prompt": r.prompt_token_ids, "max_tokens": r.max_tokens} for r in work],
        }))
        tool = Path(__file__).with_name("vllm_peer.py")
        proc = subprocess.run([str(python), str(tool), str(job), str(result)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        out = json.loads(result.read_text())
    pbar.update(sum(r.max_tokens for r in work))
    return out["seconds"], out["output_ids"]


def agreement(ref: dict[str, list[int]], other: dict[str, list[int]]) -> dict:
    """Greedy agreement of `other` with `ref` over the same requests: how many produced
    identical ids, and for the rest the median index of the first differing token."""
    firsts = []
    for rid, a in ref.items():
        b = other[rid]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        if first is not None:
            firsts.append(first)
    return {"requests": len(ref), "identical": len(ref) - len(firsts),
            "median_first_divergence": statistics.median(firsts) if firsts else None}


def throughput(a) -> dict:
    device = a.device if a.device != "auto" else default_device()
    apply_device_defaults(a, device)
    model = Path(a.model) if a.model else (GPU_MODEL if device == "cuda" else DEFAULT_MODEL)
    path = ensure_model(model)
    from transformers import AutoConfig, AutoTokenizer

    vocab = AutoConfig.from_pretrained(path).vocab_size
    text = TextTokens(AutoTokenizer.from_pretrained(path)) if a.prompts == "text" else None
    work = make_workload(a.workload, a.num_requests, vocab_size=vocab, scale=a.scale, seed=a.seed,
                         max_input=a.max_input, max_output=a.max_output, avoid_ids=frozenset({0, 1, 2, 3, 4}),
                         text=text)
    total_out = sum(r.max_tokens for r in work)
    total_in = sum(len(r.prompt_token_ids) for r in work)
    kv_tokens = a.max_batch * (a.max_input + a.max_output)
    systems = {
        "inflight": lambda p: run_inflight(path, work, a.max_batch, kv_tokens, a.budget, p, device, a.backend),
        "inflight_async": lambda p: run_inflight(path, work, a.max_batch, kv_tokens, a.budget, p, device,
                                                 a.backend, async_scheduling=True),
        "inflight_sequential": lambda p: run_inflight(path, work, a.max_batch, kv_tokens, a.budget, p, device,
                                                      a.backend, async_scheduling=False),
        "inflight_eager": lambda p: run_inflight(path, work, a.max_batch, kv_tokens, a.budget, p, device,
                                                 a.backend, compile_mode="off"),
        "vllm": lambda p: run_vllm(Path(a.vllm_python), path, work, a.max_batch, kv_tokens, a.budget, p, device),
        "hf_static_batching": lambda p: run_hf_static(path, work, a.max_batch, p, device),
        "hf_continuous_batching": lambda p: run_hf_continuous(path, work, a.max_batch, kv_tokens, a.budget, p,
                                                              device),
    }
    if a.systems is None:  # Inflight as configured by default, and with the other kind of steps
        other = "inflight_sequential" if device == "cuda" else "inflight_async"
        a.systems = ["inflight", other, "inflight_eager", "vllm", "hf_static_batching", "hf_continuous_batching"]
    results, skipped, output_ids = {}, {}, {}
    for name in a.systems:
        if name == "vllm" and (why := vllm_missing(Path(a.vllm_python))):
            print(f"vllm: skipped ({why})")
            skipped[name] = why
            continue
        with tqdm(total=total_out, desc=name, unit="tok") as pbar:
            elapsed, output_ids[name] = systems[name](pbar)
        # every system is checked to produce exactly the requested tokens (EOS ignored)
        results[name] = {"seconds": elapsed, "output_tokens": total_out, "output_tokens_per_s": total_out / elapsed,
                         "requests_per_s": len(work) / elapsed}
        print(f"{name}: {total_out / elapsed:.1f} output tok/s")
    base = results.get("inflight")
    ratios, agree = {}, {}
    if base:
        for name, r in results.items():
            if name != "inflight":
                ratios[f"inflight_vs_{name}"] = base["output_tokens_per_s"] / r["output_tokens_per_s"]
                agree[f"inflight_vs_{name}"] = agreement(output_ids["inflight"], output_ids[name])
    report = {
        **report_header("throughput", a, path, device),
        "workload": {"kind": a.workload, "prompts": a.prompts, "num_requests": a.num_requests, "scale": a.scale,
                     "seed": a.seed, "input_tokens": total_in, "output_tokens": total_out,
                     "mean_input": total_in / len(work), "mean_output": total_out / len(work)},
        "requests": [{"id": r.request_id, "shape": r.shape, "input_tokens": len(r.prompt_token_ids),
                      "output_tokens": r.max_tokens} for r in work],
        "max_batch": a.max_batch,
        "max_batched_tokens": a.budget,
        "results": results,
        "ratios": ratios,
        "greedy_agreement": agree,
        "skipped": skipped,
    }
    _plot_throughput(report, Path(a.out) / "bench_engine_throughput.png")
    print(f"\n{'system':<26}{'seconds':>10}{'out tok/s':>12}")
    for name, r in results.items():
        print(f"{name:<26}{r['seconds']:>10.1f}{r['output_tokens_per_s']:>12.1f}")
    for k, v in ratios.items():
        g = agree[k]
        print(f"{k}: {v:.2f}x   greedy ids identical on {g['identical']}/{g['requests']} requests"
              + (f", median first divergence at token {g['median_first_divergence']}" if g["identical"] < g["requests"]
                 else ""))
    return report


def _plot_throughput(report: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["results"])
    vals = [report["results"][n]["output_tokens_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 4))
    palette = {"inflight": "#2a7", "inflight_async": "#7c9", "inflight_sequential": "#7c9", "vllm": "#c63"}
    ax.bar(names, vals, color=[palette.get(n, "#888") for n in names])
    ax.tick_params(axis="x", labelrotation=15)
    ax.set_ylabel("output tokens / s")
    ax.set_xlabel("system (same model, requests and max batch)")
    w = report["workload"]
    ax.set_title(f"{w['kind']} workload, {w['num_requests']} requests, max batch {report['max_batch']}")
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.0f}", ha="center", va="bottom")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)


# ---- scheduler overhead -------------------------------------------------------------------
def scheduler_overhead(a) -> dict:
    from schemas.params import SamplingParams
    from worker.config import EngineConfig, ServingTuning
    from worker.model.null_runner import null_engine
    from worker.obs.metrics import Metrics

    rows = []
    for n in a.running:
        steps = a.steps
        cfg = EngineConfig(serving_tuning=ServingTuning(
            max_running_requests=n, max_batched_tokens=n * 16, max_total_tokens=n * (16 + steps + 64),
            max_output_tokens=steps + 32, kv_block_size=16,
        ))
        eng = null_engine(cfg, vocab_size=32000, max_model_len=16 + steps + 64)
        for i in range(n):
            eng.add_request(f"r{i}", prompt_token_ids=[(i * 7 + j) % 31999 + 1 for j in range(16)],
                            params=SamplingParams(max_tokens=steps + 16, ignore_eos=True))
        eng.step()  # prefill everyone
        assert eng.scheduler.num_running == n
        sched_ms, update_ms, total_ms = [], [], []
        sch = eng.scheduler
        runner = eng.runner
        for _ in tqdm(range(steps), desc=f"{n} running", unit="step"):
            t0 = time.perf_counter()
            out = sch.schedule()
            t1 = time.perf_counter()
            ro = runner.execute(out)
            t2 = time.perf_counter()
            sch.update_from_output(out, ro)
            t3 = time.perf_counter()
            sched_ms.append((t1 - t0) * 1e3)
            update_ms.append((t3 - t2) * 1e3)
            total_ms.append((t3 - t0 - (t2 - t1)) * 1e3)
        full, metrics_ms = [], []
        metrics = Metrics()
        for _ in range(min(steps, 20)):  # whole Engine.step incl. detokenization and outputs
            t0 = time.perf_counter()
            eng.step()
            t1 = time.perf_counter()
            metrics.observe_step(eng.last_step_stats)  # what the worker's engine thread adds per step
            full.append((t1 - t0) * 1e3)
            metrics_ms.append((time.perf_counter() - t1) * 1e3)
        rows.append({
            "running_requests": n,
            "schedule_ms": statistics.median(sched_ms),
            "update_ms": statistics.median(update_ms),
            "scheduler_plus_bookkeeping_ms": statistics.median(total_ms),
            "engine_step_with_detokenize_ms": statistics.median(full),
            "metrics_per_step_ms": statistics.median(metrics_ms),
        })
    print(f"\n{'running':>8}{'schedule ms':>13}{'update ms':>11}{'sched+book ms':>15}{'full step ms':>14}"
          f"{'metrics ms':>12}")
    for r in rows:
        print(f"{r['running_requests']:>8}{r['schedule_ms']:>13.3f}{r['update_ms']:>11.3f}"
              f"{r['scheduler_plus_bookkeeping_ms']:>15.3f}{r['engine_step_with_detokenize_ms']:>14.3f}"
              f"{r['metrics_per_step_ms']:>12.4f}")
    pressure = [kv_pressure(name) for name in KV_PRESSURE]
    print(f"\n{'kv pressure':<18}{'blocks':>7}{'steps':>7}{'preemptions':>13}{'max/request':>13}"
          f"{'prefill needed':>16}{'computed':>10}{'ratio':>7}{'max gap':>9}")
    for r in pressure:
        print(f"{r['scenario']:<18}{r['num_blocks']:>7}{r['steps']:>7}{r['preemptions']:>13}"
              f"{r['max_preemptions_per_request']:>13}{r['prefill_tokens_needed']:>16}"
              f"{r['prefill_tokens_computed']:>10}{r['recompute_ratio']:>7.2f}{r['max_stream_gap_steps']:>9}")
    fairness = [fair_share_overhead(n, a.tenants, a.steps) for n in a.fair_running]
    print(f"\n{'fair share':<12}{'running':>8}{'tenants':>8}{'off ms':>9}{'on ms':>9}{'on/off':>8}"
          f"{'admitted/step':>15}{'preemptions on':>16}")
    for r in fairness:
        print(f"{'':<12}{r['running_requests']:>8}{r['tenants']:>8}{r['off_ms']:>9.3f}{r['on_ms']:>9.3f}"
              f"{r['ratio']:>8.2f}{r['admitted_per_step']:>15.1f}{r['preemptions_on']:>16}")
    return {"mode": "scheduler", "command": a.command_line, "machine": machine(), "rows": rows,
            "kv_pressure": pressure, "fair_share": fairness}


def fair_share_overhead(n: int, num_tenants: int, steps: int, repeats: int = 3) -> dict:
    """Scheduler CPU per step (schedule + update_from_output, median over `steps`
    steps, best of `repeats` runs) with `serving_tuning.fair_share` off and on: `n`
    running requests over `num_tenants` tenants, lengths spread so some end every
    step, and a backlog of n/4 waiting requests topped up so every freed slot is
    refilled (admission, Pick and the Yield check run each step)."""
    from schemas.params import SamplingParams
    from worker.config import EngineConfig, ServingTuning
    from worker.model.null_runner import null_engine

    def run(fair: bool) -> tuple[float, float, int]:
        cfg = EngineConfig(serving_tuning=ServingTuning(
            max_running_requests=n, max_batched_tokens=n * 16, max_total_tokens=n * 4 * (16 + 160),
            max_output_tokens=256, kv_block_size=16, fair_share=fair, enable_prefix_caching=False))
        eng = null_engine(cfg, vocab_size=32000, max_model_len=1024)
        sch = eng.scheduler
        timed = [0.0]
        for name in ("schedule", "update_from_output"):
            inner = getattr(sch, name)

            def wrapper(*args, _inner=inner, **kw):
                t0 = time.perf_counter()
                try:
                    return _inner(*args, **kw)
                finally:
                    timed[0] += time.perf_counter() - t0
            setattr(sch, name, wrapper)
        count = [0]

        def add(k: int) -> None:
            for _ in range(k):
                i = count[0]
                count[0] += 1
                eng.add_request(f"r{i}", prompt_token_ids=[(i * 7 + j) % 31999 + 1 for j in range(16)],
                                params=SamplingParams(max_tokens=40 + (i * 37) % 120, ignore_eos=True),
                                tenant=f"t{i % num_tenants}")
        add(n + n // 4)
        for _ in range(200):  # to the steady state: lengths spread, slots full
            eng.step()
            add(n + n // 4 - sch.num_running - sch.num_waiting)
        per_step = []
        admitted = 0
        for _ in range(steps):
            timed[0] = 0.0
            before = count[0]
            eng.step()
            per_step.append(timed[0] * 1e3)
            add(n + n // 4 - sch.num_running - sch.num_waiting)
            admitted += count[0] - before
        return statistics.median(per_step), admitted / steps, sch.num_preemptions_total

    off = min(run(False)[0] for _ in range(repeats))
    on_runs = [run(True) for _ in range(repeats)]
    on = min(r[0] for r in on_runs)
    return {"running_requests": n, "tenants": num_tenants, "off_ms": off, "on_ms": on, "ratio": on / off,
            "admitted_per_step": on_runs[0][1], "preemptions_on": on_runs[0][2]}


def _random_overload(rng) -> list[tuple[int, str, int, int]]:
    return [(i * 2, f"r{i}", rng.randint(1, 200), rng.randint(1, 120)) for i in range(40)]


# scenario: (KV blocks of 16 tokens, max_batched_tokens, [(add before step, id, prompt tokens, max_tokens)])
KV_PRESSURE = {
    "issue10-8-blocks": (8, 32, [(0, "run", 60, 20), (2, "heavy", 70, 4)]),
    "issue10-64-blocks": (64, 32, [(0, "run0", 220, 40), (0, "run1", 220, 40), (0, "run2", 220, 40),
                                   (2, "big", 600, 4), (2, "small0", 40, 4), (2, "small1", 40, 4)]),
    "random-overload": (24, 32, None),  # 40 requests (1-200 prompt, 1-120 output), one every 2 steps
    "issue26-12-blocks": (12, 64, [(0, "p0", 40, 100), (0, "p1", 40, 100), (0, "p2", 40, 100),
                                   (25, "fresh0", 40, 100), (25, "fresh1", 30, 100)]),
}


def kv_pressure(name: str) -> dict:
    """Run one KV_PRESSURE scenario over a NullRunner; count preemptions and prefill
    tokens computed (recompute included) against the prompt tokens needed, and the
    longest gap in steps between two tokens of one request (stream smoothness)."""
    import random

    from schemas.params import SamplingParams
    from worker.config import EngineConfig, ServingTuning
    from worker.model.null_runner import null_engine

    num_blocks, budget, work = KV_PRESSURE[name]
    work = work or _random_overload(random.Random(0))
    eng = null_engine(EngineConfig(serving_tuning=ServingTuning(
        max_total_tokens=num_blocks * 16, kv_block_size=16, max_batched_tokens=budget, enable_prefix_caching=False,
        max_output_tokens=256, priority_aging_steps=10**6)), vocab_size=32000, max_model_len=2048)
    preemptions: dict[str, int] = {}
    last_token: dict[str, int] = {}
    max_gap = 0
    computed = steps = 0
    while steps == 0 or eng.has_unfinished() or any(at >= steps for at, *_ in work):
        for at, rid, prompt, max_tokens in work:
            if at == steps:
                eng.add_request(rid, prompt_token_ids=[7] * prompt, params=SamplingParams(max_tokens=max_tokens,
                                                                                         ignore_eos=True))
        for out in eng.step():
            if out.new_token_ids:
                if out.request_id in last_token:
                    max_gap = max(max_gap, steps - last_token[out.request_id])
                last_token[out.request_id] = steps
            if out.finished:
                preemptions[out.request_id] = out.num_preemptions
        computed += eng.last_step_stats.num_prefill_tokens
        steps += 1
    needed = sum(prompt for _, _, prompt, _ in work)
    return {"scenario": name, "num_blocks": num_blocks, "max_batched_tokens": budget, "num_requests": len(work),
            "steps": steps, "preemptions": sum(preemptions.values()),
            "max_preemptions_per_request": max(preemptions.values()), "prefill_tokens_needed": needed,
            "prefill_tokens_computed": computed, "recompute_ratio": computed / needed,
            "max_stream_gap_steps": max_gap}


def add_size_args(p: argparse.ArgumentParser) -> None:
    cpu, gpu = DEVICE_DEFAULTS["cpu"], DEVICE_DEFAULTS["cuda"]
    p.add_argument("--scale", type=float, default=None,
                   help=f"divide the workload's mean lengths (default {cpu['scale']} on CPU, {gpu['scale']} on CUDA)")
    p.add_argument("--max-batch", type=int, default=None,
                   help=f"max running requests / static batch size (default {cpu['max_batch']} / {gpu['max_batch']})")
    p.add_argument("--budget", type=int, default=None,
                   help=f"max_batched_tokens per step (default {cpu['budget']} / {gpu['budget']})")
    p.add_argument("--max-input", type=int, default=None, help="cap on prompt tokens (default 512 / 1024)")
    p.add_argument("--max-output", type=int, default=None, help="cap on output tokens (default 512 / 512)")


def main(argv: list[str] | None = None) -> int:
    import sys

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results", help="folder for JSON and PNG results")
    sub = p.add_subparsers(dest="mode", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--model", default=None,
                   help=f"HF checkpoint dir (default {DEFAULT_MODEL} on CPU, {GPU_MODEL} on CUDA; made if missing)")
    t.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    t.add_argument("--backend", default="auto", choices=["auto", "torch", "cpu", "triton"], help="Inflight attention back end")
    t.add_argument("--workload", default="mixed", choices=sorted(KINDS))
    t.add_argument("--prompts", default="text", choices=["text", "random"],
                   help="real text through the model's tokenizer, or random token ids")
    t.add_argument("--num-requests", type=int, default=256)
    add_size_args(t)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--systems", nargs="+", default=None,
                   choices=["inflight", "inflight_async", "inflight_sequential", "inflight_eager", "vllm",
                            "hf_static_batching", "hf_continuous_batching"],
                   help="default: inflight (default settings: model.compile auto), inflight_async on the CPU / "
                        "inflight_sequential on CUDA (serving_tuning.async_scheduling forced on / off: the "
                        "non-default), inflight_eager (model.compile off), vllm (skipped when --vllm-python is "
                        "absent), hf_static_batching, hf_continuous_batching")
    t.add_argument("--vllm-python", default=str(VLLM_PYTHON),
                   help="interpreter of vLLM's venv (tools/setup_vllm.sh makes the default)")
    s = sub.add_parser("scheduler")
    s.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024])
    s.add_argument("--steps", type=int, default=100)
    s.add_argument("--tenants", type=int, default=100, help="tenants of the fair-share rows")
    s.add_argument("--fair-running", type=int, nargs="+", default=[256, 1024],
                   help="running requests of the fair-share rows")
    a = p.parse_args(argv)
    a.command_line = "python -m tools.bench.engine " + " ".join(argv if argv is not None else sys.argv[1:])
    torch.manual_seed(0)
    report = throughput(a) if a.mode == "throughput" else scheduler_overhead(a)
    write_report(report, a.out, f"bench_engine_{a.mode}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
