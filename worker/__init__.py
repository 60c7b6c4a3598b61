"""Inflight worker: engine, model runner and (later) the Kafka/Redis worker around them."""
