"""Output processing of engine-core outputs that merge several steps (what the worker's
reader thread gets when it falls behind): the same text, ids and usage as one step at a
time, stop strings cut at the token that completes them, EOS never in the text."""

from __future__ import annotations

from schemas.wire import FinishReason
from worker.engine import EngineCoreOutput, OutputProcessor
from worker.engine.request import RequestStatus
from worker.model.null_runner import LetterTokenizer

# LetterTokenizer: id i decodes to chr(97 + i % 26)
H, E, L, O, W, R, D = 7, 4, 11, 14, 22, 17, 3  # noqa: E741


def run(chunks: list[list[int]], stop: list[str], last_reason: FinishReason | None = FinishReason.LENGTH):
    p = OutputProcessor(LetterTokenizer())
    p.add("r", stop, num_prompt_tokens=3, arrival_time=0.0)
    outs, finishes = [], []
    for i, ids in enumerate(chunks):
        reason = last_reason if i == len(chunks) - 1 else None
        got = p.process([EngineCoreOutput("r", ids, finish_reason=reason)])
        outs += got.outputs
        finishes += got.finish
    return outs, finishes


def test_merged_steps_give_the_text_of_single_steps():
    word = [H, E, L, L, O, W, O, R, L, D]
    single, _ = run([[t] for t in word], [])
    merged, _ = run([word[:3], word[3:4], word[4:]], [])
    text = lambda outs: "".join(o.text for o in outs)  # noqa: E731
    assert text(single) == text(merged) == "helloworld"
    assert single[-1].usage.completion_tokens == merged[-1].usage.completion_tokens == 10


def test_stop_string_inside_a_merged_chunk_cuts_ids_and_usage_there():
    outs, finishes = run([[H, E], [L, L, O, W, O, R]], ["llo"], last_reason=None)
    final = outs[-1]
    assert final.finished and final.finish_reason == FinishReason.STOP
    assert "".join(o.text for o in outs) == "he"
    assert [t for o in outs for t in o.new_token_ids] == [H, E, L, L, O]  # nothing after the stop
    assert final.usage.completion_tokens == 5
    assert finishes == [("r", RequestStatus.FINISHED_STOPPED)]


def test_eos_ending_a_merged_chunk_is_not_text():
    outs, finishes = run([[H, E, L, 0]], [], last_reason=FinishReason.STOP)
    assert outs[-1].text == "hel" and outs[-1].new_token_ids == [H, E, L, 0]
    assert outs[-1].usage.completion_tokens == 4 and finishes == []


def test_several_steps_in_one_call_are_merged_per_request():
    """A batch of three steps' outputs for two requests (what the reader gets when it fell
    behind): one delta per request, the same text, ids, usage and stop as step by step."""
    steps = [
        [EngineCoreOutput("a", [H]), EngineCoreOutput("b", [W])],
        [EngineCoreOutput("a", [E]), EngineCoreOutput("b", [O])],
        [EngineCoreOutput("b", [R]), EngineCoreOutput("a", [L], finish_reason=FinishReason.LENGTH)],
    ]

    def processor():
        p = OutputProcessor(LetterTokenizer())
        p.add("a", [], num_prompt_tokens=2, arrival_time=0.0)
        p.add("b", ["or"], num_prompt_tokens=2, arrival_time=0.0)
        return p

    one_by_one = processor()
    single = [o for step in steps for o in one_by_one.process(step).outputs]
    batched = processor().process([o for step in steps for o in step])
    assert [o.request_id for o in batched.outputs] == ["a", "b"]  # one delta each
    for rid in ("a", "b"):
        mine = [o for o in single if o.request_id == rid]
        got = next(o for o in batched.outputs if o.request_id == rid)
        assert got.text == "".join(o.text for o in mine)
        assert got.new_token_ids == [t for o in mine for t in o.new_token_ids]
        assert (got.finished, got.finish_reason, got.usage) == (mine[-1].finished, mine[-1].finish_reason,
                                                                mine[-1].usage)
    assert batched.finish == [("b", RequestStatus.FINISHED_STOPPED)]  # "or" completed by its third token
