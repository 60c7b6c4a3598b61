"""Requests on their way into the scheduler (the engine core's own, `core.py`): queued by
other threads since the last step, waiting outside the scheduler for their grammar to
compile, and the deadlines of every request not started yet.

    add (any thread) ──► queued ──► no grammar: Scheduler.add
                                └─► grammar: compiling ──► compiled: Scheduler.add
                                                       └─► failed: ends `rejected`
    a deadline passes while it waits (compiling or WAITING) ──► ends `expired`

A step never waits for a compile; aborts and deadlines reach a request while it waits.
Owned by the engine core, on its stepping thread (`add` excepted).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable

from worker.engine.outputs import EngineCoreOutput, EngineCoreRequest
from worker.engine.request import ErrorCode, RejectReason, Request, RequestStatus
from worker.engine.scheduler import Scheduler
from worker.engine.structured import GrammarCompiler, PendingGrammars

FinalOutput = Callable[..., EngineCoreOutput]  # EngineCore._final_output(req, new_ids, error=...)


class Arrivals:
    """Requests on their way into the scheduler, and the deadlines of those not started.

    Args:
        scheduler: where requests go once they can run.
        grammars: compiles the grammars of constrained requests; None: such a request
            ends `rejected`.
        new_request: the scheduler's `Request` for a validated request (the core's:
            arrival order, EOS ids, seeded generator).
        final_output: the output that ends a request (the core's).
    """

    def __init__(self, scheduler: Scheduler, grammars: GrammarCompiler | None,
                 new_request: Callable[[EngineCoreRequest], Request], final_output: FinalOutput) -> None:
        self.scheduler = scheduler
        self.compiling = PendingGrammars(grammars)  # requests waiting for their grammar
        self._new_request = new_request
        self._final_output = final_output
        self._queued: deque[EngineCoreRequest] = deque()
        self._deadlines: list[tuple[float, str]] = []  # (deadline, request id) heap

    def add(self, req: EngineCoreRequest) -> None:
        """Queue a validated request (any thread); it moves on at the next step."""
        self._queued.append(req)

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    def __bool__(self) -> bool:
        """Requests queued or compiling."""
        return bool(self._queued) or bool(self.compiling)

    def __len__(self) -> int:
        return len(self._queued) + len(self.compiling)

    def move_on(self, outputs: list[EngineCoreOutput]) -> None:
        """Queued requests into the scheduler (those with a grammar into compiling),
        compiled ones after them, then every request whose deadline passed ends."""
        while self._queued:
            r = self._queued.popleft()
            if r.grammar is None:
                self.scheduler.add(self._request(r))
            else:  # joins the scheduler once its grammar is compiled
                self.compiling.add(r)
                if r.options.deadline is not None:  # expires while it waits too
                    heapq.heappush(self._deadlines, (r.options.deadline, r.request_id))
        if self.compiling:
            self._admit_compiled(outputs)
        if self._deadlines and self._deadlines[0][0] < time.time():
            self._expire(outputs)

    def end_compiling(self, rid: str, status: RequestStatus, outputs: list[EngineCoreOutput],
                      error: tuple[str, str] | None = None) -> bool:
        """End a request still waiting for its grammar (abort, deadline); False if none."""
        if not self.compiling:
            return False
        r = self.compiling.pop(rid)
        if r is None:
            return False
        req = self._request(r)
        req.status = status
        outputs.append(self._final_output(req, [], error=error))
        return True

    def _request(self, r: EngineCoreRequest) -> Request:
        req = self._new_request(r)
        if r.options.deadline is not None:
            heapq.heappush(self._deadlines, (r.options.deadline, r.request_id))
        return req

    def _admit_compiled(self, outputs: list[EngineCoreOutput]) -> None:
        """Requests whose grammar is ready join the scheduler (in arrival order); one whose
        grammar failed to compile ends `rejected` (`invalid_structured_output`)."""
        for r, matcher, error in self.compiling.take_ready():
            req = self._request(r)
            if matcher is None:
                req.status = RequestStatus.FINISHED_REJECTED
                outputs.append(self._final_output(req, [], error=(RejectReason.INVALID_STRUCTURED_OUTPUT, error)))
            else:
                req.grammar = matcher
                req.note("grammar_ready")
                self.scheduler.add(req)

    def _expire(self, outputs: list[EngineCoreOutput]) -> None:
        """Requests never scheduled yet whose deadline passed end `expired` (KV untouched);
        a deadline does not cut a request that has started."""
        now = time.time()
        while self._deadlines and self._deadlines[0][0] < now:
            deadline, rid = heapq.heappop(self._deadlines)
            message = f"deadline {deadline} passed while the request waited"
            if self.end_compiling(rid, RequestStatus.FINISHED_EXPIRED, outputs, (ErrorCode.DEADLINE_PASSED, message)):
                continue
            req = self.scheduler.requests.get(rid)
            if req is None or req.status != RequestStatus.WAITING:
                continue
            self.scheduler.finish(rid, RequestStatus.FINISHED_EXPIRED)
            outputs.append(self._final_output(req, [], error=(ErrorCode.DEADLINE_PASSED, message)))
