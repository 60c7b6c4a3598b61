"""The producer-side client (`pip install "inflight-worker[client]"`; no torch, no engine
code): `InflightClient` submits jobs, streams their events and cancels them
(`inflight.py`), over one shared pub/sub connection (`subscriber.py`), with the durable
results topic as the fallback reader (`results.py`).

    from worker.client import InflightClient
"""

from worker.client.inflight import InflightClient, last_attempt_tokens, text_of

__all__ = ["InflightClient", "last_attempt_tokens", "text_of"]
