"""Every Prometheus series of one gateway process, in its own registry, served on the
gateway's `/metrics`. Labels are low-cardinality only: `endpoint` (the route template,
e.g. `/v1/batches/{batch_id}`, never a raw path), `status` (HTTP status code), `reason`
(why a cancel was sent) and `outcome`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# seconds: 1 ms – 120 s (as the worker's TTFT)
TTFB_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                20.0, 40.0, 80.0, 120.0)
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class GatewayMetrics:
    """Every Prometheus series of the gateway.

    Args: registry: where to register (a fresh one if None)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter("gateway_requests", "HTTP requests answered, by endpoint and status",
                                ("endpoint", "status"), registry=r)
        self.duration = Histogram("gateway_request_duration_seconds", "Request received to response complete",
                                  ("endpoint",), buckets=DURATION_BUCKETS, registry=r)
        self.ttfb = Histogram("gateway_time_to_first_byte_seconds", "Request received to the first byte of the "
                              "response body (streams: the first token's chunk)", ("endpoint",),
                              buckets=TTFB_BUCKETS, registry=r)
        self.open_streams = Gauge("gateway_open_streams", "Streaming (SSE) responses in progress", registry=r)
        self.in_flight = Gauge("gateway_requests_in_flight", "Generation requests in progress (streamed or not)",
                               registry=r)
        self.disconnects = Counter("gateway_client_disconnects", "Clients that went away before their response "
                                   "was complete, by endpoint", ("endpoint",), registry=r)
        self.cancels = Counter("gateway_cancels_sent", "Cancel messages sent, by reason (client_disconnect, "
                               "timeout, overloaded, batch_cancelled, batch_expired)", ("reason",), registry=r)
        self.tokens = Counter("gateway_streamed_tokens", "Tokens delivered in streamed responses", registry=r)
        self.batch_lines = Counter("gateway_batch_lines", "Batch lines by outcome (dispatched, completed, failed, "
                                   "invalid, cancelled, expired)", ("outcome",), registry=r)
        self.batches_active = Gauge("gateway_batches_driven", "Batches this gateway is driving now", registry=r)
        self.live_workers = Gauge("gateway_live_workers", "Workers of each pool alive at the last readiness check "
                                  "(members of the pool's consumer group on its job topics; absent when unknown)",
                                  ("pool",), registry=r)
