"""Where asyncio tasks wait: each task's await chain down to the await that has not
returned, for diagnosing a stuck worker (SIGUSR1), a stop step left behind
(`worker.obs.stopping`) and a hung test (the suite's timeout dump, tests/timeouts.py).
Imports only the standard library."""

from __future__ import annotations


def task_stacks(loop=None) -> dict[str, list[str]]:
    """Every asyncio task of `loop` (default: the running loop) and its await chain,
    outermost first, innermost (the await that has not returned) last: one
    `file:line function` per coroutine, async generator (an `async with` of an
    `asynccontextmanager` included) and generator, and a last entry naming the future or
    task it waits on. For diagnosing a stuck worker (SIGUSR1) or a hung test (the
    suite's timeout dump). Safe to call from a signal handler on the loop's thread, or
    from another thread with `loop` given (racy there, diagnostics only)."""
    import asyncio

    out: dict[str, list[str]] = {}
    for t in asyncio.all_tasks(loop):
        out[f"{t.get_name()} ({_qualname(t.get_coro())})"] = await_chain(t.get_coro(), getattr(t, "_fut_waiter", None))
    return out


def await_chain(awaitable, waiter=None) -> list[str]:
    """The frames of a suspended coroutine's await chain, outermost first (`task_stacks`);
    `waiter`: the future its task is blocked on (`Task._fut_waiter`), named last."""
    frames: list[str] = []
    seen = 0
    node = awaitable
    while node is not None and seen < 200:
        seen += 1
        frame = getattr(node, "cr_frame", None) or getattr(node, "ag_frame", None) or getattr(node, "gi_frame", None)
        if frame is not None:
            code = frame.f_code
            frames.append(f"{code.co_filename}:{frame.f_lineno} {getattr(code, 'co_qualname', code.co_name)}")
        nxt = getattr(node, "cr_await", None) or getattr(node, "ag_await", None) or getattr(node, "gi_yieldfrom", None)
        if nxt is None:
            break
        kind = type(nxt).__name__
        if kind in ("async_generator_asend", "async_generator_athrow") and frame is not None:
            # `await agen.asend()` / `anext(agen)` hides the generator: find it among the
            # awaiting frame's locals (contextlib's `__aexit__` holds it as self.gen)
            nxt = _running_agen(frame) or nxt
        if not (hasattr(nxt, "cr_frame") or hasattr(nxt, "ag_frame") or hasattr(nxt, "gi_frame")):
            frames.append(f"waits on {describe_future(waiter) if waiter is not None else type(nxt).__name__}")
            break
        node = nxt
    return frames


def _running_agen(frame):
    candidates = list(frame.f_locals.values())
    holder = frame.f_locals.get("self")
    if holder is not None:
        candidates += [getattr(holder, name, None) for name in ("gen", "_agen", "agen")]
    for c in candidates:
        if getattr(c, "ag_running", False) or getattr(c, "ag_await", None) is not None:
            return c
    return None


def _qualname(coro) -> str:
    return getattr(coro, "__qualname__", None) or type(coro).__name__


def describe_future(fut) -> str:
    """One line naming a future: a task's name and coroutine, a gather's pending children."""
    import asyncio

    if isinstance(fut, asyncio.Task):
        return f"task {fut.get_name()!r} ({_qualname(fut.get_coro())})"
    children = getattr(fut, "_children", None)  # asyncio.gather's future
    if children is not None:
        pending = [c for c in children if not c.done()]
        return f"gather of {len(children)} ({len(pending)} pending: " + ", ".join(
            describe_future(c) for c in pending[:5]) + ")"
    callbacks = getattr(fut, "_callbacks", None) or ()
    return f"{type(fut).__name__} {'done' if fut.done() else 'pending'}" + (
        f", callbacks {[getattr(cb, '__qualname__', repr(cb))[:80] for cb, *_ in callbacks][:3]}" if callbacks else "")
