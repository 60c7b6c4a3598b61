"""Speculative decoding through the real engine (tiny random-init Llama, fp32, CPU): a
sampled request's tokens are the ones it samples without speculation (seeded: the same
ids, penalties, logit bias and logprobs included, alone or inside a full batch; unseeded:
the same distribution, by a chi-square test), whatever the drafts. The greedy cases with
chunked prefill, preemption, prefix-cache hits, tenants and the compiled forward are in
test_equivalence.py (its `-ngram` cases)."""

from __future__ import annotations

import collections

import pytest
import torch

from schemas.params import SamplingParams
from worker.config import EngineConfig, ModelConfig, ServingTuning, SpeculativeConfig
from worker.engine import Engine

# a prompt that repeats itself, so prompt lookup proposes from the first step on
PROMPT = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7]


def make_engine(path, method: str) -> Engine:
    spec = SpeculativeConfig(method=method, num_speculative_tokens=3, prompt_lookup_min=1, min_speedup=None,
                             disable_by_batch_size=None, min_accepted_tokens=0.0)
    cfg = EngineConfig(model=ModelConfig(dtype="float32", device="cpu"),
                       serving_tuning=ServingTuning(max_total_tokens=4096, max_batched_tokens=256,
                                                    max_running_requests=16, speculative=spec))
    return Engine.from_pretrained(str(path), cfg)


@pytest.fixture(scope="module")
def engines(llama_path) -> dict[str, Engine]:
    return {m: make_engine(llama_path, m) for m in ("off", "ngram")}


def force_drafts(engine: Engine, drafts: list[list[int]]) -> None:
    """Propose, for the i-th request of the next `generate`, the next tokens of `drafts[i]`
    after its output so far (the guesses need not be good: verification must keep the
    tokens exact anyway)."""
    def propose(req, step, max_new):
        guess = drafts[int(req.request_id.rsplit("-", 1)[1])][req.num_output_tokens:]
        guess = guess[: min(3, max_new, req.max_tokens - req.num_output_tokens - 1)]
        if req.grammar is not None:  # as the real proposer: up to the first guess the grammar refuses
            guess = guess[: req.grammar.raw.validate_tokens(guess)]
        return guess

    engine.scheduler.speculation.propose = propose


PARAMS = [
    SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=12, repetition_penalty=1.3, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.7, seed=13, presence_penalty=0.8, frequency_penalty=0.4, logit_bias={6: 2.0},
                   logprobs=2, max_tokens=22, ignore_eos=True),
    SamplingParams(temperature=0, repetition_penalty=1.5, logprobs=1, max_tokens=18, ignore_eos=True),
]


def test_seeded_requests_sample_the_same_ids_alone_and_in_a_full_batch(engines):
    prompts = [PROMPT, PROMPT[2:], PROMPT[1:] + [9], PROMPT[:12]]
    plain = engines["off"].generate(prompts, PARAMS)
    spec_engine = engines["ngram"]
    before = spec_engine.scheduler.speculation.stats.num_drafts
    alone = [spec_engine.generate([p], [sp])[0] for p, sp in zip(prompts, PARAMS)]
    filler = [[(7 * i + j) % 400 + 1 for j in range(4 + 5 * i)] for i in range(10)]
    busy = spec_engine.generate(prompts + filler, PARAMS + [SamplingParams(temperature=1.0, max_tokens=12)] * 10)
    assert spec_engine.scheduler.speculation.stats.num_drafts > before
    for a, b, c in zip(plain, alone, busy):
        assert a.token_ids == b.token_ids == c.token_ids
        assert (a.logprobs is None) == (b.logprobs is None)
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            assert x.token_id == y.token_id and x.top_token_ids == y.top_token_ids
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


def test_forced_drafts_keep_seeded_ids_whatever_the_guesses(engines):
    """Good guesses (the request's own ids), bad ones, and half good: the same ids."""
    plain = engines["off"].generate([PROMPT] * 4, PARAMS)
    truth = [o.token_ids for o in plain]
    spec_engine = engines["ngram"]
    stats = spec_engine.scheduler.speculation.stats
    real_propose = spec_engine.scheduler.speculation.propose
    try:
        for name, guess in (("good", lambda t: t), ("bad", lambda t: [(x + 1) % 300 for x in t]),
                            ("half", lambda t: [x if i % 2 == 0 else 3 for i, x in enumerate(t)])):
            accepted, proposed = stats.num_accepted_tokens, stats.num_draft_tokens
            force_drafts(spec_engine, [guess(t) for t in truth])
            got = spec_engine.generate([PROMPT] * 4, PARAMS)
            assert [o.token_ids for o in got] == truth, name
            kept = stats.num_accepted_tokens - accepted
            assert (kept == stats.num_draft_tokens - proposed) if name == "good" else kept < stats.num_draft_tokens - proposed
    finally:
        spec_engine.scheduler.speculation.propose = real_propose


def chi_square_p(a: collections.Counter, b: collections.Counter) -> float:
    """p-value of the chi-square test that two samples come from one distribution
    (cells with fewer than 5 expected observations pooled into one)."""
    na, nb = sum(a.values()), sum(b.values())
    cells = sorted(set(a) | set(b), key=lambda c: -(a[c] + b[c]))
    big = [c for c in cells if (a[c] + b[c]) * min(na, nb) / (na + nb) >= 5]
    rows = [(a[c], b[c]) for c in big] + [(sum(a[c] for c in cells if c not in big),
                                           sum(b[c] for c in cells if c not in big))]
    rows = [r for r in rows if sum(r)]
    stat = 0.0
    for x, y in rows:
        for obs, n in ((x, na), (y, nb)):
            expected = (x + y) * n / (na + nb)
            stat += (obs - expected) ** 2 / expected
    dof = len(rows) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


def test_unseeded_sampling_has_the_distribution_of_plain_decoding(engines):
    """600 unseeded samples of a 4-token continuation each way, drafts forced to the greedy
    continuation (accepted often, not always); the joint distribution of the last three
    tokens (the verified positions) compared by a chi-square test at a 0.1% false-alarm
    rate (the global RNG seeded: the run is reproducible)."""
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True)
    greedy = engines["off"].generate([PROMPT], SamplingParams(temperature=0, max_tokens=4))[0].token_ids
    n = 600
    torch.manual_seed(0)
    plain = engines["off"].generate([PROMPT] * n, params)
    spec_engine = engines["ngram"]
    real_propose = spec_engine.scheduler.speculation.propose
    stats = spec_engine.scheduler.speculation.stats
    accepted, proposed = stats.num_accepted_tokens, stats.num_draft_tokens
    try:
        force_drafts(spec_engine, [greedy] * n)
        spec = spec_engine.generate([PROMPT] * n, params)
    finally:
        spec_engine.scheduler.speculation.propose = real_propose
    kept, guessed = stats.num_accepted_tokens - accepted, stats.num_draft_tokens - proposed
    assert 0.05 * guessed < kept < 0.95 * guessed, (kept, guessed)  # both paths ran often
    a = collections.Counter(tuple(o.token_ids[1:]) for o in plain)
    b = collections.Counter(tuple(o.token_ids[1:]) for o in spec)
    assert chi_square_p(a, b) > 0.001, (a.most_common(8), b.most_common(8))


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 6}},
          "required": ["name", "tags"], "additionalProperties": False}


def test_constrained_requests_verify_every_position_under_their_grammar(engines):
    """Structured outputs speculate: guesses cut where the grammar refuses them, each
    verified position masked by the grammar past the guesses before it, the grammar
    advanced by kept tokens only. Greedy and seeded ids equal plain decoding's, whatever
    the guesses, and every output validates."""
    import json

    import jsonschema

    from schemas.params import JsonSchemaOutput

    params = [SamplingParams(max_tokens=80, temperature=0.0, structured=JsonSchemaOutput(schema=SCHEMA)),
              SamplingParams(max_tokens=80, temperature=1.0, seed=4, structured=JsonSchemaOutput(schema=SCHEMA))]
    prompts = [PROMPT, PROMPT[3:]]
    truth = [o.token_ids for o in engines["off"].generate(prompts, params)]
    spec_engine = engines["ngram"]
    stats = spec_engine.scheduler.speculation.stats
    real_propose = spec_engine.scheduler.speculation.propose
    try:
        for name, guess in (("lookup", None), ("good", lambda t: t), ("bad", lambda t: [(x + 1) % 300 for x in t]),
                            ("half", lambda t: [x if i % 2 == 0 else 3 for i, x in enumerate(t)])):
            if guess is None:
                spec_engine.scheduler.speculation.propose = real_propose
            else:
                force_drafts(spec_engine, [guess(t) for t in truth])
            kept = stats.num_accepted_tokens
            outs = spec_engine.generate(prompts, params)
            assert [o.token_ids for o in outs] == truth, name
            for o in outs:
                assert o.finish_reason == "stop", (name, o.text)
                jsonschema.validate(json.loads(o.text), SCHEMA)
            if name == "good":
                assert stats.num_accepted_tokens - kept >= sum(len(t) for t in truth) // 2
    finally:
        spec_engine.scheduler.speculation.propose = real_propose
