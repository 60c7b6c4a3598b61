"""What the gateway's request handlers share: settings, the Kafka/Redis client, the key
ring, metrics, the cancel sender (one `GatewayContext` per process, built by
`worker.gateway.app.Gateway`), and small helpers for answering in JSON."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
from aiohttp import web

from worker.client import InflightClient
from worker.gateway.auth import Grant, KeyRing
from worker.gateway.config import GatewayConfig
from worker.gateway.errors import ApiError
from worker.gateway.generation import CancelSender
from worker.gateway.metrics import GatewayMetrics
from worker.gateway.render import TokenText

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

    def check_model(self, model: str) -> None:
        """Raises ApiError 404 (OpenAI's `model_not_found`) for a model not served here."""
        if model != self.cfg.model_name:
            raise ApiError(404, f"The model `{model}` does not exist or you do not have access to it.",
                           param="model", code="model_not_found")


def json_ok(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON response encoded with msgspec (fast; Structs and dicts alike)."""
    return web.Response(body=_encode(obj), status=status, content_type="application/json", headers=headers)


def error_response(err: ApiError) -> web.Response:
    return json_ok(err.body(), status=err.status, headers=err.headers)
