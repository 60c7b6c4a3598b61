"""Observability: every Prometheus series of a worker, structlog setup, and quiet logging of transient Kafka conditions."""
