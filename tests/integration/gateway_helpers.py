"""Helpers for the gateway's integration tests: a gateway config on the test's prefix, a
gateway run in the test's event loop, the official `openai` client against it, and
Prometheus samples read back from a registry."""

from __future__ import annotations

import contextlib
import json

import openai

from worker.config import KafkaConfig, RedisConfig
from worker.gateway.app import Gateway
from worker.gateway.config import ApiKey, GatewayConfig, GatewayFileConfig

MODEL = "tiny-llama"
KEY = "sk-test-acme-high"  # tenant acme, may use high
KEY_LOW = "sk-test-acme-low"  # tenant acme, low at most
KEY_OTHER = "sk-test-other-tenant"  # tenant other


def gateway_config(services, prefix: str, files_dir, *, tokenizer=None, redis_url: str | None = None,
                   **over) -> GatewayFileConfig:
    keys = [ApiKey(key=KEY, tenant="acme", max_priority="high", name="acme-high"),
            ApiKey(key=KEY_LOW, tenant="acme", max_priority="low"),
            ApiKey(key=KEY_OTHER, tenant="other", max_priority="normal")]
    g = dict(host="127.0.0.1", port=0, model_name=MODEL, tokenizer=str(tokenizer) if tokenizer else None,
             api_keys=keys, files_dir=str(files_dir), batch_scan_interval_s=1.0, batch_lease_ms=3000)
    g.update(over)
    return GatewayFileConfig(gateway=GatewayConfig(**g),
                             kafka=KafkaConfig(bootstrap_servers=services[0], topic_prefix=prefix,
                                               group_id=f"{prefix}-workers"),  # the workers' (conftest)
                             redis=RedisConfig(url=redis_url or services[1], key_prefix=prefix))


@contextlib.asynccontextmanager
async def running_gateway(cfg: GatewayFileConfig, gateway_id: str | None = None):
    """A started gateway in this event loop, always stopped at the end."""
    gw = Gateway(cfg, gateway_id=gateway_id)
    await gw.start()
    try:
        yield gw
    finally:
        await gw.stop()


def client(gw: Gateway, key: str = KEY, **kw) -> openai.AsyncOpenAI:
    """The official client, without its automatic retries (a test sees every answer)."""
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key=key, max_retries=0, **kw)


def sample(registry, name: str, **labels) -> float:
    """A sample's value (0.0 when absent)."""
    for metric in registry.collect():
        for s in metric.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def batch_line(custom_id: str, url: str = "/v1/chat/completions", **body) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": MODEL, **body}}).encode()
