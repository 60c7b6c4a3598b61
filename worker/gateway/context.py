"""What the gateway's request handlers share: settings, the Kafka/Redis client, the key
ring, metrics, the cancel sender (one `GatewayContext` per process, built by
`worker.gateway.app.Gateway`), and small helpers for answering in JSON."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from schemas.wire import ADAPTER_PATTERN
from worker.client import InflightClient
from worker.gateway.agents import OutputFormats, OutputParser, output_parser
from worker.gateway.auth import Grant, KeyRing
from worker.gateway.config import GatewayConfig
from worker.gateway.errors import ApiError
from worker.gateway.generation import CancelSender
from worker.gateway.liveness import FleetLiveness
from worker.gateway.metrics import GatewayMetrics
from worker.gateway.render import TokenText

if TYPE_CHECKING:
    from worker.gateway.protocol import GenRequest

_encode = msgspec.json.Encoder().encode

# Set on a request whose client went away mid-response (counted with status 499).
CLIENT_GONE = web.RequestKey("client_gone", bool)


@dataclasses.dataclass
class GatewayContext:
    """Shared by every handler of one gateway process; `cfg` is read-only, the client
    and senders are safe to share on the event loop."""

    cfg: GatewayConfig
    client: InflightClient
    keys: KeyRing
    metrics: GatewayMetrics
    cancels: CancelSender
    tokens: TokenText

    def grant(self, request: web.Request) -> Grant:
        """The caller's grant. Raises ApiError 401."""
        return self.keys.authenticate(request.headers.get("Authorization"))

    adapters: AdapterNames = dataclasses.field(default_factory=lambda: AdapterNames([], None))
    # pools without a live worker (worker.gateway.liveness), fed by the readiness checks
    fleet: FleetLiveness = dataclasses.field(default_factory=lambda: FleetLiveness("inflight", 5.0))
    max_model_len: int | None = None  # the model's context (gateway.max_model_len or the tokenizer's config.json)
    formats: OutputFormats = dataclasses.field(default_factory=OutputFormats)  # tool call / reasoning families
    in_flight: int = 0  # generation requests in progress, every endpoint (gateway.max_concurrent_requests)

    def output_parser(self, req: GenRequest) -> OutputParser | None:
        """The reasoning / "auto" tool-call reader of one of `req`'s choices (None: plain)."""
        return output_parser(req, self.formats)

    def check_model(self, model: str, grant: Grant | None = None) -> str | None:
        """The LoRA adapter `model` names (`<model_name>:<adapter>`), None for the base
        model. Raises ApiError 404 (OpenAI's `model_not_found`) for a model not served
        here, or an adapter the caller's key may not use (not told apart)."""
        if model == self.cfg.model_name:
            return None
        base, sep, adapter = model.partition(":")
        if sep and base == self.cfg.model_name and adapter in self.adapters.names() and (
                grant is None or grant.may_use(adapter)):
            return adapter
        raise ApiError(404, f"The model `{model}` does not exist or you do not have access to it.",
                       param="model", code="model_not_found")

    def models(self, grant: Grant) -> list[str]:
        """The model ids `grant` may use: the base model, then its adapters."""
        name = self.cfg.model_name
        return [name] + [f"{name}:{a}" for a in self.adapters.names() if grant.may_use(a)]


class AdapterNames:
    """The adapters a gateway serves: `gateway.adapters`, plus those found in
    `gateway.lora_dir` (an adapter_config.json in a subdirectory), listed at most every
    `ttl_s`."""

    def __init__(self, configured: list[str], lora_dir: str | None, ttl_s: float = 10.0) -> None:
        self.configured = list(configured)
        self.lora_dir = lora_dir
        self.ttl_s = ttl_s
        self._found: list[str] = []
        self._listed_at = -math.inf

    def names(self) -> list[str]:
        if self.lora_dir is not None and time.monotonic() - self._listed_at > self.ttl_s:
            self._listed_at = time.monotonic()
            try:
                entries = sorted(os.listdir(self.lora_dir))
            except OSError:
                entries = []
            self._found = [n for n in entries if re.fullmatch(ADAPTER_PATTERN, n)
                           and os.path.isfile(os.path.join(self.lora_dir, n, "adapter_config.json"))]
        return sorted(set(self.configured) | set(self._found))


def json_ok(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON response encoded with msgspec (fast; Structs and dicts alike)."""
    return web.Response(body=_encode(obj), status=status, content_type="application/json", headers=headers)


def error_response(err: ApiError) -> web.Response:
    return json_ok(err.body(), status=err.status, headers=err.headers)
