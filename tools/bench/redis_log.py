"""What a job's replay log costs Redis, with and without log compaction
(`redis.compact_logs`, schemas/replay.py), side by side in one run on the same jobs.

Drives the worker's own publishing path (JobTable -> Publisher -> the append script, claims
included) against a real Redis with a fresh key prefix: --jobs jobs of --tokens output
tokens each, one publish round per --tokens-per-round tokens (1: a publisher that keeps
up, the most entries a log can get), job ids as UUIDs, token ids drawn from a
--vocab-sized vocabulary and text deltas of 1-6 characters cut from docs/concepts.md
(3.5 on average, about what a BPE tokenizer makes of English). For
each configuration it reports `MEMORY USAGE` (exact: SAMPLES 0) of each log while the job
runs (its last round before the end) and after it ended, bytes per 1k output tokens,
the entries per log, the time of the terminal round (the rewrite happens there), and
checks that `InflightClient.read_log` returns the same events from both logs. Writes
bench_redis_log.json and bench_redis_log.png under --out.

    tools/stack/devstack.sh up && python -m tools.bench.redis_log --jobs 20 --tokens 900
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
import uuid
from pathlib import Path

CORPUS = Path(__file__).resolve().parents[2] / "docs" / "concepts.md"  # English prose with code, as models write


def deltas(rng: random.Random, n: int, vocab: int) -> list[tuple[list[int], str]]:
    """n one-token deltas (token id, text) cut from the corpus at a random place, 1-6
    characters each (a BPE tokenizer's ~4 characters a token on English)."""
    text = CORPUS.read_text()
    pos = rng.randrange(len(text) // 2)
    out = []
    for _ in range(n):
        size = rng.randint(1, 6)
        out.append(([rng.randrange(vocab)], text[pos:pos + size]))
        pos = (pos + size) % (len(text) - 6)
    return out


async def run_config(redis_url: str, compact: bool, jobs: list[list[tuple[list[int], str]]], per_round: int,
                     logprobs: bool) -> dict:
    import redis.asyncio as aioredis

    from schemas import keys
    from schemas.wire import Job
    from worker.client import InflightClient
    from worker.config import RedisConfig
    from worker.engine import RequestOutput
    from worker.engine.outputs import TokenLogprobs
    from worker.serve.claims import Claimed, ClaimStore
    from worker.serve.jobs import JobTable
    from worker.serve.publish import Publisher
    from worker.serve.read_ahead import JobRecord

    prefix = f"benchlog{uuid.uuid4().hex[:8]}"
    r = aioredis.from_url(redis_url)
    cfg = RedisConfig(url=redis_url, key_prefix=prefix)
    claims = ClaimStore(r, prefix, "bench", lease_ms=60_000, ttl_s=600, tombstone_ttl_s=600)
    await claims.adopt_epoch()
    table = JobTable("bench", compact_logs=compact)
    pub = Publisher(r, cfg, claims, table)
    running, ended, entries_running, entries_ended, end_ms, round_ms, replay = [], [], [], [], [], [], []
    try:
        async with InflightClient("127.0.0.1:1", redis_url, key_prefix=prefix) as client:
            for job in jobs:
                jid = str(uuid.uuid4())
                log_key = keys.log_key(jid, prefix)
                (c,) = await claims.take([jid])
                table.open(JobRecord(Job(job_id=jid, prompt="x"), "normal", None, 0, time.time(), None, None),
                           Claimed(c.token, c.attempt, c.next_seq, 0, False))
                table.accepted(jid)
                for i in range(0, len(job), per_round):
                    part = job[i:i + per_round]
                    ids = [t for d in part for t in d[0]]
                    lps = [TokenLogprobs(t, -1.25, [t], [-1.25]) for t in ids] if logprobs else None
                    last = i + per_round >= len(job)
                    table.apply_outputs([RequestOutput(jid, ids, "".join(d[1] for d in part), logprobs=lps)])
                    if last:  # the job's last round before its end: the log as it is while running
                        await pub.send(table.drain())
                        running.append(await r.memory_usage(log_key, samples=0))
                        entries_running.append(await r.xlen(log_key))
                        before = await client.read_log(jid)
                        table.apply_outputs([RequestOutput(jid, [], "", finished=True, finish_reason="length")])
                    rnd = table.drain()
                    t0 = time.perf_counter()
                    await pub.send(rnd)
                    (end_ms if last else round_ms).append((time.perf_counter() - t0) * 1000)
                    if last:
                        for held in rnd.finished:
                            table.done(held)
                ended.append(await r.memory_usage(log_key, samples=0))
                entries_ended.append(await r.xlen(log_key))
                after = await client.read_log(jid)
                replay.append(after[:-1] == before and after[-1].seq == len(before))
    finally:
        async for k in r.scan_iter(match=f"{prefix}:*", count=1000):
            await r.delete(k)
        await r.aclose()
    num_tokens = sum(len(j) for j in jobs)
    return {
        "compact_logs": compact,
        "bytes_running": sum(running), "bytes_ended": sum(ended),
        "bytes_per_1k_tokens_running": round(sum(running) / num_tokens * 1000),
        "bytes_per_1k_tokens_ended": round(sum(ended) / num_tokens * 1000),
        "entries_per_log_running": sum(entries_running) / len(jobs),
        "entries_per_log_ended": sum(entries_ended) / len(jobs),
        "terminal_round_ms_p50": sorted(end_ms)[len(end_ms) // 2],
        "token_round_ms_p50": sorted(round_ms)[len(round_ms) // 2] if round_ms else None,
        "replay_identical": all(replay),
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [f"compact_logs={c['compact_logs']}" for c in report["configs"]]
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], [c["bytes_per_1k_tokens_running"] / 1000 for c in report["configs"]], 0.4,
           label="while running")
    ax.bar([i + 0.2 for i in x], [c["bytes_per_1k_tokens_ended"] / 1000 for c in report["configs"]], 0.4,
           label="after the end (kept log_ttl_s)")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("Redis KB per 1k output tokens")
    ax.set_title(f"replay log, {report['jobs']} jobs x {report['tokens']} tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis", default="redis://127.0.0.1:6390/0")
    ap.add_argument("--jobs", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=900, help="output tokens per job")
    ap.add_argument("--tokens-per-round", type=int, default=1, help="tokens per publish round (per log entry)")
    ap.add_argument("--vocab", type=int, default=128_256, help="token ids are drawn below this")
    ap.add_argument("--logprobs", action="store_true", help="every token with its logprob and one top logprob")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results")
    a = ap.parse_args(argv)
    a.command_line = " ".join(sys.argv if argv is None else ["python -m tools.bench.redis_log", *argv])
    from tools.bench.harness import machine, write_report

    rng = random.Random(a.seed)
    jobs = [deltas(rng, a.tokens, a.vocab) for _ in range(a.jobs)]
    configs = [asyncio.run(run_config(a.redis, compact, jobs, a.tokens_per_round, a.logprobs))
               for compact in (False, True)]
    off, on = configs
    report = {"mode": "redis_log", "command": a.command_line, "machine": machine(), "jobs": a.jobs,
              "tokens": a.tokens, "tokens_per_round": a.tokens_per_round, "logprobs": a.logprobs,
              "configs": configs,
              "ended_on_vs_off": round(on["bytes_ended"] / off["bytes_ended"], 3),
              "running_on_vs_off": round(on["bytes_running"] / off["bytes_running"], 3)}
    path = write_report(report, a.out, "bench_redis_log.json")
    plot(report, Path(a.out) / "bench_redis_log.png")
    print(f"{'compact_logs':>12} {'B/1k tok running':>17} {'B/1k tok ended':>15} {'entries ended':>14} "
          f"{'end round ms':>13} {'replay same':>12}")
    for c in configs:
        print(f"{c['compact_logs']!s:>12} {c['bytes_per_1k_tokens_running']:>17} {c['bytes_per_1k_tokens_ended']:>15} "
              f"{c['entries_per_log_ended']:>14.1f} {c['terminal_round_ms_p50']:>13.2f} {c['replay_identical']!s:>12}")
    print(f"after the end: {report['ended_on_vs_off']}x the bytes of an uncompacted log -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
