"""Output processing: the engine core's token ids → text deltas, stop strings, usage and
final outputs (vLLM V1's `OutputProcessor`). It needs only the tokenizer, so it runs
wherever the caller is: on the engine thread inside `Engine.step`, or in the worker's
front-end process when the engine core runs in its own process.

Per request it keeps an `IncrementalDetokenizer`. A stop string found in the text ends
the request here: its final output carries `stop`, and the caller tells the core to
finish it (`ProcessedOutputs.finish`), so its KV blocks are freed at the next step
boundary; any token the core produced for it meanwhile is dropped. The same holds for a
request whose token cannot be turned into text (`error`, code `internal`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from schemas.wire import FinishReason, Usage
from worker.engine.outputs import EngineCoreOutput, RequestOutput, RequestTimes, TokenLogprobs
from worker.engine.request import ErrorCode, RequestStatus
from worker.model.detokenizer import IncrementalDetokenizer
from worker.obs.errors import one_line

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _RequestState:
    detok: IncrementalDetokenizer
    num_prompt_tokens: int
    arrival_time: float
    num_output_tokens: int = 0


@dataclass(slots=True)
class ProcessedOutputs:
    """`outputs`: deltas for the caller. `finish`: (request id, terminal status) of requests
    this processor ended (stop string, output error) that the engine core must finish."""

    outputs: list[RequestOutput] = field(default_factory=list)
    finish: list[tuple[str, RequestStatus]] = field(default_factory=list)
    num_internal_errors: int = 0  # requests ended here with finish_reason error, code internal


class OutputProcessor:
    """Turns each step's token ids into text deltas per request: incremental detokenization, stop strings, final outputs.

    Args:
        tokenizer: a transformers tokenizer (its fast backend decodes) or anything with
            `decode(ids, skip_special_tokens=...)`.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._decoder = getattr(tokenizer, "backend_tokenizer", None) or tokenizer
        self._requests: dict[str, _RequestState] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, request_id: str, stop: list[str], num_prompt_tokens: int, arrival_time: float) -> None:
        """Register a request before the core can produce anything for it."""
        self._requests[request_id] = _RequestState(IncrementalDetokenizer(self._decoder, stop), num_prompt_tokens,
                                                   arrival_time)

    def discard(self, request_id: str) -> None:
        """Forget a request without an output (handed back; its core outputs are ignored)."""
        self._requests.pop(request_id, None)

    def process(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Turn core outputs (one step's, or several steps' in order) into deltas: one per
        request, several steps' tokens merged (`merge_steps`)."""
        result = ProcessedOutputs()
        for out in merge_steps(core_outputs):
            st = self._requests.get(out.request_id)
            if st is None:  # ended here already (stop string), or not ours
                continue
            try:
                self._one(out, st, result)
            except Exception as e:  # this request's output cannot be produced: end it, keep the others
                log.error("request %s failed turning tokens into output", out.request_id, exc_info=True,
                          extra={"job_id": out.request_id})
                self._requests.pop(out.request_id, None)
                result.outputs.append(self._final(out.request_id, st, out.new_token_ids, "", out.logprobs,
                                                  FinishReason.ERROR, out, (ErrorCode.INTERNAL, one_line(e))))
                result.num_internal_errors += 1
                if out.finish_reason is None:
                    result.finish.append((out.request_id, RequestStatus.FINISHED_ERROR))
        return result

    def _one(self, out: EngineCoreOutput, st: _RequestState, result: ProcessedOutputs) -> None:
        rid = out.request_id
        ids = out.new_token_ids
        logprobs = out.logprobs
        st.num_output_tokens += len(ids)
        # A token that ended the request by EOS / stop_token_ids is not part of the text
        # (the last token of a completed grammar is).
        text_ids = ids[:-1] if out.finish_reason == FinishReason.STOP and ids and not out.stop_in_text else ids
        detok = st.detok
        if len(text_ids) > 1 and detok.has_stop_strings:
            # several steps' tokens at once: find the token that completes a stop string, so
            # the ids and usage end there, as they would one step at a time
            delta = ""
            for i, token_id in enumerate(text_ids):
                delta += detok.add([token_id])
                if detok.stopped:
                    st.num_output_tokens -= len(ids) - (i + 1)
                    ids = ids[: i + 1]
                    logprobs = logprobs[: i + 1] if logprobs else logprobs
                    out = msgspec.structs.replace(out, finish_reason=None)
                    break
        else:
            delta = detok.add(text_ids) if text_ids else ""
        if detok.stopped and out.finish_reason is None:  # a stop string ended it here
            self._requests.pop(rid, None)
            result.outputs.append(self._final(rid, st, ids, delta, logprobs, FinishReason.STOP, out))
            result.finish.append((rid, RequestStatus.FINISHED_STOPPED))
        elif out.finish_reason is not None:
            self._requests.pop(rid, None)
            result.outputs.append(self._final(rid, st, ids, delta, logprobs, out.finish_reason, out,
                                              (out.error_code, out.error_message or "") if out.error_code else None))
        else:
            result.outputs.append(RequestOutput(rid, ids, delta, logprobs=logprobs))

    def _final(self, rid: str, st: _RequestState, ids: list[int], delta: str, logprobs: list[TokenLogprobs] | None,
               reason: FinishReason, out: EngineCoreOutput, error: tuple[str, str] | None = None) -> RequestOutput:
        if error is None or error[0] != ErrorCode.INTERNAL:
            delta += st.detok.flush()
        times = out.times or RequestTimes(st.arrival_time, None, None, time.time())
        return RequestOutput(
            rid, ids, delta, finished=True, finish_reason=reason,
            usage=Usage(prompt_tokens=st.num_prompt_tokens, completion_tokens=st.num_output_tokens,
                        cached_prompt_tokens=out.num_cached_tokens),
            logprobs=logprobs, num_preemptions=out.num_preemptions, times=times,
            error_code=str(error[0]) if error else None, error_message=error[1] if error else None,
        )


def merge_steps(core_outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
    """Several steps' core outputs (in step order) with each request's merged into one:
    its tokens and logprobs in order, the rest (finish, times, errors) from its last. A
    caller that fell behind (the worker's reader found several steps waiting) so turns a
    request's tokens into text in one detokenizer call and one delta, and catches up.
    Requests come out in the order of their first output; outputs that name each request
    once (one step's) come back as they are."""
    seen: set[str] = set()
    for out in core_outputs:
        if out.request_id in seen:
            break
        seen.add(out.request_id)
    else:
        return core_outputs
    index: dict[str, int] = {}
    merged: list[EngineCoreOutput] = []
    for out in core_outputs:
        j = index.get(out.request_id)
        if j is None:
            index[out.request_id] = len(merged)
            merged.append(out)
            continue
        prev = merged[j]
        logprobs = (prev.logprobs or []) + (out.logprobs or []) if prev.logprobs or out.logprobs else None
        merged[j] = msgspec.structs.replace(out, new_token_ids=prev.new_token_ids + out.new_token_ids,
                                            logprobs=logprobs)
    return merged
