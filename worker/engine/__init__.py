"""The in-process engine: request lifecycle, scheduler, KV cache manager, engine loop.

Map (one line per module):
    request.py    Request, RequestStatus (ordered lifecycle), Priority, finish-reason table, rejections,
                  error codes
    kv_cache.py   BlockPool (free list, ref counts, prefix-cache hashes) and KVCacheManager (block tables)
    scheduler.py  Scheduler: per-step batch under a token budget; admission, priority, preemption
    fair_share.py per-tenant virtual token counters inside a priority class (Pick, Lift, Yield), quotas
    outputs.py    contract objects between scheduler, model runner and engine callers
    core.py       Engine: public API (add_request / abort / step / generate)
"""

from worker.engine.core import Engine
from worker.engine.outputs import CompletionOutput, KVStats, RequestOutput, RequestTimes, StepStats, Usage
from worker.engine.request import ErrorCode, Priority, RejectReason, RequestRejected

__all__ = [
    "CompletionOutput",
    "Engine",
    "ErrorCode",
    "KVStats",
    "Priority",
    "RejectReason",
    "RequestOutput",
    "RequestRejected",
    "RequestTimes",
    "StepStats",
    "Usage",
]
