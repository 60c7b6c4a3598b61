"""A forward in flight: what the engine core's asynchronous steps hold between launching a
step and collecting it (`runner.launch`'s future, or a forward that already ended).

Asynchronous steps (`serving_tuning.async_scheduling`, after vLLM's async scheduling and
SGLang's overlap scheduler). Sequentially one `step` is: apply queued work, schedule,
forward, update, outputs, and the device idles through everything but the forward. With
asynchronous steps the forward runs on the runner's own thread (`runner.launch`) and one
`step` call is:

    wait for step N's forward -> apply finishes and aborts -> update from N's tokens ->
    apply adds, deadlines -> schedule N+1 -> launch N+1 -> build N's outputs, return them

so everything after the launch (building outputs here; detokenization in `Engine.step`;
encoding and the pipe in the engine process) runs while the device computes N+1. Step
N+1 is scheduled from N's real tokens, so the schedule, the tokens and the preemptions
are those of the sequential core: nothing is computed speculatively. What changes:
`finish` (stop strings) and `abort` take effect at the next boundary, after the forward
in flight, whose token for that request is then dropped (never emitted, not counted);
so an aborted request's KV blocks are free at the end of the step in flight when the
abort arrives, the same bound as sequentially (the next step boundary); and a request
added between two `step` calls starts one step later (the step after next is the one
being scheduled).

Where it pays: when the forward thread mostly waits for a device (CUDA; the emulated
device) it releases the GIL and the host work runs beside it. On the CPU both threads
run Python (the forward of a small model is mostly module calls) and trade the GIL, so
there it gains little or loses (measured 0.42-1.05x of sequential steps); unset, the setting
follows the runner's `overlaps_host` (`ServingTuning.async_scheduling`).
"""

from __future__ import annotations

from typing import Any

from worker.engine.outputs import ModelRunnerOutput, Runner, SchedulerOutput


def start_forward(runner: Runner, sched: SchedulerOutput) -> Any:
    """`runner.launch(sched)`, or `execute` run now for a runner without `launch`; an
    exception either raises is kept for `result()`, where the failure rules handle it."""
    launch = getattr(runner, "launch", None)
    try:
        return launch(sched) if launch is not None else Ran(runner.execute(sched), None)
    except Exception as e:
        return Ran(None, e)


class Ran:
    """A forward that already ended, with the interface of the future `runner.launch`
    returns (`result()` returns or raises what the forward did): for runners without
    `launch`, and for a launch that raised at once."""

    __slots__ = ("_out", "_exc")

    def __init__(self, out: ModelRunnerOutput | None, exc: Exception | None) -> None:
        self._out, self._exc = out, exc

    def result(self) -> ModelRunnerOutput:
        if self._exc is not None:
            raise self._exc
        return self._out
