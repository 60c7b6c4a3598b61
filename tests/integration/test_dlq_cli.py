"""`inflight dlq list` / `inflight dlq replay` against the real broker (issue 32): dead
letters listed with their reasons and filtered; a record rejected by one fleet
(`prompt_too_long` under a small limit) replayed to a fleet that can run it, once even
when replayed twice; a record whose reason can never succeed refused unless forced."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from aiokafka import AIOKafkaProducer

from schemas import keys
from schemas.params import SamplingParams
from schemas.wire import Finished, Started
from tests.integration.conftest import ROOT, worker_config
from tests.integration.helpers import (
    assert_well_formed,
    collect,
    committed_reaches_end,
    read_whole_log,
    running_worker,
)
from worker.cli.dlq import read_dead_letters, replay_dead_letters, replay_job_id
from worker.client import InflightClient
from worker.engine import Engine

LONG_PROMPT = "a prompt that is certainly longer than eight tokens once it is tokenized by any tokenizer"


def test_dead_letters_listed_and_replayed_once_through_kafka(services, prefix, llama_path):
    strict = worker_config(services, prefix, tuning={"max_input_tokens": 8})
    relaxed = worker_config(services, prefix)

    async def main():
        out = {}
        producer = AIOKafkaProducer(bootstrap_servers=services[0])
        await producer.start()
        await producer.send_and_wait(keys.job_topic(prefix, "high"), b"not json at all", key=b"bytes-1")
        await producer.stop()
        async with InflightClient(services[0], services[1], topic_prefix=prefix, key_prefix=prefix) as client:
            async with running_worker(strict, Engine.from_pretrained(str(llama_path), strict.engine)):
                await client.submit(LONG_PROMPT, params=SamplingParams(max_tokens=4, temperature=0), job_id="long-1")
                out["first"] = await collect(client, "long-1", 60)
                out["bytes"] = await collect(client, "bytes-1", 60)
                await committed_reaches_end(services[0], strict.kafka.group_id, prefix)
            letters = await read_dead_letters(relaxed.kafka)
            out["letters"] = letters
            out["only_long"] = await read_dead_letters(relaxed.kafka, reasons={"prompt_too_long"})
            out["cli"] = subprocess.run([sys.executable, "-m", "worker", "dlq", "list", "--kafka", services[0],
                                         "--prefix", prefix, "--json"], cwd=ROOT, capture_output=True, text=True,
                                        timeout=60)
            out["dry"] = await replay_dead_letters(relaxed.kafka, letters, dry_run=True)
            async with running_worker(relaxed, Engine.from_pretrained(str(llama_path), relaxed.engine)):
                out["replayed"] = await replay_dead_letters(relaxed.kafka, letters)
                new_id = replay_job_id("long-1", out["only_long"][0].partition, out["only_long"][0].offset)
                out["run"] = await collect(client, new_id, 60)
                out["again"] = await replay_dead_letters(relaxed.kafka, out["only_long"])  # the same dead letter
                out["forced"] = await replay_dead_letters(
                    relaxed.kafka, [d for d in letters if d.reason == "invalid_job"], force=True)
                await committed_reaches_end(services[0], relaxed.kafka.group_id, prefix)
                out["log"] = await read_whole_log(services[1], prefix, new_id)
            out["after"] = await read_dead_letters(relaxed.kafka)
        out["new_id"] = new_id
        return out

    out = asyncio.run(main())
    first = assert_well_formed(out["first"], "long-1")
    assert first.finish_reason == "rejected" and first.error.code == "prompt_too_long"
    assert assert_well_formed(out["bytes"], "bytes-1").error.code == "invalid_job"
    by_reason = {d.reason: d for d in out["letters"]}
    assert sorted(by_reason) == ["invalid_job", "prompt_too_long"] and len(out["letters"]) == 2
    assert by_reason["prompt_too_long"].job_id == "long-1"
    assert by_reason["invalid_job"].source.startswith(f"{keys.job_topic(prefix, 'high')}:")
    assert [d.job_id for d in out["only_long"]] == ["long-1"]
    assert out["cli"].returncode == 0, out["cli"].stderr
    rows = [json.loads(line) for line in out["cli"].stdout.splitlines()]
    assert sorted(r["reason"] for r in rows) == ["invalid_job", "prompt_too_long"]
    assert "2 dead letter(s): invalid_job 1, prompt_too_long 1" in out["cli"].stderr
    dry = {r.dead_letter.reason: r for r in out["dry"]}
    assert dry["prompt_too_long"].status == "would send" and dry["invalid_job"].status == "refused"
    assert "can never succeed" in dry["invalid_job"].why
    replayed = {r.dead_letter.reason: r for r in out["replayed"]}
    assert replayed["prompt_too_long"].status == "sent" and replayed["invalid_job"].status == "refused"
    assert replayed["prompt_too_long"].job_id == out["new_id"] == f"long-1.replay-{by_reason['prompt_too_long'].partition}-{by_reason['prompt_too_long'].offset}"
    assert replayed["prompt_too_long"].topic == keys.job_topic(prefix, "normal")  # its original priority
    run = assert_well_formed(out["run"], out["new_id"])
    assert run.finish_reason in ("stop", "length") and run.usage.completion_tokens >= 1
    assert [r.status for r in out["again"]] == ["sent"]
    # replayed twice, run once: one started and one finished in the job's whole log
    log = out["log"]
    assert sum(isinstance(e, Started) for e in log) == 1 and sum(isinstance(e, Finished) for e in log) == 1
    assert [r.status for r in out["forced"]] == ["sent"]  # forced: the bytes go back untouched ...
    assert sorted(d.reason for d in out["after"]) == ["invalid_job", "invalid_job", "prompt_too_long"]  # ... and
    # dead-letter again; the replayed job ran and added nothing
