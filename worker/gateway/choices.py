"""Several choices for one request (`n` > 1): each choice is a job of its own (its own seed,
so the choices differ and each is reproducible), started together, and their outputs
merged into one response as OpenAI shapes it: `choices[i]` with `index` i, the usage
counting the prompt once and every choice's completion tokens; streamed, each choice's
chunks carry its index and arrive interleaved as the jobs produce them, one usage chunk
at the end. One choice failing fails the request (its error, as for one choice), and the
others are cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from schemas.wire import Usage
from worker.gateway.context import CLIENT_GONE, GatewayContext
from worker.gateway.errors import ApiError, error_for_outcome
from worker.gateway.generation import Generation
from worker.gateway.render import DONE, SSE_HEADERS, Renderer, error_event, merged_usage, with_reasoning


async def all_or_none(coros: list[Awaitable]) -> list:
    """Run `coros` concurrently and return their results in order; the first exception
    cancels the others (awaited) and propagates (plain, not an exception group)."""
    if len(coros) == 1:
        return [await coros[0]]
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if t.exception() is not None:
                raise t.exception()
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def merge_choices(bodies: list[dict[str, Any]], usages: list[Usage | None],
                  renderers: list[Renderer] | None = None) -> dict[str, Any]:
    """One non-streamed body from each choice's (`Renderer.completion`): the first's head,
    every choice, the merged usage."""
    if len(bodies) == 1:
        return bodies[0]
    return {**bodies[0], "choices": [b["choices"][0] for b in bodies],
            "usage": with_reasoning(merged_usage(usages), renderers or [])}


@contextlib.asynccontextmanager
async def sse_response(ctx: GatewayContext, request: web.Request, gen: Generation, endpoint: str):
    """A prepared server-sent-events response for `gen`'s job (its id and timings in the
    headers), counted in `gateway_open_streams` while open; a client that goes away
    mid-stream (`ConnectionResetError` on a write) is counted and marked `CLIENT_GONE`
    (status 499), not raised."""
    m = ctx.metrics
    resp = web.StreamResponse(status=200, headers={**SSE_HEADERS, "X-Request-Id": gen.job_id,
                                                   "Server-Timing": gen.server_timing()})
    await resp.prepare(request)
    m.open_streams.inc()
    try:
        yield resp
    except ConnectionResetError:
        m.disconnects.labels(endpoint).inc()
        request[CLIENT_GONE] = True
    finally:
        m.open_streams.dec()


async def stream_choices(ctx: GatewayContext, request: web.Request, gens: list[Generation],
                         renderers: list[Renderer], t0: float, endpoint: str) -> web.StreamResponse:
    """The SSE response of started generations (one per choice): each choice's opener with
    its first token chunk, its token chunks as they come (interleaved), its final chunk;
    then the usage chunk (with `include_usage`) and `[DONE]`. An error of any choice (or
    the request's timeout) ends the stream with an error event. Time to first byte: the
    first chunk that carries a token. One choice's chunks are written as its events come;
    several choices' go through one queue, in the order they come."""
    m = ctx.metrics

    async with sse_response(ctx, request, gens[0], endpoint) as resp:
        first = True

        async def write(chunk: bytes) -> None:
            nonlocal first
            await resp.write(chunk)
            if first:
                first = False
                m.ttfb.labels(endpoint).observe(time.monotonic() - t0)

        tail = b""
        try:
            if len(gens) == 1:
                async with contextlib.aclosing(_choice_chunks(ctx, gens[0], renderers[0])) as chunks:
                    async for chunk in chunks:
                        await write(chunk)
            else:
                await _interleaved(ctx, gens, renderers, write)
            if renderers[0].include_usage:
                tail = renderers[0].usage_chunk(with_reasoning(merged_usage([g.finished.usage for g in gens]),
                                                               renderers))
        except ApiError as e:
            tail = error_event(e)
        except TimeoutError:
            for gen in gens:
                gen.cancel_reason = "timeout"
            tail = error_event(ApiError(504, "the request did not finish within gateway.request_timeout_s",
                                        code="timeout"))
        await resp.write(tail + DONE)
        if first:
            m.ttfb.labels(endpoint).observe(time.monotonic() - t0)
        await resp.write_eof()
    return resp


async def _choice_chunks(ctx: GatewayContext, gen: Generation, renderer: Renderer) -> AsyncIterator[bytes]:
    """One choice's SSE chunks: its opener riding with its first token, a chunk per delta
    that carries text or logprobs, its final chunk. Raises the choice's error (an
    unsuccessful end as `error_for_outcome`, a timeout) after yielding the opener if no
    chunk carried it yet (it precedes the error event)."""
    head = renderer.first_chunk() or b""
    try:
        async for d in gen.deltas():
            ctx.metrics.tokens.inc(d.num_tokens)
            if d.text or d.logprobs:  # else held back (a partial character, a stop string's start)
                chunk = renderer.token_chunk(d.text, d.logprobs, d.num_tokens)
                if chunk:  # (else a parser holds the text back: a tag's start)
                    yield head + chunk
                    head = b""
        fin = gen.finished
        if not fin.finish_reason.is_success:
            raise error_for_outcome(fin, ctx.cfg.retry_after_s)
    except Exception:
        if head:
            yield head
        raise
    yield head + renderer.final_chunks(fin, with_usage=False)


async def _interleaved(ctx: GatewayContext, gens: list[Generation], renderers: list[Renderer],
                       write: Callable[[bytes], Awaitable[None]]) -> None:
    """Several choices' chunks written in the order they come (each choice's in its
    order); the first choice's error cancels the others and propagates after the chunks
    queued before it are written."""
    queue: asyncio.Queue[bytes] = asyncio.Queue()

    async def pump(gen: Generation, renderer: Renderer) -> None:
        async for chunk in _choice_chunks(ctx, gen, renderer):
            queue.put_nowait(chunk)

    pumps = asyncio.ensure_future(all_or_none([pump(g, r) for g, r in zip(gens, renderers, strict=True)]))
    try:
        while not (pumps.done() and queue.empty()):
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait({getter, pumps}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                continue
            chunk = getter.result()
            if chunk:
                await write(chunk)
        pumps.result()  # raises a choice's error
    finally:
        pumps.cancel()
        await asyncio.gather(pumps, return_exceptions=True)
