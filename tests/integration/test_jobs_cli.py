"""`inflight jobs audit` and `inflight job show` against the real broker and Redis: a clean
run of jobs through a worker audits clean (exit 0); each defect kind the fault soak finds,
planted in the logs (an entry deleted, a second terminal, a terminal that differs from the
recorded outcome, an attempt going backwards, the first entries gone) or left by a job
nobody ran, is found and named (exit 1); `job show` tells one job's story."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import redis.asyncio as aioredis

from schemas import keys
from schemas.codec import encode
from schemas.params import SamplingParams
from schemas.pools import Pools
from schemas.replay import entry_of, expand
from schemas.wire import Finished, FinishReason, Token
from tests.integration.conftest import ROOT, worker_config
from tests.integration.helpers import recorded_outcomes, running_worker, slow_null_engine
from worker.cli import jobs
from worker.client import InflightClient
from worker.config import KafkaConfig


def cli(services, prefix, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "worker", *args, "--kafka", services[0], "--redis", services[1],
                           "--prefix", prefix], capture_output=True, text=True, cwd=ROOT, timeout=120)


async def _entries(r, job_id: str, prefix: str) -> list:
    return await r.xrange(keys.log_key(job_id, prefix))


async def _append(r, job_id: str, prefix: str, event) -> None:
    await r.xadd(keys.log_key(job_id, prefix), {"e": encode(event), "q": event.seq, "a": event.attempt})


def test_audit_is_clean_then_finds_every_planted_defect(services, prefix):
    cfg = worker_config(services, prefix)
    kafka = KafkaConfig(bootstrap_servers=services[0], topic_prefix=prefix)
    ids = [f"j{i}" for i in range(8)]

    async def main():
        out = {}
        async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            async with running_worker(cfg, slow_null_engine(0.002)):
                for job_id in ids:
                    await client.submit("audit me", params=SamplingParams(max_tokens=6, ignore_eos=True),
                                        job_id=job_id)
                found = await recorded_outcomes(client, ids)
                assert len(found) == len(ids)
                out["clean"] = await jobs.audit(client, kafka, Pools(), since_ms=None)
                out["clean_cli"] = cli(services, prefix, "jobs", "audit", "--since", "10m")
                out["show_cli"] = cli(services, prefix, "job", "show", "j0")
            # no worker now: a job nobody runs
            await client.submit("never run", job_id="lost")
            r = aioredis.from_url(services[1])
            try:
                # started, its tokens, finished: the tokens are one entry whether the log was
                # compacted (a run with sizes) or the publisher fell behind (one coalesced event)
                e = await _entries(r, "j1", prefix)
                assert len(e) == 3 and sum(len(ev.token_ids) for ev in expand(entry_of(e[1][1]))) == 6
                await r.xdel(keys.log_key("j1", prefix), e[1][0])  # seq_gap (and its text is short)
                rec = found["j2"]
                await _append(r, "j2", prefix, Finished(job_id="j2", seq=rec.seq + 1, attempt=rec.attempt,
                                                        finish_reason=rec.finish_reason, text=rec.text))
                e = await _entries(r, "j3", prefix)
                await r.xdel(keys.log_key("j3", prefix), e[-1][0])  # its terminal replaced by another one
                await _append(r, "j3", prefix, Finished(job_id="j3", seq=found["j3"].seq, attempt=1,
                                                        finish_reason=FinishReason.STOP, text=found["j3"].text))
                await _append(r, "j4", prefix, Token(job_id="j4", seq=found["j4"].seq + 1, attempt=0, text="",
                                                     token_ids=[1]))
                e = await _entries(r, "j5", prefix)
                await r.xdel(keys.log_key("j5", prefix), e[0][0], e[1][0])  # the first entries gone
            finally:
                await r.aclose()
            out["planted"] = await jobs.audit(client, kafka, Pools(), since_ms=None, pending_after_s=0.0)
            out["planted_cli"] = cli(services, prefix, "jobs", "audit", "--since", "10m", "--pending-after", "0",
                                     "--json")
            out["unknown_cli"] = cli(services, prefix, "job", "show", "nobody-knows-me", "--since", "10m")
        return out

    out = asyncio.run(main())
    clean = out["clean"]
    assert clean["jobs"] == 8 and clean["finished"] == 8 and clean["finish_reasons"] == {"length": 8}
    assert not any(clean["defects"].values()), clean["defects"]
    assert out["clean_cli"].returncode == 0 and "no defects" in out["clean_cli"].stdout, out["clean_cli"]
    show = out["show_cli"]
    assert show.returncode == 0, show.stderr
    assert "job j0" in show.stdout and "results topic: length" in show.stdout and "no defects" in show.stdout
    assert "token" in show.stdout and "started" in show.stdout and "dead letters: none" in show.stdout
    d = out["planted"]["defects"]
    assert "j1" in d["seq_gap"] and "j2" in d["terminals_not_1"] and "j3" in d["log_vs_results"]
    assert "j4" in d["attempt_backwards"] and "j5" in d["log_mid_way"] and "lost" in d["missing_outcome"]
    assert not any(j in ids[6:] for v in d.values() for j in v)  # untouched jobs stay clean
    planted = out["planted_cli"]
    assert planted.returncode == 1 and json.loads(planted.stdout)["defects"] == d
    assert out["unknown_cli"].returncode == 1 and "not found" in out["unknown_cli"].stdout
