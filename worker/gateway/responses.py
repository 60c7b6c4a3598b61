"""`POST /v1/responses` (OpenAI's Responses API), `GET` and `DELETE /v1/responses/<id>`.

A request becomes the chat body it stands for (`responses_protocol.chat_body`), is
validated and served as one chat job (reasoning and "auto" tool calls read as in chat,
`worker.gateway.agents`), and its answer comes back as output items, whole or as typed
events. A client that goes away cancels the job at once, as in chat.

Stored responses (unless `store: false`, or `gateway.responses_ttl_s` is 0) live in
Redis under the caller's tenant for `responses_ttl_s` (default one hour): the response
object for `GET`, and its conversation (the `previous_response_id` chain's messages,
this input, the answer; not `instructions`, which OpenAI does not carry over either)
for a next request naming it. Any gateway of the fleet finds them.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from schemas import keys
from schemas.wire import Finished
from worker.gateway.choices import sse_response
from worker.gateway.completions import admit, read_body, serving
from worker.gateway.context import GatewayContext, json_ok
from worker.gateway.errors import ApiError, bad_request, error_for_outcome, invalid_json
from worker.gateway.generation import Generation
from worker.gateway.protocol import GenRequest, Kind, parse_body
from worker.gateway.responses_protocol import ResponseOutput, chat_body, input_messages
from worker.gateway.tools import ToolStream

_encode = msgspec.json.Encoder().encode


class _Answer:
    """One answer read into output items: the chat-style deltas of its reader (the
    reasoning / "auto" tool-call parser, a forced call's `ToolStream`, or the text)."""

    def __init__(self, ctx: GatewayContext, req: GenRequest) -> None:
        self.parser = ctx.output_parser(req)
        self.tokenizer = ctx.tokens.tokenizer
        mode = req.tool_mode
        self.tools = ToolStream(mode) if mode is not None and not mode.auto and self.parser is None else None
        self.output = ResponseOutput()

    def feed(self, text: str, num_tokens: int) -> list[dict[str, Any]]:
        if self.parser is not None:
            deltas = self.parser.feed(text, num_tokens)
        elif self.tools is not None:
            deltas = self.tools.text(text)
        else:
            deltas = [{"content": text}] if text else []
        return [e for d in deltas for e in self.output.apply(d)]

    def finish(self) -> list[dict[str, Any]]:
        deltas = self.parser.finish() if self.parser is not None else self.tools.finish() if self.tools else []
        return [e for d in deltas for e in self.output.apply(d)] + self.output.close()

    @property
    def reasoning_tokens(self) -> int:
        return (self.parser.reasoning_count(self.tokenizer) or 0) if self.parser is not None else 0


class ResponsesHandlers:
    """The Responses API endpoints. Args: ctx: the gateway's shared context."""

    def __init__(self, ctx: GatewayContext) -> None:
        self.ctx = ctx

    # ---- stored responses ---------------------------------------------------------------
    def _key(self, response_id: str, tenant: str | None) -> str:
        return keys.response_key(response_id, tenant, self.ctx.client.key_prefix)

    async def _stored(self, response_id: str, tenant: str | None, param: str | None = None) -> dict[str, Any]:
        raw = await self.ctx.client.redis.get(self._key(response_id, tenant))
        if raw is None:
            raise ApiError(404, f"Response with id '{response_id}' not found (responses are kept "
                           f"{self.ctx.cfg.responses_ttl_s} s: gateway.responses_ttl_s).", param=param,
                           code="not_found")
        return msgspec.json.decode(raw)

    async def get(self, request: web.Request) -> web.Response:
        grant = self.ctx.grant(request)
        return json_ok((await self._stored(request.match_info["response_id"], grant.tenant))["response"])

    async def delete(self, request: web.Request) -> web.Response:
        grant = self.ctx.grant(request)
        response_id = request.match_info["response_id"]
        if not await self.ctx.client.redis.delete(self._key(response_id, grant.tenant)):
            raise ApiError(404, f"Response with id '{response_id}' not found.", code="not_found")
        return json_ok({"id": response_id, "object": "response.deleted", "deleted": True})

    # ---- create -------------------------------------------------------------------------
    async def create(self, request: web.Request) -> web.StreamResponse:
        ctx = self.ctx
        t0 = time.monotonic()
        grant = ctx.grant(request)
        try:
            body = msgspec.json.decode(await read_body(request, ctx.cfg))
        except msgspec.DecodeError:
            raise invalid_json() from None
        if not isinstance(body, dict):
            raise bad_request("The request body must be a JSON object.", code="invalid_json")
        previous = body.get("previous_response_id")
        if previous is not None and not isinstance(previous, str):
            raise bad_request("'previous_response_id' must be a string.", param="previous_response_id")
        history = (await self._stored(previous, grant.tenant, "previous_response_id"))["messages"] if previous else []
        req = parse_body(Kind.CHAT, chat_body(body, history))
        (gen,) = admit(ctx, req, grant, uuid.uuid4().hex)
        answer = _Answer(ctx, req)
        head = _head("resp_" + gen.job_id, body, req)
        conversation = history + input_messages(body.get("input"))
        store = body.get("store") is not False and ctx.cfg.responses_ttl_s > 0

        async def done(fin: Finished) -> dict[str, Any]:
            obj = _final(head, answer, fin)
            if store:
                message = answer.output.chat_message()
                record = {"response": obj, "messages": conversation + ([message] if message else [])}
                await ctx.client.redis.set(self._key(obj["id"], grant.tenant), _encode(record),
                                           ex=ctx.cfg.responses_ttl_s)
            return obj

        endpoint = request.match_info.route.resource.canonical
        async with serving(ctx, [gen], endpoint):
            if body.get("stream"):
                return await self._stream(request, gen, answer, head, done, t0, endpoint)
            async for d in gen.deltas():
                answer.feed(d.text, d.num_tokens)
            if not gen.finished.finish_reason.is_success:
                raise error_for_outcome(gen.finished, ctx.cfg.retry_after_s)
            answer.finish()
            resp = json_ok(await done(gen.finished), headers={"X-Request-Id": gen.job_id,
                                                               "Server-Timing": gen.server_timing()})
            ctx.metrics.ttfb.labels(endpoint).observe(time.monotonic() - t0)
            return resp

    async def _stream(self, request: web.Request, gen: Generation, answer: _Answer, head: dict[str, Any], done,
                      t0: float, endpoint: str) -> web.StreamResponse:
        m = self.ctx.metrics
        seq = 0

        def events(items: list[dict[str, Any]]) -> bytes:
            nonlocal seq
            out = []
            for e in items:
                e["sequence_number"] = seq
                seq += 1
                out.append(b"event: " + e["type"].encode() + b"\ndata: " + _encode(e) + b"\n\n")
            return b"".join(out)

        async with sse_response(self.ctx, request, gen, endpoint) as resp:
            opened = {**head, "status": "in_progress", "output": [], "usage": None}
            await resp.write(events([{"type": "response.created", "response": opened},
                                     {"type": "response.in_progress", "response": opened}]))
            first = True
            try:
                async for d in gen.deltas():
                    m.tokens.inc(d.num_tokens)
                    chunk = events(answer.feed(d.text, d.num_tokens))
                    if chunk:
                        await resp.write(chunk)
                        if first:
                            first = False
                            m.ttfb.labels(endpoint).observe(time.monotonic() - t0)
                fin = gen.finished
                if not fin.finish_reason.is_success:
                    raise error_for_outcome(fin, self.ctx.cfg.retry_after_s)
                tail = answer.finish()
                obj = await done(fin)
                kind = "response.completed" if obj["status"] == "completed" else "response.incomplete"
                await resp.write(events(tail + [{"type": kind, "response": obj}]))
            except ApiError as e:
                await resp.write(events([{"type": "error", "code": e.code, "message": e.message, "param": e.param}]))
            except TimeoutError:
                gen.cancel_reason = "timeout"
                await resp.write(events([{"type": "error", "code": "timeout", "param": None,
                                          "message": "the request did not finish within gateway.request_timeout_s"}]))
            if first:
                m.ttfb.labels(endpoint).observe(time.monotonic() - t0)
            await resp.write_eof()
        return resp


def _head(response_id: str, body: dict[str, Any], req: GenRequest) -> dict[str, Any]:
    """The response object's fields known before the answer."""
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    return {"id": response_id, "object": "response", "created_at": int(time.time()), "model": req.model,
            "status": "in_progress", "error": None, "incomplete_details": None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {}, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"), "reasoning": body.get("reasoning") or {},
            "store": body.get("store") is not False, "temperature": req.params.temperature,
            "text": {"format": fmt}, "tool_choice": body.get("tool_choice") or ("auto" if body.get("tools") else "none"),
            "tools": body.get("tools") or [], "top_p": req.params.top_p, "truncation": "disabled",
            "user": body.get("user"), "output": []}


def _final(head: dict[str, Any], answer: _Answer, fin: Finished) -> dict[str, Any]:
    cut = fin.finish_reason.value == "length"
    u = fin.usage
    usage = None if u is None else {
        "input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
        "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": answer.reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens}
    return {**head, "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "output": [dict(i) for i in answer.output.items], "usage": usage}
