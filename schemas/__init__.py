"""Wire contract of Inflight: every type that crosses a process boundary.

Imports neither torch nor worker code, so producers can install it alone
(`pip install inflight-worker`) and build jobs from any Python program.
"""

from schemas.params import SamplingParams
from schemas.wire import (
    SCHEMA_VERSION,
    Cancel,
    ChatMessage,
    ErrorInfo,
    Event,
    Finished,
    Job,
    Restarted,
    Started,
    Timings,
    Token,
    Usage,
)

__all__ = [
    "SCHEMA_VERSION",
    "Cancel",
    "ChatMessage",
    "ErrorInfo",
    "Event",
    "Finished",
    "Job",
    "Restarted",
    "SamplingParams",
    "Started",
    "Timings",
    "Token",
    "Usage",
]
