"""A step's result on its way to the host: `SampledStep` (the sampled ids, still on the
device, and what each request keeps of them) and `LaunchedStep` (a step running on the
model runner's forward thread: `ModelRunner.launch`)."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from worker.engine.outputs import ModelRunnerOutput, StepSkipped, TokenLogprobs


class SampledStep:
    """A step's sampled ids, still on the device (`token_ids`, one per sampled row), with
    the requests' ids and each request's rows (`spans`: first row and how many it keeps;
    None: one row each, in order); `output()` brings them to the host. On CUDA the copy
    is queued at once, right behind the sampling on the same stream, into pinned memory,
    and `output()` waits for that copy alone (an event), not for the steps queued after it."""

    __slots__ = ("request_ids", "_ids", "_ready", "logprobs", "mask_s", "spans", "kv_copy_s")

    def __init__(self, request_ids: list[str], token_ids: torch.Tensor | None,
                 logprobs: list[TokenLogprobs | None], mask_s: float,
                 spans: list[tuple[int, int]] | None = None) -> None:
        self.request_ids = request_ids
        self.logprobs = logprobs
        self.mask_s = mask_s
        self.spans = spans
        self.kv_copy_s = 0.0  # the step's host-tier copies (set by the runner)
        self._ready = None
        if token_ids is not None and token_ids.is_cuda:
            token_ids = token_ids.to("cpu", non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        self._ids = token_ids

    def output(self) -> ModelRunnerOutput:
        if self._ids is None:
            return ModelRunnerOutput(sampled_token_ids={}, kv_copy_s=self.kv_copy_s)
        if self._ready is not None:
            self._ready.synchronize()  # releases the GIL while it waits
        ids = self._ids.tolist()
        lps = self.logprobs
        spans = self.spans or [(i, 1) for i in range(len(self.request_ids))]
        return ModelRunnerOutput(
            sampled_token_ids={rid: ids[r: r + n] for rid, (r, n) in zip(self.request_ids, spans)},
            logprobs={rid: lps[r: r + n] for rid, (r, n) in zip(self.request_ids, spans) if lps[r] is not None},
            mask_s=self.mask_s,
            kv_copy_s=self.kv_copy_s,
        )


class LaunchedStep:
    """A step on the runner's forward thread (`ModelRunner.launch`)."""

    __slots__ = ("_future",)

    def __init__(self, future: Future[SampledStep]) -> None:
        self._future = future

    def result(self) -> ModelRunnerOutput:
        return self._future.result().output()

    def failed(self) -> bool:
        """Whether the step raised (waits for it), being skipped aside."""
        e = self._future.exception()
        return e is not None and not isinstance(e, StepSkipped)
