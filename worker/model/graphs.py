"""CUDA graphs of decode-only steps: a step of `n` decodes replays the graph captured for
the smallest batch-size bucket `>= n`, its inputs copied into the graph's static buffers
and the padding rows made harmless.

A decode step on a GPU is bound by kernel launches and Python at the batch sizes a
queue-fed fleet runs: a 32-layer model issues several hundred small kernels a step, each
a few microseconds of host time. Captured once per bucket (`torch.cuda.CUDAGraph`), the
whole forward (transformers' modules, eager or compiled, and our attention op) replays as
one launch. This is vLLM's full decode graph (`CUDAGraphMode.FULL` for uniform decode
batches, its `cudagraph_capture_sizes` 1, 2, 4, 8, then steps of 8) and SGLang's
`CudaGraphRunner`; prefill and mixed steps run as before.

What a replay reads is only what was captured: the addresses of the static buffers and
of the KV cache, and the kernels' launch configurations. So:

- every per-step value is a static buffer the step's values are copied into: input ids,
  positions, cache slots, block tables (the full width `ceil(max_model_len / block_size)`),
  context lengths, and (back ends that read them, `USES_DENSE_METADATA`) the decode
  mask; the query offsets and the logit rows kept are fixed ranges;
- padding rows (`n` up to the bucket) have slot -1 (the KV write skips it), context
  length 1 and block table row 0: they read one cached position and write nothing;
- the attention back end must launch from tensor values alone (`GRAPH_SAFE`): the Triton
  kernels read context lengths on the device; the split-K count of flash-decoding is
  fixed at capture for a context of `max_model_len` (its split of each context into
  chunks is computed in the kernel, so any shorter context stays exact).

Sampling runs after the replay, on the first `n` rows of the graph's logits, as for any
step; the asynchronous steps' placeholder ids are written into the step's input ids on
the device before they are copied in, so nothing waits for the host.

`replay="emulated"` (tests, the CPU) keeps every part of this except the CUDA capture:
"capturing" remembers the call with the static buffers, and a replay calls it again,
writing into the logits tensor the capture returned, so a value that did not go through
the static buffers is read stale, as a graph would read it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol

import torch

from worker.model.attention import AttentionMetadata, DecodeGroup, step_metadata

REPLAYS = ("cuda", "emulated")


class GraphedRunner(Protocol):
    """What the graphs use of the model runner (`worker.model.runner.ModelRunner`)."""

    device: torch.device
    block_size: int
    backend: ModuleType
    kv_caches: list[tuple[torch.Tensor, torch.Tensor] | None]
    compiled: bool
    forward_fn: Callable[..., Any]


def capture_sizes(max_batch: int) -> list[int]:
    """Batch-size buckets up to `max_batch` (vLLM's: 1, 2, 4, then multiples of 8),
    `max_batch` itself the last."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


class DecodeGraphs:
    """Graphs of `runner`'s forward for decode-only steps of 1 to `max_batch` requests.

    Args:
        runner: the model runner (its forward, KV caches, back end, device).
        max_batch: the largest decode batch captured (the scheduler's
            `max_running_requests`); larger steps run without a graph.
        max_model_len: the longest context, which sizes the block tables' width.
        replay: `cuda` (CUDA graphs) or `emulated` (module docstring).

    Raises:
        ValueError: `replay` unknown, `cuda` off a CUDA device, or a back end that is
            not `GRAPH_SAFE` with `cuda`.
    """

    def __init__(self, runner: GraphedRunner, max_batch: int, max_model_len: int, replay: str = "cuda") -> None:
        if replay not in REPLAYS:
            raise ValueError(f"replay must be one of {list(REPLAYS)}, got {replay!r}")
        if replay == "cuda" and (runner.device.type != "cuda" or not getattr(runner.backend, "GRAPH_SAFE", False)):
            raise ValueError(f"CUDA graphs need a CUDA device and a graph-safe attention back end "
                             f"(device {runner.device}, back end {runner.backend.__name__})")
        self.runner = runner
        self.replay = replay
        self.sizes = capture_sizes(max_batch)
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        bs, dev = runner.block_size, runner.device
        width = -(-max_model_len // bs)
        # inference tensors, as the runner's step inputs are (a compiled forward's guards tell them apart)
        with torch.inference_mode():
            self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
            self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
            self.slots = torch.full((max_batch,), -1, dtype=torch.int64, device=dev)
            self.block_tables = torch.zeros(max_batch, width, dtype=torch.int32, device=dev)
            self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
            self.query_start = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
            self.keep = torch.arange(max_batch, dtype=torch.long, device=dev)
            self.dense = getattr(runner.backend, "USES_DENSE_METADATA", True)
            self._positions_of_context = torch.arange(width * bs, device=dev)
            self.mask = torch.zeros(max_batch, 1, 1, width * bs, dtype=torch.bool, device=dev) if self.dense else None
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.memory_bytes = 0  # device memory the captured graphs hold (their pool), CUDA only

    def metadata(self, size: int) -> AttentionMetadata:
        """The step metadata of bucket `size`: views of the static buffers."""
        groups = [DecodeGroup(0, size, self.block_tables[:size], self.mask[:size])] if self.dense else []
        return AttentionMetadata(
            slot_mapping=self.slots[:size], num_decodes=size, decode_groups=groups, prefills=[],
            block_tables=self.block_tables[:size], seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start[: size + 1], max_query_len=1, max_seq_len=self.max_model_len,
            kv_caches=self.runner.kv_caches, backend=self.runner.backend, modules=self.runner.attention_modules,
            kv_scales=self.runner.kv_scales)

    def _forward(self, size: int, md: AttentionMetadata) -> torch.Tensor:
        runner = self.runner
        extra = {} if runner.compiled else {"inflight_metadata": md}
        ids, pos, keep = self.input_ids[:size].unsqueeze(0), self.positions[:size].unsqueeze(0), self.keep[:size]
        with step_metadata(md):
            out = runner.forward_fn(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep, **extra)
        return out.logits[0]  # [size, vocab]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (sharing one memory pool), with the
        buffers at their padding values.

        Raises:
            whatever the forward raises while it is captured (the caller falls back to
            steps without graphs).
        """
        t0 = time.perf_counter()
        self._reset_padding(0)
        if self.replay == "emulated":
            for size in self.sizes:
                md = self.metadata(size)
                logits = self._forward(size, md)

                def rerun(size=size, md=md, logits=logits) -> None:
                    logits.copy_(self._forward(size, md))

                self._graphs[size] = (rerun, logits)
            self.capture_seconds = time.perf_counter() - t0
            return
        dev = self.runner.device
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_reserved(dev)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(dev)
        for size in reversed(self.sizes):
            md = self.metadata(size)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):  # warm-up off the capture: lazy inits, autotuning, Triton's JIT
                self._forward(size, md)
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(size, md)
            self._graphs[size] = (graph.replay, logits)
        torch.cuda.synchronize(dev)
        self.memory_bytes = torch.cuda.memory_reserved(dev) - before
        self.capture_seconds = time.perf_counter() - t0

    def _reset_padding(self, start: int, end: int | None = None) -> None:
        """Rows `[start, end)` become padding: id and position 0, slot -1, context 1, block 0."""
        rows = slice(start, end)
        self.input_ids[rows].zero_()
        self.positions[rows].zero_()
        self.slots[rows].fill_(-1)
        self.seq_lens[rows].fill_(1)
        self.block_tables[rows].zero_()
        if self.mask is not None:
            self.mask[rows] = self._positions_of_context < 1

    def fits(self, num_decodes: int, num_scheduled: int, num_sampled: int) -> bool:
        """Whether a step replays a graph: decodes only, each sampling, at most `max_batch`."""
        return 0 < num_decodes == num_scheduled == num_sampled <= self.max_batch and bool(self._graphs)

    def run(self, input_ids: torch.Tensor, position_ids: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Replay the bucket of this decode-only step.

        Args:
            input_ids, position_ids: `[n]` (on the device; placeholders already filled).
            md: the step's metadata (`ModelRunner.build_metadata`): its slots `[n]`, block
                tables `[n, blocks]` and context lengths `[n]` are copied in.

        Returns:
            logits `[n, vocab]`, a view of the graph's output (valid until the next replay).
        """
        n = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        replay, logits = self._graphs[size]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(position_ids)
        self.slots[:n].copy_(md.slot_mapping)
        width = md.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(md.block_tables)
        self.seq_lens[:n].copy_(md.seq_lens)
        if self.mask is not None:
            self.mask[:n, 0, 0] = self._positions_of_context < self.seq_lens[:n, None]
        if n < size:
            self._reset_padding(n, size)
        replay()
        return logits[:n]


def graph_memory_estimate(max_batch: int, vocab_size: int, hidden_size: int, intermediate_size: int) -> int:
    """Bytes to leave free for the graphs' memory pool when sizing the KV cache: the
    largest bucket's fp32 logits twice (the head's output and its float copy) and its
    activations (hidden and MLP widths, a few live at once), doubled for the allocator's
    rounding. An estimate; `DecodeGraphs.memory_bytes` is what capture took."""
    per_row = 2 * vocab_size + 8 * hidden_size + 4 * intermediate_size
    return 2 * max_batch * per_row * 4
