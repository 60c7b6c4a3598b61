"""Bounded stops: every step of a `stop()` / `close()` of the worker, the gateway and the
clients ends within a stated time, whatever the awaited call does, and one log line names
a step that did not. Imports only the standard library and structlog (the client and the
gateway use it too).

Why not `asyncio.wait_for`: on Python 3.11, when its time is up it cancels the inner call
and then waits for that call to finish, so a call that swallows or delays its
cancellation (a `finally:` that awaits a dead connection, a library that catches
`CancelledError`) holds the stop for ever; and a cancellation of the caller that arrives
as the inner call completes is lost (python/cpython#86296), so a loop around it may never
stop. `stop_within` waits on its own task with `asyncio.wait`, which returns at the
deadline whatever the task does; a task that still runs after its cancellation and a
short grace is left behind, referenced in `ABANDONED` and named in the log.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import structlog

log = structlog.get_logger(__name__)

CANCEL_GRACE_S = 1.0  # after the cancel, how long a step may take to unwind, seconds

START_UNWIND_S = 10.0  # a start cancelled by a stop: how long it may take to unwind, seconds

ABANDONED: set[asyncio.Task] = set()  # steps left running past their bound (kept referenced)


def honour_cancellation() -> None:
    """Raise `CancelledError` when the current task was asked to stop but a call it awaited
    swallowed the cancellation (a library that catches `CancelledError`, or
    python/cpython#86296): the request is still counted (`Task.cancelling()`), so a
    background loop that calls this at the top of each round stops there instead of
    running on past its stop (seen: the readiness checks ran 12 s past a drain's cancel,
    aiokafka's offset lookup having swallowed it)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def stop_within(what: str, aw: Awaitable[Any], timeout_s: float) -> bool:
    """Await `aw` (a coroutine or future) for at most `timeout_s` seconds, then cancel it
    and wait at most `CANCEL_GRACE_S` seconds more; what still runs after that is left
    behind. An exception raised by `aw` is logged and swallowed: a stop goes on with its
    next step. `what` names the step in the log (`"gateway: Redis client close"`).

    Returns:
        True when `aw` completed without an exception within `timeout_s`.

    Raises:
        asyncio.CancelledError: the caller was cancelled (`aw` is cancelled too).
    """
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
        if not done:
            ABANDONED.add(task)
            task.add_done_callback(ABANDONED.discard)
            log.warning("stop step did not end within its bound; left behind", step=what, bound_s=timeout_s,
                        waiting_in=_innermost(task))
            return False
        log.warning("stop step did not end within its bound; cancelled", step=what, bound_s=timeout_s)
        _retrieve(task)
        return False
    if task.cancelled():
        log.warning("stop step was cancelled from inside", step=what)
        return False
    exc = task.exception()
    if exc is not None:
        log.warning("stop step failed; stopping anyway", step=what, error=f"{type(exc).__name__}: {exc}"[:300])
        return False
    return True


async def start_unless_stopped(start: Awaitable[Any], stop: asyncio.Event, what: str) -> bool:
    """Await `start` unless `stop` is set first; then cancel it and wait for it to unwind.

    The worker and the gateway install their SIGTERM/SIGINT handlers (which set `stop`)
    before they start, so a stop that arrives during a slow start (a model load, a broker
    still electing its coordinator: Kubernetes sends SIGTERM whenever a rollout or a scale-in
    decides) ends the start and lets the caller close what it built, instead of the
    signal's default action killing the process half-started. An unwind that takes longer
    than `START_UNWIND_S` is left behind, as in `stop_within` (a model load in a thread runs
    to its end there; the process exits after it).

    Returns:
        True when `start` completed, False when `stop` came first (the caller closes).

    Raises:
        the exception `start` raised, when it failed before `stop` was set.
    """
    task = asyncio.ensure_future(start)
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        waiter.cancel()
    if task.done():
        task.result()
        return True
    log.info("stop requested during start; cancelling the start", component=what)
    await stop_within(f"{what}: cancel the start", _cancelled(task), START_UNWIND_S)
    return False


async def _cancelled(task: asyncio.Task) -> None:
    """Cancel `task` and wait for it; whatever it ends with is swallowed (the start is abandoned)."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # marks it retrieved: no "exception was never retrieved" at exit


def _innermost(fut: asyncio.Future) -> str:
    """The last three awaits of a task's chain, innermost first; a gather's pending tasks."""
    from worker.obs.stacks import await_chain, describe_future

    if not isinstance(fut, asyncio.Task):
        return describe_future(fut)
    chain = await_chain(fut.get_coro(), getattr(fut, "_fut_waiter", None))
    return " <- ".join(reversed(chain[-3:])) if chain else repr(fut)
