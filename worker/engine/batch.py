"""A step's batch: built from the scheduler's decisions, applied back once its forward
succeeded, or taken back when it will not be (a failure; asynchronous steps: `forward.py`).

These functions belong to the Scheduler, the only caller: they write request progress
and token lists, the state it is the only writer of. Progress of one request, a chunk of
c tokens at positions [p, p + c) in step N:

    built      num_computed_tokens = p + c; num_in_flight_steps += 1; if the chunk
               reaches the end of the request's tokens (those known plus those owed by
               steps in flight), it samples one: num_output_placeholders += 1
    applied    num_in_flight_steps -= 1; the sampled token appended (placeholders -= 1);
               the blocks full below p + c published to the prefix cache
    taken back num_in_flight_steps -= 1 (placeholders too); num_computed_tokens = p

A decode built while the step before it is in flight reads the token that step samples:
its input is `PLACEHOLDER_TOKEN`, resolved by the runner (or by `resolve_placeholders`
once that step was applied).

A speculating decode (speculative.py) is a chunk of 1 + k tokens, its last token and its
draft: built, it counts as computed up to its draft's end; applied, its progress rolls
back to the tokens the verification kept (the KV of rejected guesses is never read).

A persistent batch (as vLLM V1's input batch): a request's `ScheduledRequest` is made once
per step parity and updated in place by the step two after, instead of built anew each
step. That is safe because at most two steps are out at once (the one running and the
one launched behind it) and a step is applied before the one two after it is built; a
runner must not keep a step's `ScheduledRequest`s past the step (`replace` them to keep).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from worker.engine.kv_cache import KVCacheManager
from worker.engine.outputs import (
    NO_DRAFT,
    PLACEHOLDER_INPUT,
    PLACEHOLDER_TOKEN,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from worker.engine.request import Request, RequestStatus
from worker.engine.speculative import Speculation


def mark_scheduled(req: Request, end: int, samples_token: bool) -> None:
    req.num_computed_tokens = end
    req.num_in_flight_steps += 1
    if samples_token:
        req.num_output_placeholders += 1


def build_batch(step: int, scheduled: dict[str, int], requests: dict[str, Request],
                block_table: Callable[[str], list[int]], copy_tables: bool,
                resident: dict[str, Any] | None = None, drafts: dict[str, list[int]] | None = None) -> SchedulerOutput:
    """Step `step`'s batch from `scheduled` (request id -> tokens), decodes first; each
    request's progress advances to the end of its chunk. `drafts`: the guesses of the
    speculating decodes (request id -> d_1..d_k; their chunk is the last token and the
    draft, placed after the decodes). `copy_tables`: give the runner
    copies of the block tables (steps run ahead and the KV manager changes tables in place:
    a sliding window freeing behind must not reach a step already launched; appends
    may, the step reads only its context's blocks).
    `resident`: the LoRA adapters resident (name -> `ResidentAdapter`); those of the
    scheduled requests go with the step, for the runner to fill their slots first."""
    decodes: list[ScheduledRequest] = []
    prefills: list[ScheduledRequest] = []
    decode_reqs: list[Request] = []
    prefill_reqs: list[Request] = []
    loras: dict[int, Any] = {}
    num_spec_tokens = 0
    num_tokens = 0
    for request_id, num_new in scheduled.items():
        req = requests[request_id]
        start = req.num_computed_tokens
        end = start + num_new
        num_tokens += num_new
        tokens = req.all_token_ids
        num_known = len(tokens)
        draft = drafts.get(request_id) if drafts else None
        if draft:  # the last token, then the guesses (the scheduler sized num_new to 1 + k)
            ids = tokens[start:num_known] + draft
            samples = True
            num_spec_tokens += num_new
        else:
            draft = NO_DRAFT
            if end <= num_known:
                ids = tokens[start:end]
            elif start == num_known and num_new == 1:  # a decode behind the step that samples its input
                ids = PLACEHOLDER_INPUT
            else:
                ids = tokens[start:num_known] + [PLACEHOLDER_TOKEN] * (end - num_known)
            samples = end == num_known + req.num_output_placeholders
        table = block_table(request_id)
        if copy_tables:
            table = table[:]
        s = step_input(req, step, ids, start, table, samples, draft)
        if req.lora_slot >= 0:
            loras[req.lora_slot] = resident[req.adapter]
        req.num_computed_tokens = end  # mark_scheduled, inlined: this loop runs for every request every step
        req.num_in_flight_steps += 1
        if samples:
            req.num_output_placeholders += 1
        if num_new == 1 and start > 0:
            decodes.append(s)
            decode_reqs.append(req)
        else:
            prefills.append(s)
            prefill_reqs.append(req)
    return SchedulerOutput(
        step=step,
        scheduled=decodes + prefills if prefills else decodes,
        num_scheduled_tokens=num_tokens,
        num_decodes=len(decodes),
        requests=decode_reqs + prefill_reqs if prefill_reqs else decode_reqs,
        loras=loras,
        num_spec_tokens=num_spec_tokens,
    )


def step_input(req: Request, step: int, ids: Sequence[int], start: int, table: list[int], samples: bool,
               draft: Sequence[int]) -> ScheduledRequest:
    """`req`'s share of step `step`: its `ScheduledRequest` of two steps ago updated in
    place (that step was applied before this one was built; see the module docstring),
    or made on its first step of this parity."""
    pair = req.step_inputs
    if pair is None:
        pair = req.step_inputs = [None, None]
    s = pair[step & 1]
    if s is None:
        s = pair[step & 1] = ScheduledRequest(req.request_id, ids, start, table, samples, req.params,
                                              req.all_token_ids, req.generator, req.grammar, req.lora_slot,
                                              req.num_prompt_tokens, draft, state_slot=req.state_slot)
        return s
    s.token_ids = ids
    s.start_pos = start
    s.block_ids = table
    s.samples_token = samples
    s.all_token_ids = req.all_token_ids
    s.grammar = req.grammar
    s.lora_slot = req.lora_slot
    s.state_slot = req.state_slot
    s.draft = draft
    s.ahead = NO_DRAFT
    return s


def apply_batch(out: SchedulerOutput, runner_out: ModelRunnerOutput, kv: KVCacheManager, fair: bool,
                finish: Callable[[str, RequestStatus], object],
                speculation: Speculation | None = None) -> list[tuple[Request, int]]:
    """Apply a step whose forward succeeded: publish newly full blocks to the prefix
    cache, append sampled tokens, `finish` on EOS / stop token / length (in that
    precedence: a token that ends the request is its last, the tokens a verified draft
    kept after it are dropped). A request preempted since the step was built still gets its tokens
    (computed on its KV before the blocks were freed), and so does one the scheduler
    ended because that token is its last by length; one that ended otherwise meanwhile
    does not (they are dropped: never emitted, never counted). `fair`: charge each
    position sampled to its tenant's share. A speculating decode's progress rolls back to
    the tokens kept, and `speculation` records its acceptance. Returns the requests that
    got tokens, each with how many (the last ones of its `all_token_ids`)."""
    sampled = runner_out.sampled_token_ids
    cache_full_blocks = kv.cache_full_blocks
    bs = kv.block_size
    running = RequestStatus.RUNNING
    preempted = RequestStatus.PREEMPTED
    ended_early = RequestStatus.FINISHED_LENGTH  # only a request ended while its last token was in flight
    got_tokens = []
    append = got_tokens.append
    for s, req in zip(out.scheduled, out.requests):
        req.num_in_flight_steps -= 1
        samples = s.samples_token
        if samples:
            req.num_output_placeholders -= 1
        draft = s.draft
        status = req.status
        if status == running and not draft:
            start = s.start_pos
            done = start + len(s.token_ids)
            if done // bs != start // bs:  # a block just filled up: publish it to the prefix cache
                cache_full_blocks(req, done)
        elif status != running and status != preempted and status != ended_early:
            continue
        if not samples:
            continue
        new = sampled[s.request_id]
        if draft and speculation is not None:
            speculation.verified(req, len(draft), len(new) - 1, out.step)
        if fair:
            share = req.share
            share.counter += share.decode_cost * (1 + len(draft))  # a draft's positions count as decodes
        tokens = req.all_token_ids
        if len(new) == 1:  # one token: no draft, or one whose first guess was refused
            token_id = new[0]
            tokens.append(token_id)
            kept = 1
            if (req.grammar is None and token_id not in req.end_token_ids
                    and len(tokens) - req.num_prompt_tokens < req.max_tokens):
                end_status = None  # `stop_status`'s answer for an unconstrained request that goes on
            else:
                end_status = req.stop_status(token_id)
        else:
            end_status = None
            kept = 0
            for token_id in new:
                tokens.append(token_id)
                kept += 1
                end_status = req.stop_status(token_id)
                if end_status is not None:
                    break
        append((req, kept))
        if status == ended_early:  # its last token: EOS or a stop id still wins over length
            req.status = end_status or ended_early
            continue
        if draft and status == running:  # back to the tokens kept; their KV is the verified part
            req.num_computed_tokens = s.start_pos + len(new)
            done = s.start_pos + kept
            if done // bs != s.start_pos // bs:
                cache_full_blocks(req, done)
        if end_status is not None:
            finish(req.request_id, end_status)
    return got_tokens


def unschedule(out: SchedulerOutput) -> None:
    """Take back a step whose forward will not be applied (it failed, or it read the
    tokens of a step that failed): each request's progress returns to its chunk's start.
    Steps are taken back newest first."""
    running = RequestStatus.RUNNING
    for s, req in zip(reversed(out.scheduled), reversed(out.requests)):
        req.num_in_flight_steps -= 1
        if s.samples_token:
            req.num_output_placeholders -= 1
        if req.status == running and req.num_computed_tokens > s.start_pos:
            req.num_computed_tokens = s.start_pos


def reschedule(out: SchedulerOutput) -> None:
    """Mark a step taken back by `unschedule` as built again (its forward retried)."""
    for s, req in zip(out.scheduled, out.requests):
        mark_scheduled(req, s.start_pos + len(s.token_ids), s.samples_token)


def resolve_placeholders(out: SchedulerOutput) -> SchedulerOutput:
    """`out` with each placeholder input replaced by the token it stands for; call once
    the step before `out` has been applied (that token is then appended)."""
    scheduled = [
        replace(s, token_ids=req.all_token_ids[s.start_pos: s.start_pos + len(s.token_ids)]) if s.has_placeholder else s
        for s, req in zip(out.scheduled, out.requests)
    ]
    return replace(out, scheduled=scheduled)


def note_prefill_chunks(sched: SchedulerOutput, now: float) -> None:
    """A `prefill_chunk` TraceEvent at `now` (the end of the step's forward, Unix s) for
    each traced request with a prefill chunk in step `sched` (entries after the decodes)."""
    for s, req in zip(sched.scheduled[sched.num_decodes:], sched.requests[sched.num_decodes:]):
        if not req.is_finished:
            req.note("prefill_chunk", len(s.token_ids), t=now)
