"""`POST /v1/chat/completions` and `POST /v1/completions`: one request → one job on the
priority topic its key and body allow → the job's events back as one JSON body or as
server-sent events.

A streamed response's status line waits for the job's first token (or its end), so a
request that cannot start in time still gets a real 429 with `Retry-After` rather than
an error inside a 200 stream; the time to first byte is the first token's. A client
that goes away (aiohttp cancels the handler when the connection drops) gets its job
cancelled at once, streamed or not, and is counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import msgspec
import structlog
from aiohttp import web

from schemas.wire import Job
from worker.gateway.agents import auto_tool_calls
from worker.gateway.auth import effective_priority
from worker.gateway.choices import all_or_none, merge_choices, stream_choices
from worker.gateway.context import GatewayContext, json_ok
from worker.gateway.edge import check_context
from worker.gateway.errors import ApiError, error_for_outcome, overloaded
from worker.gateway.generation import Generation, seeded
from worker.gateway.protocol import GenRequest, Kind, parse_request
from worker.gateway.render import Renderer

log = structlog.get_logger(__name__)

def choice_jobs(req: GenRequest, job_id: str, tenant: str | None, deadline: float | None,
                adapter: str | None = None) -> list[Job]:
    """One job per choice (`n`): `job_id`, then `<job_id>-1` …; with a request seed `s`,
    choice i samples with seed `s + i` (distinct and reproducible), else each is seeded at
    random (`seeded`)."""
    jobs = []
    for i in range(req.n):
        job = build_job(req, job_id if i == 0 else f"{job_id}-{i}", tenant, deadline, adapter)
        if i and req.params.seed is not None:
            job = msgspec.structs.replace(job, params=msgspec.structs.replace(
                job.params, seed=(req.params.seed + i) & 0x7FFFFFFFFFFFFFFF))
        jobs.append(job)
    return jobs


def build_job(req: GenRequest, job_id: str, tenant: str | None, deadline: float | None,
              adapter: str | None = None) -> Job:
    """The job a validated request becomes (seeded: see `generation.seeded`)."""
    return seeded(Job(job_id=job_id, prompt=req.prompt, messages=req.messages, prompt_token_ids=req.prompt_token_ids,
                      params=req.params, tools=req.tools, tenant=tenant, deadline=deadline, created_at=time.time(),
                      metadata=req.metadata, adapter=adapter, chat_template_kwargs=req.chat_template_kwargs))


async def read_body(request: web.Request, cfg) -> bytes:
    """The request body. Raises ApiError 413 over `gateway.max_body_bytes`."""
    if request.content_length is not None and request.content_length > cfg.max_body_bytes:
        raise ApiError(413, f"request body over {cfg.max_body_bytes} bytes (gateway.max_body_bytes)",
                       code="request_too_large")
    return await request.read()


def admit(ctx: GatewayContext, req: GenRequest, grant, job_id: str) -> list[Generation]:
    """A validated request's generations (one per choice, not started yet), after the
    checks every generation endpoint makes: the model formats (`agents.auto_tool_calls`),
    the model or adapter, the context, the priority the key allows, the in-flight limit.

    Raises:
        ApiError: 400 / 404 / 429 from those checks.
    """
    cfg = ctx.cfg
    auto_tool_calls(req, ctx.formats)
    adapter = ctx.check_model(req.model, grant)
    check_context(req, ctx.tokens.tokenizer, ctx.max_model_len)  # a prompt that cannot fit: 400, nothing produced
    priority = effective_priority(grant, req.priority, cfg.default_priority)
    if ctx.in_flight >= cfg.max_concurrent_requests:
        raise overloaded(cfg.retry_after_s, "too many requests in flight on this gateway "
                         "(gateway.max_concurrent_requests); retry later")
    jobs = choice_jobs(req, job_id, grant.tenant, time.time() + cfg.queue_timeout_s, adapter)
    return [Generation(ctx.client, job, priority, request_timeout_s=cfg.request_timeout_s,
                       retry_after_s=cfg.retry_after_s, cancels=ctx.cancels, check_pool=ctx.fleet.check)
            for job in jobs]


@contextlib.asynccontextmanager
async def serving(ctx: GatewayContext, gens: list[Generation], endpoint: str):
    """Run the body with `gens` started and counted in flight: a start refused ends the
    request with its error (429: `overloaded`), a job that ended before any token with
    its outcome's error; a dropped connection (aiohttp cancels the handler) is counted, a
    timeout becomes 504; every job left unfinished is cancelled at the end, with the
    reason (`client_disconnect`, `timeout`, `overloaded`, `error`)."""
    cfg, m = ctx.cfg, ctx.metrics
    reason = "client_disconnect"
    ctx.in_flight += 1
    m.in_flight.inc()
    try:
        try:
            await all_or_none([g.start() for g in gens])
        except ApiError as e:
            reason = "overloaded" if e.status == 429 else "error"
            raise
        for gen in gens:
            if gen.finished is not None and not gen.finished.finish_reason.is_success:
                raise error_for_outcome(gen.finished, cfg.retry_after_s)  # ended before any token
        yield
    except asyncio.CancelledError:
        m.disconnects.labels(endpoint).inc()
        raise
    except TimeoutError:
        reason = "timeout"
        raise ApiError(504, f"the request did not finish within gateway.request_timeout_s "
                       f"({cfg.request_timeout_s} s)", code="timeout") from None
    finally:
        ctx.in_flight -= 1
        m.in_flight.dec()
        for gen in gens:
            await gen.close(gen.cancel_reason or reason)


class CompletionHandlers:
    """The two generation endpoints. Args: ctx: the gateway's shared context."""

    def __init__(self, ctx: GatewayContext) -> None:
        self.ctx = ctx

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, Kind.CHAT)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, Kind.COMPLETION)

    async def _handle(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        ctx = self.ctx
        t0 = time.monotonic()
        grant = ctx.grant(request)
        req = parse_request(kind, await read_body(request, ctx.cfg))
        gens = admit(ctx, req, grant, uuid.uuid4().hex)
        job_id = gens[0].job_id
        prefix = "chatcmpl-" if kind == Kind.CHAT else "cmpl-"
        renderers = [Renderer(kind, prefix + job_id, req.model, int(time.time()), ctx.tokens, req.include_usage,
                              req.tool_mode, index=i, parser=ctx.output_parser(req)) for i in range(len(gens))]
        endpoint = request.match_info.route.resource.canonical  # the metrics label (route template)
        async with serving(ctx, gens, endpoint):
            if req.stream:
                return await stream_choices(self.ctx, request, gens, renderers, t0, endpoint)
            return await self._whole(gens, renderers, req, t0, endpoint)

    async def _whole(self, gens: list[Generation], renderers: list[Renderer], req: GenRequest, t0: float,
                     endpoint: str) -> web.Response:
        async def collect(gen: Generation, renderer: Renderer) -> list | None:
            logprobs = [] if req.logprobs is not None else None
            async for d in gen.deltas():
                renderer.observe(d.text, d.num_tokens)
                if logprobs is not None and d.logprobs:
                    logprobs.extend(d.logprobs)
            return logprobs

        logprobs = await all_or_none([collect(g, r) for g, r in zip(gens, renderers, strict=True)])
        for gen in gens:
            if not gen.finished.finish_reason.is_success:
                raise error_for_outcome(gen.finished, self.ctx.cfg.retry_after_s)
        bodies = [r.completion(g.finished, lp) for r, g, lp in zip(renderers, gens, logprobs, strict=True)]
        resp = json_ok(merge_choices(bodies, [g.finished.usage for g in gens], renderers),
                       headers={"X-Request-Id": gens[0].job_id, "Server-Timing": gens[0].server_timing()})
        self.ctx.metrics.ttfb.labels(endpoint).observe(time.monotonic() - t0)
        return resp
