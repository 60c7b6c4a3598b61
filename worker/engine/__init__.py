"""The engine: request lifecycle, scheduler, KV cache manager, and the engine core's
step loop, with input and output processing around it (vLLM V1's seams).

Map (one line per module):
    request.py           Request, RequestStatus (ordered lifecycle), Priority, finish-reason table,
                         rejections, error codes
    kv_cache.py          BlockPool (free list, ref counts, prefix-cache hashes) and KVCacheManager
    kv_window.py         SlidingWindowKVCacheManager: blocks behind an all-layer window are freed
    scheduler.py         Scheduler: per-step batch under a token budget; admission, priority, preemption
    fair_share.py        per-tenant virtual token counters inside a priority class, quotas
    inputs.py            RequestInput (one request as callers hand it in) and its prompt kinds;
                         its RequestOptions (outputs.py) ride along to the scheduler's Request
    outputs.py           contract objects between scheduler, model runner, engine core and callers
    input_processor.py   InputProcessor: RequestInput -> tokenize + validate -> EngineCoreRequest
    core.py              EngineCore: the step loop (forward failures) -> token ids only
    arrivals.py          Arrivals: requests on their way in (queued, compiling a grammar, deadlines)
    admission.py         AdmissionPass: the scheduler's phase 2, waiting requests into the batch
    output_processor.py  OutputProcessor: token ids -> text deltas, stop strings, final outputs
    engine.py            Engine: the three together, the public API (add / abort / step)
    core_proc.py         the engine core in its own process (vLLM V1's EngineCoreProc)
    core_client.py       how the worker talks to its engine: thread or process, one interface
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Names resolve on first use (PEP 562), so a process that only talks to an engine (the
# worker's front process, the gateway) does not import torch through this package.
_HOMES = {
    "Usage": "schemas.wire", "EngineCore": "worker.engine.core", "Engine": "worker.engine.engine",
    "InputProcessor": "worker.engine.input_processor", "ModelFacts": "worker.engine.input_processor",
    "ChatPrompt": "worker.engine.inputs", "RequestInput": "worker.engine.inputs",
    "TextPrompt": "worker.engine.inputs", "TokenPrompt": "worker.engine.inputs",
    "OutputProcessor": "worker.engine.output_processor",
    **dict.fromkeys(("CompletionOutput", "EngineCoreOutput", "EngineCoreRequest", "KVStats", "RequestOptions",
                     "RequestOutput", "RequestTimes", "StepStats"), "worker.engine.outputs"),
    **dict.fromkeys(("ErrorCode", "Priority", "RejectReason", "RequestRejected"), "worker.engine.request"),
}

if TYPE_CHECKING:
    from schemas.wire import Usage
    from worker.engine.core import EngineCore
    from worker.engine.engine import Engine
    from worker.engine.input_processor import InputProcessor, ModelFacts
    from worker.engine.inputs import ChatPrompt, RequestInput, TextPrompt, TokenPrompt
    from worker.engine.output_processor import OutputProcessor
    from worker.engine.outputs import (
        CompletionOutput,
        EngineCoreOutput,
        EngineCoreRequest,
        KVStats,
        RequestOptions,
        RequestOutput,
        RequestTimes,
        StepStats,
    )
    from worker.engine.request import ErrorCode, Priority, RejectReason, RequestRejected


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


__all__ = [
    "ChatPrompt",
    "CompletionOutput",
    "Engine",
    "EngineCore",
    "EngineCoreOutput",
    "EngineCoreRequest",
    "ErrorCode",
    "InputProcessor",
    "KVStats",
    "ModelFacts",
    "OutputProcessor",
    "Priority",
    "RejectReason",
    "RequestOutput",
    "RequestInput",
    "RequestOptions",
    "RequestRejected",
    "RequestTimes",
    "StepStats",
    "TextPrompt",
    "TokenPrompt",
    "Usage",
]
