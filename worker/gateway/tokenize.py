"""vLLM's server utilities on the gateway: `POST /tokenize`, `POST /detokenize`, `GET
/version` (and `GET /health`, `worker.gateway.app`), with vLLM's request and response
fields, for the clients and tools written against `vllm serve` that count tokens
through it.

Tokens are counted with the gateway's own tokenizer (`gateway.tokenizer`, the
checkpoint's `tokenizer.json`), the one the workers load. A text prompt only: the chat
template is rendered by the workers (`messages` is refused with that reason), so a chat
request's count is not available here. Without `gateway.tokenizer` both tokenizer routes
answer 400 naming the setting. The caller's API key is checked as on `/v1/*`.
"""

from __future__ import annotations

from importlib import metadata

import msgspec
from aiohttp import web

from worker.gateway.context import GatewayContext, json_ok
from worker.gateway.errors import bad_request, invalid_json, unsupported


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """`POST /tokenize` (vLLM's text form): `prompt`, and `add_special_tokens` (default
    true: BOS and the like, as a completion's prompt gets them), `return_token_strs`."""

    prompt: str | None = None
    messages: list | None = None
    model: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """`POST /detokenize`: token ids back to text."""

    tokens: list[int]
    model: str | None = None


def version() -> str:
    """This package's version (`inflight-worker`), or "unknown" when it is not installed."""
    try:
        return metadata.version("inflight-worker")
    except metadata.PackageNotFoundError:
        return "unknown"


class TokenizeHandlers:
    """The routes of the module docstring. Args: ctx: the gateway's shared context;
    max_model_len: the model's context length (tokens; None: unknown)."""

    def __init__(self, ctx: GatewayContext, max_model_len: int | None) -> None:
        self.ctx = ctx
        self.max_model_len = max_model_len

    async def tokenize(self, request: web.Request) -> web.Response:
        """`{count, max_model_len, tokens[, token_strs]}`. Raises ApiError 400 (bad body,
        `messages`, no tokenizer), 401, 404 (`model` not served here)."""
        req = await self._read(request, TokenizeRequest)
        if req.messages is not None:
            raise unsupported("messages", ": the chat template is rendered by the workers, so this gateway counts "
                                          "text prompts only")
        if req.prompt is None:
            raise bad_request("'prompt' is required", param="prompt", code="missing_required_parameter")
        enc = self._tokenizer().encode(req.prompt, add_special_tokens=req.add_special_tokens)
        body = {"count": len(enc.ids), "max_model_len": self.max_model_len, "tokens": enc.ids}
        if req.return_token_strs:
            body["token_strs"] = enc.tokens
        return json_ok(body)

    async def detokenize(self, request: web.Request) -> web.Response:
        """`{prompt}`. Raises ApiError 400 (bad body, an id outside the vocabulary, no
        tokenizer), 401, 404."""
        req = await self._read(request, DetokenizeRequest)
        tok = self._tokenizer()
        vocab = tok.get_vocab_size(with_added_tokens=True)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids outside the vocabulary (0-{vocab - 1}): {bad[:5]}", param="tokens")
        return json_ok({"prompt": tok.decode(req.tokens, skip_special_tokens=False)})

    async def version(self, request: web.Request) -> web.Response:
        return json_ok({"version": version()})

    async def _read(self, request: web.Request, kind: type[msgspec.Struct]):
        """The caller's body as `kind`, after the key check and, when `model` is given,
        the model check (the base model or an adapter the key may use)."""
        grant = self.ctx.grant(request)
        try:
            req = msgspec.json.decode(await request.read(), type=kind)
        except msgspec.ValidationError as e:
            raise bad_request(f"invalid request body: {e}") from None
        except msgspec.DecodeError:
            raise invalid_json() from None
        if req.model is not None:
            self.ctx.check_model(req.model, grant)
        return req

    def _tokenizer(self):
        tok = self.ctx.tokens.tokenizer
        if tok is None:
            raise bad_request("this gateway has no tokenizer: set gateway.tokenizer (the checkpoint's tokenizer.json "
                              "or its directory)", code="tokenizer_not_configured")
        return tok
