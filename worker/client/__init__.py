"""The producer-side client (`pip install "inflight-worker[client]"`; no torch, no engine
code): `InflightClient` submits jobs, streams their events and cancels them
(`inflight.py`; PRODUCER spans in `tracing.py`), over one shared pub/sub connection
(`subscriber.py`), with the durable results topic as the fallback reader (`results.py`);
`text_of` reads a job's text from its events (`events.py`).

    from worker.client import InflightClient
"""

from worker.client.events import last_attempt_tokens, text_of
from worker.client.inflight import InflightClient

__all__ = ["InflightClient", "last_attempt_tokens", "text_of"]
