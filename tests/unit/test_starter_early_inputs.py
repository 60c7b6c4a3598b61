"""The job starter tokenizes a small batch's prompts while the batch's claim is in flight
(`worker.serve.starter`, `EARLY_INPUT_RECORDS`): the claim's round trip and the
tokenizer's work overlap, the engine gets the same request as without it, and a record
whose claim is refused is not opened whatever was tokenized for it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from aiokafka.structs import TopicPartition

from schemas.params import SamplingParams
from schemas.wire import Job
from worker.engine.inputs import TextPrompt, TokenPrompt
from worker.serve.claims import CONTESTED, Claimed, Done
from worker.serve.jobs import JobState, JobTable
from worker.serve.read_ahead import JobRecord
from worker.serve.starter import EARLY_INPUT_RECORDS, JobStarter


class Claims:
    """A claim store whose `take` answers after a round trip, noting when it went out and
    when it answered in `log`."""

    def __init__(self, log: list, results) -> None:
        self.log, self.results = log, results

    async def take(self, refs):
        self.log.append("claim sent")
        await asyncio.sleep(0.005)
        self.log.append("claim answered")
        return [self.results(r.job_id) for r in refs]


class Input:
    """The engine's input processor: `tokenize` noted in `log`, `process` kept."""

    def __init__(self, log: list) -> None:
        self.log, self.processed = log, []

    def tokenize(self, request_id, prompt):
        self.log.append(("tokenize", request_id))
        return [7, 8, len(prompt.text)]

    def process(self, inp):
        self.processed.append(inp)
        ids = inp.prompt.token_ids if isinstance(inp.prompt, TokenPrompt) else self.tokenize(inp.request_id, inp.prompt)
        return SimpleNamespace(request_id=inp.request_id, prompt_token_ids=ids, max_tokens=4,
                               options=SimpleNamespace(adapter=None), params=inp.params)


def starter_for(results) -> tuple[JobStarter, list, Input, list]:
    log: list = []
    inp = Input(log)
    submitted: list = []
    engine = SimpleNamespace(tuning=SimpleNamespace(max_input_tokens=None), tokenizer=None, input=inp,
                             submit=submitted.append, abort=lambda rid: None)
    host = SimpleNamespace(wake=lambda: None, intake_paused=lambda: False)
    cancels = SimpleNamespace(is_cancelled=lambda job_id: False)
    starter = JobStarter(JobTable("w1"), Claims(log, results), engine, SimpleNamespace(), SimpleNamespace(), host,
                         cancels, max_local_jobs=16, max_job_failures=2)
    return starter, log, inp, submitted


def records(n: int, **job) -> list[JobRecord]:
    return [JobRecord(Job(job_id=f"j{i}", prompt=f"hello {i}", params=SamplingParams(max_tokens=4), **job),
                      "normal", TopicPartition("jobs.normal", 0), i, 100.0, None, None) for i in range(n)]


def claimed(job_id: str) -> Claimed:
    return Claimed("tok", 1, 0, 0, False)


def test_a_small_batch_tokenizes_while_its_claim_is_in_flight_and_submits_the_same_ids():
    starter, log, inp, submitted = starter_for(claimed)
    assert asyncio.run(starter.take(records(2))) == []
    assert log == ["claim sent", ("tokenize", "j0"), ("tokenize", "j1"), "claim answered"]  # once each
    assert [r.prompt_token_ids for r in submitted] == [[7, 8, 7], [7, 8, 7]]
    assert all(isinstance(i.prompt, TokenPrompt) for i in inp.processed)
    assert [j.state for j in starter.table] == [JobState.IN_ENGINE] * 2


def test_a_record_whose_claim_is_refused_is_not_opened_whatever_was_tokenized():
    answers = {"j0": CONTESTED, "j1": Done("stop"), "j2": None}
    starter, log, inp, submitted = starter_for(lambda job_id: answers[job_id] or claimed(job_id))
    starter.finalizer = SimpleNamespace(settle=lambda *a: None)
    contested = asyncio.run(starter.take(records(3)))
    assert [r.job.job_id for r in contested] == ["j0"]
    assert [r.request_id for r in submitted] == ["j2"] and [j.job_id for j in starter.table] == ["j2"]
    assert log.count("claim sent") == 1 and log.index("claim answered") == len(log) - 1


def test_a_larger_batch_tokenizes_only_the_jobs_it_claimed_after_the_claim():
    n = EARLY_INPUT_RECORDS + 1
    starter, log, inp, submitted = starter_for(lambda job_id: CONTESTED if job_id == "j0" else claimed(job_id))
    asyncio.run(starter.take(records(n)))
    assert log[:2] == ["claim sent", "claim answered"]
    assert log[2:] == [("tokenize", f"j{i}") for i in range(1, n)]
    assert all(isinstance(i.prompt, TextPrompt) for i in inp.processed) and len(submitted) == n - 1
