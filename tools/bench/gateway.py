"""Gateway overhead and throughput: what the HTTP front door (`inflight gateway`) adds to
the path a producer with a Redis subscription already has, and how many streamed tokens
one gateway process carries per core of its own CPU.

Setup: the dev stack, fresh topics, one worker process around the model-less sleeping
engine (`tools.bench.pipeline`'s: `--device-ms` per step stands in for a GPU), one
gateway process (`python -m worker gateway`), and this load generator.

  1. overhead: Poisson arrivals at `--rate` requests/s for `--duration` s, alternately
     (a) direct: `InflightClient.submit` + `stream` (Kafka in, the Redis channel and log
     out), and (b) through the gateway: `POST /v1/completions` with `stream: true`,
     parsed as server-sent events. Same jobs (`--prompt-len` token ids in,
     `--output-len` tokens out), same worker, same moment, so the difference of the two
     time-to-first-token distributions is the gateway's. Default rate: the end-to-end
     benchmark's medium load (16 requests/s).
  2. throughput: `--streams` concurrent streaming requests of `--stream-tokens` tokens,
     back to back for `--throughput-s` s; the gateway process's CPU seconds (psutil) in
     that window give tokens and SSE chunks per CPU-second (= per core at full use).

Writes results/bench_gateway.json and prints both tables.

    tools/stack/devstack.sh up
    python -m tools.bench.gateway                 # ~1.5 minutes here
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tools.bench.connections import add_connection_args, connection_sections, worker_sections
from tools.bench.harness import free_port, percentile
from tools.bench.pipeline import CpuSampler, prompt_ids, tuning_dict

KEY = "sk-bench-gateway-key"
TENANT = "bench"


def write_configs(a, prefix: str, tmp: Path, worker: dict, gateway: dict,
                  gateway_sections: dict | None = None) -> tuple[int, dict[str, str]]:
    """`tmp/worker.yaml` (the `worker` sections plus Kafka and Redis of `prefix`, from
    `a.kafka_cfg` / `a.redis_cfg`) and `tmp/gateway.yaml` (one API key `KEY` of tenant
    `TENANT`, a free port, the `gateway` fields over the defaults here, and the other
    `gateway_sections`, e.g. `tracing`). Returns the gateway's port and the environment
    carrying the connections' secrets (never on disk)."""
    import yaml

    kafka, redis, secret_env = worker_sections(a.kafka_cfg, a.redis_cfg)
    kafka.update(topic_prefix=prefix, group_id=f"{prefix}-workers", commit_interval_ms=200)
    redis.update(key_prefix=prefix, log_ttl_s=600)
    wcfg = {**worker, "kafka": kafka, "redis": redis,
            "worker": {"worker_id": f"{prefix}-w", "log_level": getattr(a, "worker_log_level", "WARNING")},
            "metrics": {"port": None}}
    (tmp / "worker.yaml").write_text(yaml.safe_dump(wcfg))
    port = free_port()
    gcfg = {"gateway": {"host": "127.0.0.1", "port": port, "model_name": "bench", "files_dir": str(tmp / "files"),
                        "api_keys": [{"key": KEY, "tenant": TENANT, "max_priority": "high"}],
                        "max_concurrent_requests": 100_000, **gateway},
            "kafka": {k: v for k, v in kafka.items() if k not in ("group_id",)}, "redis": redis,
            **(gateway_sections or {})}
    (tmp / "gateway.yaml").write_text(yaml.safe_dump(gcfg))
    return port, {**os.environ, **secret_env}


def start_gateway(tmp: Path, out, env: dict[str, str]) -> subprocess.Popen:
    """`python -m worker gateway` on `tmp/gateway.yaml` (`write_configs`), logging to `out`."""
    return subprocess.Popen([sys.executable, "-m", "worker", "gateway", "--config", str(tmp / "gateway.yaml"),
                             "--log-level", "WARNING"], stdout=out, stderr=subprocess.STDOUT, env=env)


def start_processes(a, prefix: str, tmp: Path) -> tuple[subprocess.Popen, subprocess.Popen, int]:
    tuning = tuning_dict(a.running, max(a.output_len, a.stream_tokens))
    port, env = write_configs(a, prefix, tmp, {"serving_tuning": tuning}, {})
    out = open(Path(a.out) / "bench_gateway_processes.log", "a")  # noqa: SIM115 (outlives this function)
    worker = subprocess.Popen([sys.executable, "-m", "tools.bench.pipeline", "worker", "--config",
                               str(tmp / "worker.yaml"), "--device-ms", str(a.device_ms), "--tuning",
                               json.dumps(tuning)], stdout=out, stderr=subprocess.STDOUT, env=env)
    return worker, start_gateway(tmp, out, env), port


async def readyz(port: int, timeout: float = 120.0) -> None:
    """Poll the gateway's /readyz until it answers 200 (its default pool has a live
    worker). Raises TimeoutError after `timeout` seconds."""
    import aiohttp

    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while True:
            try:
                async with http.get(f"http://127.0.0.1:{port}/readyz") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the gateway did not become ready")
            await asyncio.sleep(0.5)


async def wait_ready(port: int, direct, timeout: float = 120.0) -> None:
    from schemas.params import SamplingParams

    await readyz(port, timeout)
    job = await direct.submit(prompt_token_ids=prompt_ids(0), params=SamplingParams(max_tokens=2, ignore_eos=True),
                              tenant=TENANT)
    await direct.result(job, timeout_s=timeout, tenant=TENANT)  # the worker is up


async def direct_one(direct, i: int, a, submits: list[float]) -> float:
    from schemas.params import SamplingParams
    from schemas.wire import Token

    t0 = time.perf_counter()
    job = await direct.submit(prompt_token_ids=prompt_ids(i),
                              params=SamplingParams(max_tokens=a.output_len, temperature=0, ignore_eos=True),
                              tenant=TENANT)
    submits.append(time.perf_counter() - t0)
    first = None
    async for ev in direct.stream(job, tenant=TENANT, timeout_s=120):
        if first is None and isinstance(ev, Token) and ev.token_ids:
            first = time.perf_counter() - t0
    return first


def server_timing(header: str) -> dict[str, float]:
    """`Server-Timing` entries in seconds."""
    out = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        if dur:
            out[name] = float(dur) / 1e3
    return out


async def gateway_one(http, port: int, i: int, max_tokens: int, counts: dict | None = None,
                      timing: list | None = None) -> float:
    body = {"model": "bench", "prompt": prompt_ids(i), "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                         headers={"Authorization": f"Bearer {KEY}"}) as r:
        if r.status != 200:
            raise RuntimeError(f"gateway answered {r.status}: {await r.text()}")
        if timing is not None:
            timing.append(server_timing(r.headers.get("Server-Timing", "")))
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            if first is None and b'"text":"' in line and b'"text":""' not in line:
                first = time.perf_counter() - t0
            if counts is not None:
                counts["chunks"] += 1
                if b'"usage":{' in line:
                    counts["tokens"] += json.loads(line[6:])["usage"]["completion_tokens"]
    return first


async def overhead(a, port: int, direct) -> dict:
    import aiohttp

    rng = random.Random(7)
    got: dict[str, list[float]] = {"direct": [], "gateway": []}
    timing: list[dict[str, float]] = []
    submits: list[float] = []
    tasks = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        t_end = time.monotonic() + a.duration
        i = 0
        while time.monotonic() < t_end:
            path = "direct" if i % 2 == 0 else "gateway"
            coro = (direct_one(direct, i, a, submits) if path == "direct"
                    else gateway_one(http, port, i, a.output_len, timing=timing))

            async def run(coro=coro, path=path):
                got[path].append(await coro)

            tasks.append(asyncio.create_task(run()))
            i += 1
            await asyncio.sleep(rng.expovariate(a.rate))
        await asyncio.gather(*tasks)
    out = {"rate": a.rate, "duration_s": a.duration, "requests": i}
    for path, xs in got.items():
        out[path] = {"n": len(xs), "p50_ms": percentile(xs, 50) * 1e3, "p99_ms": percentile(xs, 99) * 1e3}
    out["direct"]["submit_p50_ms"] = percentile(submits, 50) * 1e3
    inside = [t["first_token"] for t in timing if "first_token" in t]
    out["gateway"]["inside_p50_ms"] = percentile(inside, 50) * 1e3  # the gateway's own submit -> first token
    out["gateway"]["inside_p99_ms"] = percentile(inside, 99) * 1e3
    out["gateway"]["submit_p50_ms"] = percentile([t["submit"] for t in timing if "submit" in t], 50) * 1e3
    out["overhead_p50_ms"] = out["gateway"]["p50_ms"] - out["direct"]["p50_ms"]
    out["overhead_p99_ms"] = out["gateway"]["p99_ms"] - out["direct"]["p99_ms"]
    return out


async def throughput(a, port: int, gateway_pid: int) -> dict:
    import aiohttp

    sampler = CpuSampler(gateway_pid)
    counts = {"tokens": 0, "chunks": 0}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.sleep(0.3)
        t0 = time.time()
        t_end = time.monotonic() + a.throughput_s

        async def loop(k: int) -> None:
            n = 0
            while time.monotonic() < t_end:
                await gateway_one(http, port, k * 1000 + n, a.stream_tokens, counts)
                n += 1

        await asyncio.gather(*(loop(k) for k in range(a.streams)))
        t1 = time.time()
    await asyncio.sleep(0.1)
    sampler.stop()
    cpu = sampler.cpu_between(t0, t1)
    wall = t1 - t0
    return {"streams": a.streams, "tokens_per_request": a.stream_tokens, "seconds": wall,
            "tokens": counts["tokens"], "chunks": counts["chunks"], "gateway_cpu_s": cpu,
            "gateway_cpu_util": cpu / wall, "tokens_per_s": counts["tokens"] / wall,
            "tokens_per_cpu_s": counts["tokens"] / max(cpu, 1e-9),
            "chunks_per_cpu_s": counts["chunks"] / max(cpu, 1e-9)}


async def run(a) -> dict:
    from worker.cli.topics import create_topics
    from worker.client import InflightClient

    prefix = f"gwb{uuid.uuid4().hex[:8]}"
    await create_topics(a.kafka, prefix, partitions=a.partitions, kafka=a.kafka_cfg)
    with tempfile.TemporaryDirectory() as tmp:
        worker, gateway, port = start_processes(a, prefix, Path(tmp))
        try:
            async with InflightClient(kafka=a.kafka_cfg, redis=a.redis_cfg, topic_prefix=prefix,
                                      key_prefix=prefix) as direct:
                await wait_ready(port, direct)
                over = await overhead(a, port, direct)
                thr = await throughput(a, port, gateway.pid)
        finally:
            for p in (gateway, worker):
                p.terminate()
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
    return {"overhead": over, "throughput": thr}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_connection_args(p)
    p.add_argument("--rate", type=float, default=16.0, help="requests/s of the overhead phase (both paths together)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of the overhead phase")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--device-ms", type=float, default=2.0, help="emulated device time per engine step")
    p.add_argument("--running", type=int, default=128)
    p.add_argument("--streams", type=int, default=32, help="concurrent streams of the throughput phase")
    p.add_argument("--stream-tokens", type=int, default=512)
    p.add_argument("--throughput-s", type=float, default=20.0)
    p.add_argument("--partitions", type=int, default=3)
    p.add_argument("--out", default="results")
    a = p.parse_args(argv)
    from tools.bench.harness import machine

    a.kafka_cfg, a.redis_cfg = connection_sections(a)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    res = asyncio.run(run(a))
    report = {"mode": "gateway", "command": "python -m tools.bench.gateway " + " ".join(argv or sys.argv[1:]),
              "machine": machine(), "device_ms": a.device_ms, "output_len": a.output_len, **res}
    out = Path(a.out) / "bench_gateway.json"
    out.write_text(json.dumps(report, indent=2))
    o, t = res["overhead"], res["throughput"]
    print(f"\nTTFT at {o['rate']:g} req/s ({o['requests']} requests, {a.output_len} output tokens, "
          f"{a.device_ms:g} ms steps)")
    print(f"{'path':>10}{'n':>6}{'p50 ms':>10}{'p99 ms':>10}{'submit p50':>12}")
    for path in ("direct", "gateway"):
        print(f"{path:>10}{o[path]['n']:>6}{o[path]['p50_ms']:>10.1f}{o[path]['p99_ms']:>10.1f}"
              f"{o[path]['submit_p50_ms']:>12.1f}")
    print(f"(inside the gateway, its submit to the first token: p50 {o['gateway']['inside_p50_ms']:.1f} ms, "
          f"p99 {o['gateway']['inside_p99_ms']:.1f} ms)")
    print(f"{'overhead':>10}{'':>6}{o['overhead_p50_ms']:>+10.1f}{o['overhead_p99_ms']:>+10.1f}")
    print(f"\nthroughput: {t['streams']} streams x {t['tokens_per_request']} tokens for {t['seconds']:.1f} s: "
          f"{t['tokens_per_s']:.0f} tokens/s, gateway CPU {t['gateway_cpu_util'] * 100:.0f} % of a core -> "
          f"{t['tokens_per_cpu_s']:.0f} tokens and {t['chunks_per_cpu_s']:.0f} SSE chunks per gateway CPU-second")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
