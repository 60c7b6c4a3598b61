"""Steps in flight: how the engine core's asynchronous steps launch forwards ahead of the
host (`serving_tuning.async_scheduling`, after vLLM V1's async scheduling and SGLang's
overlap scheduler).

Sequentially one `step` is: apply queued work, schedule, forward, update, outputs, and
the device idles through everything but the forward. With asynchronous steps the core
keeps the device one step ahead of the host. One `step` call is:

    apply queued work (adds, deadlines, aborts) -> schedule N+1 and launch it behind N
    -> wait for N -> apply N (tokens, stops, prefix-cache blocks) -> N's outputs

so everything but the wait (applying N, building its outputs; detokenization in
`Engine.step`; encoding and the pipe in the engine process; scheduling N+2 at the next
call) runs while the device computes N+1. N+1 is scheduled before N's tokens are known,
on the assumption that every running request decodes one more token: a decode whose input
is N's token gets `PLACEHOLDER_TOKEN`, and the runner feeds it N's sampled id without a
round trip to the host (on CUDA the ids stay on the device; `Runner.launch`).

The rules that keep the output that of the sequential core:
  - Progress (`num_computed_tokens`) advances when a step is scheduled; the tokens a
    step in flight owes a request are counted (`num_output_placeholders`) and appended
    when the step is applied. A failed step and the one launched behind it are taken back
    (`Scheduler.unschedule`; the runner skips a step whose predecessor raised, so nothing
    it would compute, a seeded generator's draw included, happens) and the failed one
    follows the sequential failure rules with its placeholders resolved.
  - A request that ends at step N (EOS, a stop token id, a stop string found in output
    processing, an abort) may be computed once more in N+1: that token is dropped,
    never emitted and not counted in usage. Requests ending by length are not: the
    scheduler knows the token in flight is their last (`_may_schedule_ahead`).
  - An abort or a stop string frees the request's KV blocks at once (the next step
    boundary, as sequentially). That is safe with steps in flight because the device
    runs steps in launch order: a freed block is handed out only by a later schedule,
    whose step runs after every step already launched, so it never sees a stale write,
    and those steps read the block tables they were scheduled with (copies: a sliding
    window's freeing behind does not reach them).
  - A request preempted while a step computes for it gets that step's token (computed
    on its KV before the blocks were freed) and resumes only once the step is applied.
  - A constrained request (a grammar) is not scheduled ahead: its mask needs the grammar
    advanced by the token in flight, so it decodes every other step.
A request added between two `step` calls is scheduled at the next call and its first
token returned one call later than sequentially.

Where it pays: when the forward runs on a device (CUDA; the emulated device) the host
work runs beside it. On the CPU the forward of a small model is Python module calls on
the runner's forward thread, which trades the GIL with the host work, so there it
gained little or lost when measured (0.42-1.05x of sequential steps); unset, the setting
follows the runner's `capabilities.overlaps_host` (`ServingTuning.async_scheduling`).
"""

from __future__ import annotations

from worker.engine.outputs import ModelRunnerOutput, Runner, SchedulerOutput, StepHandle


def start_forward(runner: Runner, sched: SchedulerOutput, after: StepHandle | None = None) -> StepHandle:
    """`runner.launch(sched, after)`, or `execute` run now for a runner without `launch`;
    an exception either raises is kept for `result()`, where the failure rules handle it."""
    try:
        return runner.launch(sched, after) if runner.capabilities.async_launch else Ran(runner.execute(sched), None)
    except Exception as e:
        return Ran(None, e)


class Ran:
    """A forward that already ended, with the interface of the handle `runner.launch`
    returns (`result()` returns or raises what the forward did): for runners without
    `launch`, and for a launch that raised at once."""

    __slots__ = ("_out", "_exc")

    def __init__(self, out: ModelRunnerOutput | None, exc: Exception | None) -> None:
        self._out, self._exc = out, exc

    def result(self) -> ModelRunnerOutput:
        if self._exc is not None:
            raise self._exc
        return self._out
