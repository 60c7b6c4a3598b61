"""Sampling through the real engine: seeds, sampler filters, logprobs, text and chat prompts."""

from __future__ import annotations

import math
import time

import pytest
import torch

from schemas.params import SamplingParams
from worker.config import EngineConfig, ModelConfig, ServingTuning
from worker.engine import Engine
from worker.engine.outputs import ScheduledRequest
from worker.model.sampler import sample


@pytest.fixture(scope="module")
def engine(llama_path):
    cfg = EngineConfig(
        model=ModelConfig(dtype="float32", device="cpu"),
        serving_tuning=ServingTuning(max_total_tokens=4096, max_batched_tokens=128, max_running_requests=16),
    )
    return Engine.from_pretrained(str(llama_path), cfg)


def test_seeded_sampling_same_alone_and_in_busy_batch(engine):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=40, ignore_eos=True)
    alone = engine.generate([[5, 6, 7, 8]], params)[0].token_ids
    busy_prompts = [[5, 6, 7, 8]] + [[(11 * i + j) % 500 + 1 for j in range(3 + 7 * i)] for i in range(10)]
    busy_params = [params] + [SamplingParams(temperature=1.0, max_tokens=10 + 5 * i) for i in range(10)]
    busy = engine.generate(busy_prompts, busy_params)[0].token_ids
    assert alone == busy
    other_seed = engine.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.9, seed=99, max_tokens=40, ignore_eos=True))
    assert other_seed[0].token_ids != alone  # the seed matters


def test_asynchronous_steps_sample_what_sequential_steps_sample(llama_path):
    """Steps scheduled one ahead feed each decode the token sampled the step before
    (placeholders): seeded draws, a repetition penalty over the whole history (the token
    in flight included) and logprobs come out as sequentially."""
    prompts = [[(13 * i + j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(8)]
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, repetition_penalty=1.8, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, seed=3, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=0, logprobs=2, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=0.5, logit_bias={7: 3.0},
                       max_tokens=24, ignore_eos=True),
    ] * 2
    outs = {}
    for mode in (False, True):
        cfg = EngineConfig(model=ModelConfig(dtype="float32", device="cpu"),
                           serving_tuning=ServingTuning(max_total_tokens=4096, max_batched_tokens=64,
                                                        max_running_requests=6, async_scheduling=mode))
        eng = Engine.from_pretrained(str(llama_path), cfg)
        real_update = eng.scheduler.update_from_output

        def late_update(*args, real_update=real_update):  # the step behind samples before this one is applied
            time.sleep(0.01)
            return real_update(*args)

        eng.scheduler.update_from_output = late_update
        outs[mode] = eng.generate(prompts, params)
    for seq, asy in zip(outs[False], outs[True]):
        assert asy.token_ids == seq.token_ids
        assert (asy.logprobs is None) == (seq.logprobs is None)
        for a, b in zip(asy.logprobs or [], seq.logprobs or []):
            assert a.top_token_ids == b.top_token_ids and a.logprob == pytest.approx(b.logprob, abs=1e-5)
    penalized = outs[True][1].token_ids
    assert len(set(penalized)) > len(penalized) // 2  # the penalty bites (greedy alone repeats)


def test_text_prompt_chat_messages_and_logprobs(engine):
    out = engine.generate(["The module provides"], SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0]
    assert out.prompt_token_ids == engine.tokenizer.encode("The module provides")
    assert len(out.logprobs) == len(out.token_ids)
    for lp, tok in zip(out.logprobs, out.token_ids):
        assert lp.token_id == tok
        assert lp.top_token_ids[0] == tok  # greedy picks the most likely token
        assert lp.logprob == pytest.approx(lp.top_logprobs[0])
        assert lp.logprob <= 0.0
    engine.add_request("chat", messages=[{"role": "user", "content": "hi"}], params=SamplingParams(max_tokens=3))
    expected = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert outs[-1].usage.prompt_tokens == len(expected)


def sr(params, history=(1,), generator=None, num_prompt_tokens=0):
    return ScheduledRequest("x", [1], 0, [0], True, params, list(history), generator,
                            num_prompt_tokens=num_prompt_tokens)


def test_presence_frequency_and_logit_bias_follow_openais_formula():
    logits = torch.tensor([[4.0, 3.5, 3.0, 1.0]])
    # output so far [0, 0, 1] (the prompt [2] is never penalized): token 0 seen twice, 1 once
    history, prompt_len = [2, 0, 0, 1], 1

    def greedy(**kw):
        return sample(logits, [sr(SamplingParams(temperature=0, **kw), history, num_prompt_tokens=prompt_len)])[0][0]

    assert greedy() == 0
    assert greedy(presence_penalty=0.6) == 0  # 3.4, 2.9, 3.0: once per token seen
    assert greedy(presence_penalty=1.2) == 2  # 2.8, 2.3, 3.0: token 2 (in the prompt only) is not penalized
    assert greedy(frequency_penalty=0.3) == 0  # 4 - 2 x .3 = 3.4, 3.5 - .3 = 3.2
    assert greedy(frequency_penalty=0.6) == 2  # 2.8, 2.9, 3.0: per occurrence
    assert greedy(presence_penalty=-1.0) == 0 and greedy(logit_bias={3: 3.5}) == 3  # 1 + 3.5 = 4.5
    assert greedy(logit_bias={0: -100, 1: -100}) == 2
    # the sampled distribution is softmax of the adjusted logits
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, presence_penalty=1.0, frequency_penalty=0.5, logit_bias={3: 2.0})
    counts = [0, 0, 0, 0]
    for _ in range(4000):
        counts[sample(logits, [sr(params, history, gen, prompt_len)])[0][0]] += 1
    adjusted = torch.tensor([4.0 - 1.0 - 1.0, 3.5 - 1.0 - 0.5, 3.0, 1.0 + 2.0])
    assert [c / 4000 for c in counts] == pytest.approx(torch.softmax(adjusted, 0).tolist(), abs=0.03)


def test_penalties_equal_a_reference_greedy_loop(engine, llama_path):
    """Greedy decoding with presence / frequency penalties and a logit bias through the
    engine equals a plain loop over transformers' full forward applying OpenAI's formula."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llama_path), dtype=torch.float32).eval()
    prompt = [5, 9, 5, 9, 5, 9, 31, 7]
    kw = dict(presence_penalty=0.8, frequency_penalty=0.4, logit_bias={11: 1.5, 12: -100})
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **kw))[0]
    ids, output = list(prompt), []
    with torch.inference_mode():
        for _ in range(24):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            logits[11] += 1.5
            logits[12] -= 100
            counts = torch.bincount(torch.tensor(output or [0], dtype=torch.long), minlength=logits.numel()).float()
            if not output:
                counts.zero_()
            logits = logits - 0.4 * counts - 0.8 * (counts > 0).float()
            tok = int(logits.argmax())
            ids.append(tok)
            output.append(tok)
    assert out.token_ids == output
    assert 12 not in out.token_ids


def test_logit_bias_outside_the_vocabulary_is_rejected(engine):
    from worker.engine import RequestRejected

    with pytest.raises(RequestRejected, match="logit_bias names token ids outside the vocabulary"):
        engine.add_request("bias-oov", prompt_token_ids=[5, 6], params=SamplingParams(logit_bias={10**7: 1.0}))


def test_sampler_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 4)
    g = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    draws = {
        "top_k": [sample(logits[:1], [sr(SamplingParams(temperature=5.0, top_k=2), generator=g(s))])[0][0] for s in range(200)],
        "top_p": [sample(logits[:1], [sr(SamplingParams(temperature=1.0, top_p=0.7), generator=g(s))])[0][0] for s in range(200)],
        "min_p": [sample(logits[:1], [sr(SamplingParams(temperature=1.0, min_p=0.3), generator=g(s))])[0][0] for s in range(200)],
    }
    assert set(draws["top_k"]) == {0, 1}
    # softmax([4,3,2,1,0]) = .636 .234 .086 ...: mass before token 1 is .636 < .7, before token 2 is .87 >= .7
    assert set(draws["top_p"]) == {0, 1}
    assert set(draws["min_p"]) == {0, 1}  # p1/p0 = e^-1 = .37 >= .3; p2/p0 = .135 < .3
    # greedy ignores filters and takes argmax; repetition penalty pushes a seen token down
    greedy = sample(logits[:1], [sr(SamplingParams(temperature=0))])[0]
    assert greedy == [0]
    penalized = sample(logits[:1], [sr(SamplingParams(temperature=0, repetition_penalty=2.0), history=[0])])[0]
    assert penalized == [1]  # 4/2 = 2 < 3


def test_sampler_distribution_matches_softmax():
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]])
    gen = torch.Generator().manual_seed(0)
    counts = [0, 0, 0]
    for _ in range(3000):
        counts[sample(logits, [sr(SamplingParams(temperature=1.0), generator=gen)])[0][0]] += 1
    freqs = [c / 3000 for c in counts]
    assert freqs == pytest.approx([0.5, 0.3, 0.2], abs=0.04)
