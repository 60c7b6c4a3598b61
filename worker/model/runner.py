"""Model runner: turns a SchedulerOutput into one packed forward and sampled tokens.

Owns the KV cache tensors (one K and one V tensor per layer, preallocated). Runs on
the engine thread only.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from worker.engine.outputs import (
    PLACEHOLDER_TOKEN,
    ModelRunnerOutput,
    RunnerCapabilities,
    ScheduledRequest,
    SchedulerOutput,
    StepSkipped,
)
from worker.model.attention import (
    AttentionMetadata,
    DecodeGroup,
    NativeLayers,
    PrefillSpan,
    attention_modules,
    native_attention_step,
    native_layers,
    step_metadata,
)
from worker.model.capability import KVLayout, LayerKV
from worker.model.graphs import DecodeGraphs
from worker.model.host_kv import HostKVBuffers, cache_tensors
from worker.model.input_batch import BlockTableBuffer, step_positions
from worker.model.kernels.kv_int8 import allocate_scales
from worker.model.lora import LoRAStep, LoRAWeights, build_step, lora_step
from worker.model.masks import fill_beside_forward, start_token_bitmask
from worker.model.recurrent import RecurrentStep, StateLayout, StatePool
from worker.model.sampler import sample_on_device, verify_drafts
from worker.model.step_result import LaunchedStep, SampledStep

log = logging.getLogger(__name__)
# torch >= 2.5 exposes the CUDA OOM as torch.OutOfMemoryError (alias of torch.cuda.OutOfMemoryError)
OutOfMemoryError = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class ModelRunner:
    """Runs one transformers model over the paged KV cache.

    Args:
        model: a transformers CausalLM loaded with `attn_implementation="inflight_paged"`.
        num_blocks, block_size: KV cache geometry.
        kv_layout: per layer the KV shape (`worker.model.capability.KVLayout`, measured at load).
        backend: attention back end module (see `worker.model.kernels`).
        kv_int8: the KV cache in int8 with per-token-head scales (`kernels/kv_int8.py`);
            else in `dtype`.
        state_layout, state_slots: the recurrent mixers' per-request states
            (`worker.model.recurrent`) and how many requests hold them at once (the
            engine's `max_running_requests`); none when the layout is empty.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_blocks: int,
        block_size: int,
        kv_layout: KVLayout,
        device: torch.device,
        dtype: torch.dtype,
        backend: ModuleType,
        kv_int8: bool = False,
        state_layout: StateLayout | None = None,
        state_slots: int = 0,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        # the forward thread mostly waits for the device (kernels queued, the GIL released
        # in the sync), so the engine core's asynchronous steps overlap host work with it
        self.overlaps_host = device.type == "cuda"
        self.state_pool = (StatePool(state_layout, state_slots, device)
                           if state_layout is not None and state_layout.specs else None)
        # a recurrent state cannot take back rejected guesses: no speculation for such models
        self.capabilities = RunnerCapabilities(async_launch=True, device_time=True, overlaps_host=self.overlaps_host,
                                               speculation=self.state_pool is None,
                                               state_slots=self.state_pool.num_slots if self.state_pool else 0)
        self.backend = backend
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        # logit rows of the vocabulary (structured-output masks are sized before the forward)
        self._vocab_size = getattr(head, "out_features", None) or getattr(getattr(model, "config", None), "vocab_size", 0)
        self.kv_layout = kv_layout
        kv_dtype = torch.int8 if kv_int8 else dtype  # int8: a scale per token and head beside (kernels/kv_int8.py)
        self.kv_caches = [
            None if layer is None else self.allocate_layer(layer, num_blocks, block_size, device, kv_dtype)
            for layer in kv_layout.layers
        ]
        self.kv_scales = [
            None if layer is None else tuple(allocate_scales(num_blocks, block_size, layer.num_kv_heads, device)
                                             for _ in "kv")
            for layer in kv_layout.layers
        ] if kv_int8 else None
        self._forward_thread: ThreadPoolExecutor | None = None  # made by the first launch
        self.block_table_buffer = BlockTableBuffer()  # the requests' block tables, updated by diffs (input_batch.py)
        self._busy_s = 0.0  # device time of the steps measured so far
        self._pending_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # CUDA: the last step's
        # the last step's sampled ids (on the device) and their row per request: the next
        # step's placeholder inputs (written and read on the thread that runs the steps)
        self._last_sampled: tuple[torch.Tensor, dict[str, int]] = (torch.empty(0, dtype=torch.long), {})
        self.lora: LoRAWeights | None = None  # the adapters' slots (model.lora_dir), set by the Engine
        self.forward_fn = model  # what a step calls: the model, or its compiled forward (`compile`)
        self.compiled = False
        self.compile_error: Exception | None = None  # what made the compiled forward go eager, if it did
        # the compiled forward's attention modules by layer_idx, handed to its ops in each step's metadata
        self.attention_modules: dict[int, torch.nn.Module] | None = None
        # the caches the compiled forward's C++ attention op takes in steps of decodes and short chunks (`compile`)
        self.native_layers: NativeLayers | None = None
        self.graphs: DecodeGraphs | None = None  # decode-only steps replayed from graphs (`capture_graphs`)
        self.host_kv: HostKVBuffers | None = None  # the host-memory KV tier (`allocate_host_kv`)

    def allocate_host_kv(self, num_slots: int) -> HostKVBuffers:
        """Allocate the host-memory KV tier: `num_slots` blocks of every cache tensor
        (`worker.model.host_kv`); each step runs its `kv_copies` before its forward from
        now on, and `capabilities.host_kv_slots` says how many slots there are."""
        self.host_kv = HostKVBuffers(cache_tensors(self.kv_caches, self.kv_scales), num_slots)
        self.capabilities = dataclasses.replace(self.capabilities, host_kv_slots=num_slots,
                                                host_kv_slot_bytes=self.host_kv.bytes_per_slot)
        return self.host_kv

    def compile(self, artifacts: Path | None = None) -> None:
        """Run the forward compiled from now on (`worker.model.compiled`): captured ahead of
        time under `artifacts` (or loaded from there) where this device and torch allow
        it, else `torch.compile`. The graph is built by the next step (the warm-up of
        `worker.engine.compile.compile_engine`).

        Raises:
            ValueError: two attention modules share a `layer_idx` (`attention_modules`).
        """
        from worker.model import compiled

        self.attention_modules = attention_modules(self.model)
        self.native_layers = native_layers(self.kv_caches, self.kv_scales, self.attention_modules, self.backend)
        if artifacts is not None and compiled.precompile_available(self.device.type):
            self.forward_fn = compiled.PrecompiledForward(self.model, artifacts)
        else:
            self.forward_fn = compiled.CompiledForward(self.model)
        self.compiled = True

    def uncompile(self) -> None:
        """Back to the eager forward."""
        self.forward_fn = self.model
        self.compiled = False
        self.attention_modules = None
        self.native_layers = None

    def capture_graphs(self, max_batch: int, max_model_len: int, replay: str = "cuda") -> DecodeGraphs:
        """Capture the forward (as it is now: compiled or eager) as decode graphs for 1 to
        `max_batch` requests (`worker.model.graphs.DecodeGraphs`); decode-only steps
        replay them from now on.

        Raises:
            ValueError: see `DecodeGraphs`; whatever the forward raises while captured
                (no graphs are kept then).
        """
        graphs = DecodeGraphs(self, max_batch, max_model_len, replay)
        graphs.capture()
        self.graphs = graphs
        return graphs

    def drop_graphs(self) -> None:
        """Decode steps run the forward again (and the graphs' memory is released)."""
        self.graphs = None

    @staticmethod
    def allocate_layer(layer: LayerKV, num_blocks: int, block_size: int, device: torch.device,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's `(k_cache, v_cache)`: `[num_blocks, block_size, num_kv_heads, head_dim]`
        and `[..., v_head_dim]`; the value is a view of the key's first channels when the
        layout says `value_in_key` (latent attention)."""
        k = torch.zeros((num_blocks, block_size, layer.num_kv_heads, layer.head_dim), dtype=dtype, device=device)
        if layer.value_in_key:
            return k, k[..., : layer.v_head_dim]
        v = torch.zeros((num_blocks, block_size, layer.num_kv_heads, layer.v_head_dim), dtype=dtype, device=device)
        return k, v

    def build_metadata(
        self, sched: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[ScheduledRequest]]:
        """Pack the step.

        Decodes are packed longest context first and split into groups whose padded
        context is at most twice the shortest one, so the reference back end gathers
        little padding.

        Returns:
            (input_ids `[N]`, positions `[N]`, metadata, rows to sample, the scheduled
            requests in packed order).
        """
        bs = self.block_size
        dev = self.device
        nd = sched.num_decodes
        packed = sorted(sched.scheduled[:nd], key=lambda s: -s.start_pos) + sched.scheduled[nd:]
        token_ids: list[int] = []
        starts: list[int] = []
        lengths: list[int] = []
        num_rows: list[int] = []  # rows each request samples (0, 1, or 1 + k when it speculates)
        request_ids: list[str] = []
        tables: list[list[int]] = []
        holes: list[int] = []  # flat positions of placeholder inputs
        hole_ids: list[str] = []
        for s in packed:  # one light pass per request; the per-token work is numpy's below
            ids = s.token_ids
            if ids[-1] == PLACEHOLDER_TOKEN:
                holes.append(len(token_ids) + len(ids) - 1)
                hole_ids.append(s.request_id)
            token_ids += ids
            starts.append(s.start_pos)
            lengths.append(len(ids))
            num_rows.append(1 + len(s.draft) if s.samples_token else 0)
            request_ids.append(s.request_id)
            tables.append(s.block_ids)
        starts_np = np.array(starts, dtype=np.int64)
        lengths_np = np.array(lengths, dtype=np.int64)
        rows = self.block_table_buffer.rows(request_ids, tables)
        positions, owner = step_positions(starts_np, lengths_np)
        table = self.block_table_buffer.table
        slots = table[rows[owner], positions // bs] * bs + positions % bs
        ends = np.cumsum(lengths_np)
        query_start = [0, *ends.tolist()]
        rows_np = np.array(num_rows, dtype=np.int64)
        sample_idx = (np.arange(int(rows_np.sum()), dtype=np.int64)
                      + np.repeat(ends - np.cumsum(rows_np), rows_np)).tolist()  # each sampling request's last rows
        seq_lens_np = starts_np + lengths_np
        max_blocks = int(self.block_table_buffer.num_blocks(rows).max())
        # blocks freed behind a sliding window (-1) read as block 0, masked out
        block_tables = torch.from_numpy(self.block_table_buffer.gather(rows, max_blocks)).clamp_(min=0)
        seq_lens_t = torch.from_numpy(seq_lens_np)
        build_dense = None
        if getattr(self.backend, "USES_DENSE_METADATA", True):  # kernel back ends need only the tables
            # built by the first layer that reads them: none does when the C++ op takes every layer
            build_dense = functools.partial(self._dense_spans, packed, nd, seq_lens_t, query_start, block_tables)
        md = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(device=dev),
            num_decodes=nd,
            decode_groups=[],
            prefills=[],
            block_tables=block_tables.to(device=dev, dtype=torch.int32),
            seq_lens=seq_lens_t.to(device=dev, dtype=torch.int32),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            max_query_len=int(lengths_np[nd:].max()) if len(packed) > nd else 1,
            max_seq_len=int(seq_lens_np.max()),
            kv_caches=self.kv_caches,
            backend=self.backend,
            modules=self.attention_modules,
            kv_scales=self.kv_scales,
            recurrent=self._recurrent_step(packed, nd, query_start) if self.state_pool is not None else None,
            build_dense=build_dense,
        )
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
        if holes:  # decodes fed the previous step's tokens, where they are (on the device)
            self._fill_placeholders(input_ids, holes, hole_ids)
        position_ids = torch.from_numpy(positions).to(device=dev)
        return input_ids, position_ids, md, sample_idx, packed

    def _dense_spans(self, packed: list[ScheduledRequest], nd: int, seq_lens: torch.Tensor, query_start: list[int],
                     block_tables: torch.Tensor) -> tuple[list[DecodeGroup], list[PrefillSpan]]:
        """The reference back end's gathers: decodes (the first `nd` of `packed`, longest
        context first) in groups whose padded context is at most twice the shortest one
        (at least 4 a group), each with its tables and `[rows, 1, 1, context]` mask; each
        prefill chunk's span of the packed queries, with its context blocks and causal
        mask when it continues a request. `seq_lens` `[num_reqs]`: context per request."""
        bs, dev = self.block_size, self.device
        decode_groups = []
        first = 0
        while first < nd:
            nb = -(-int(seq_lens[first]) // bs)
            last = first + 1
            while last < nd and (last - first < 4 or -(-int(seq_lens[last]) // bs) * 2 > nb):
                last += 1
            decode_groups.append(self._decode_group(first, last, nb, block_tables, seq_lens))
            first = last
        prefills = []
        for i in range(nd, len(packed)):
            s = packed[i]
            q0, q1 = query_start[i], query_start[i + 1]
            if s.start_pos == 0:
                prefills.append(PrefillSpan(q0, q1, None, None))
                continue
            ctx = int(seq_lens[i])
            ctx_blocks = block_tables[i, : -(-ctx // bs)].to(dev)
            mask = torch.arange(ctx).unsqueeze(0) <= torch.arange(s.start_pos, ctx).unsqueeze(1)
            prefills.append(PrefillSpan(q0, q1, ctx_blocks, mask.to(dev)))
        return decode_groups, prefills

    def _decode_group(self, first: int, last: int, num_blocks: int, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor) -> DecodeGroup:
        """Decode rows `[first, last)` padded to `num_blocks` blocks (`DecodeGroup`): their
        tables cut there and the `[rows, 1, 1, context]` mask of the positions inside each
        row's context (`seq_lens` `[num_reqs]`), on the runner's device."""
        dev = self.device
        mask = torch.arange(num_blocks * self.block_size, device=seq_lens.device) < seq_lens[first:last].unsqueeze(1)
        return DecodeGroup(first, last, block_tables[first:last, :num_blocks].to(dev),
                           mask.view(last - first, 1, 1, -1).to(dev))

    def _recurrent_step(self, packed: list[ScheduledRequest], nd: int, query_start: list[int]) -> RecurrentStep:
        """The recurrent mixers' view of the step: each decode's and each prefill chunk's
        state slot (`ScheduledRequest.state_slot`, the scheduler's).

        Raises:
            RuntimeError: a scheduled request without a slot (a broken invariant)."""
        slots = [s.state_slot for s in packed]
        if min(slots, default=0) < 0:
            raise RuntimeError("a request of a model with recurrent state was scheduled without a state slot")
        decode_slots = torch.tensor(slots[:nd], dtype=torch.long, device=self.device)
        prefills = [(query_start[i], query_start[i + 1], slots[i], packed[i].start_pos == 0)
                    for i in range(nd, len(packed))]
        return RecurrentStep(self.state_pool, nd, decode_slots, prefills)

    def _fill_placeholders(self, input_ids: torch.Tensor, holes: list[int], hole_ids: list[str]) -> None:
        """Write into `input_ids` at flat positions `holes` the tokens the previous step
        sampled (on the device) for the requests `hole_ids`.

        Raises:
            RuntimeError: the previous step did not sample for one of them (a broken
                invariant of asynchronous steps)."""
        prev_ids, prev_rows = self._last_sampled
        try:
            rows = [prev_rows[rid] for rid in hole_ids]
        except KeyError as e:
            raise RuntimeError(f"placeholder input of request {e.args[0]!r}, which the previous step "
                               "did not sample for") from None
        input_ids[torch.tensor(holes, device=self.device)] = prev_ids[torch.tensor(rows, device=prev_ids.device)]

    def device_busy_s(self) -> float:
        """Seconds the device spent on this runner's steps (forward + sampling): CUDA
        events recorded around each step on a GPU (read once the step's tokens reached
        the host, so reading costs no sync); the steps' wall time on the CPU, where the
        cores are the device."""
        if self._pending_events is not None:
            start, end = self._pending_events
            if end.query():
                self._busy_s += start.elapsed_time(end) / 1000.0
                self._pending_events = None
        return self._busy_s

    def launch(self, sched: SchedulerOutput, after: LaunchedStep | None = None) -> LaunchedStep:
        """Start the step on the runner's forward thread and return at once (the engine
        core's asynchronous steps). Steps run one after another on that thread, each fed
        the ids its predecessor sampled for its placeholder inputs; a step launched
        `after` one that raised raises `StepSkipped` without computing. torch releases
        the GIL inside its kernels, so on the CPU the forward and the host work overlap on
        different cores; on CUDA the thread queues the kernels and goes on to the next
        step, and the sampled ids reach the host by an asynchronous copy that
        `result()` waits for (the device never waits for the host)."""
        if self._forward_thread is None:
            self._forward_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inflight-forward")
        return LaunchedStep(self._forward_thread.submit(self._run_after, sched, after))

    def _run_after(self, sched: SchedulerOutput, after: LaunchedStep | None) -> SampledStep:
        if after is not None and after.failed():  # done: launches run in order on this thread
            self._copy_kv(sched)  # registered blocks' content: moved whatever the forward does
            raise StepSkipped(f"step {sched.step} was launched behind a step that failed")
        return self._timed(self._execute, sched)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """One forward over the packed batch, then sampling for requests whose chunk ends
        their known tokens (device time accounted for `device_busy_s`)."""
        return self._timed(self._execute, sched).output()

    def greedy_steps(self, rows: list[ScheduledRequest], steps: int, step: int = 0) -> dict[str, list[int]]:
        """`steps` forwards of `rows`, each row fed its own argmax after the first: a
        draft model's guesses (`worker.engine.draft`), without the sampler, masks or
        adapters of `execute` (device time accounted the same way).

        Args:
            rows: chunks that end their request's known tokens (`samples_token`), one
                per request; each row's blocks must hold its next `steps - 1` positions.
            steps: forwards, at least 1.
            step: the step number of the batches (`SchedulerOutput.step`).

        Returns:
            per request id, the argmax of each forward (`steps` ids).
        """
        return self._timed(self._greedy_steps, rows, steps, step)

    @torch.inference_mode()
    def _greedy_steps(self, rows: list[ScheduledRequest], steps: int, step: int) -> dict[str, list[int]]:
        decodes = [s for s in rows if len(s.token_ids) == 1 and s.start_pos > 0]  # the runner's decode rows first
        rows = decodes + [s for s in rows if not (len(s.token_ids) == 1 and s.start_pos > 0)]
        nd = len(decodes)
        sched = SchedulerOutput(step=step, scheduled=rows, num_decodes=nd,
                                num_scheduled_tokens=sum(len(s.token_ids) for s in rows))
        input_ids, position_ids, md, sample_idx, packed = self.build_metadata(sched)
        keep = torch.tensor(sample_idx, device=self.device)
        # from the second forward on every row is a one-token decode of its own argmax
        later = self._decode_steps(md, steps - 1) if steps > 1 else []
        every_row = torch.arange(len(packed), device=self.device) if later else None
        guesses = []
        for i in range(steps):
            if i:
                (position_ids, md), input_ids, keep, nd = later[i - 1], guesses[-1], every_row, len(packed)
            graphs = self.graphs
            if graphs is not None and graphs.fits(nd, len(packed), len(packed)):
                logits = graphs.run(input_ids, position_ids, md)
            else:
                logits = self._forward(input_ids, position_ids, md, keep, None)
            guesses.append(logits.argmax(dim=-1))
        ids = torch.stack(guesses, dim=1).tolist()  # [rows, steps]: one copy to the host for all of them
        return {s.request_id: row for s, row in zip(packed, ids)}

    def _decode_steps(self, md: AttentionMetadata, steps: int) -> list[tuple[torch.Tensor, AttentionMetadata]]:
        """The positions `[rows]` and metadata of each of the `steps` steps after `md` in
        which each of its sequences decodes one token, at its context length and on:
        computed at once from `md`'s block tables and context lengths, on the device, with
        no per-request work on the host (whose blocks must hold those positions). The
        reference back end's gathers (`AttentionMetadata.dense`) are one decode group."""
        bs, tables = self.block_size, md.block_tables
        rows, dev = tables.shape[0], tables.device
        positions = md.seq_lens.long().unsqueeze(0) + torch.arange(steps, device=dev).unsqueeze(1)  # [steps, rows]
        blocks = tables.gather(1, (positions // bs).t()).t()  # a transposed view: each step's row made contiguous
        slots = (blocks.long() * bs + positions % bs).contiguous()  # (the C++ op takes contiguous slots only)
        seq_lens = (positions + 1).to(torch.int32)
        query_start = torch.arange(rows + 1, dtype=torch.int32, device=dev)
        dense = getattr(self.backend, "USES_DENSE_METADATA", True)

        def one_group(lens: torch.Tensor, longest: int) -> tuple[list[DecodeGroup], list[PrefillSpan]]:
            return [self._decode_group(0, rows, -(-longest // bs), tables, lens)], []

        out = []
        for i in range(steps):
            longest = md.max_seq_len + 1 + i
            out.append((positions[i], dataclasses.replace(
                md, slot_mapping=slots[i], num_decodes=rows, decode_groups=[], prefills=[], seq_lens=seq_lens[i],
                query_start_loc=query_start, max_query_len=1, max_seq_len=longest,
                build_dense=functools.partial(one_group, seq_lens[i], longest) if dense else None)))
        return out

    def _timed(self, run, *args):
        """`run(*args)`, its device time added to `device_busy_s`."""
        if self.device.type == "cuda":
            self.device_busy_s()  # fold the previous step in before its events are replaced
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return run(*args)
            finally:
                end.record()
                self._pending_events = (start, end)
        t0 = time.perf_counter()
        try:
            return run(*args)
        finally:
            self._busy_s += time.perf_counter() - t0

    @torch.inference_mode()
    def _copy_kv(self, sched: SchedulerOutput) -> float:
        """Run the step's host-tier copies (before anything else of it); their seconds."""
        if not sched.kv_copies:
            return 0.0
        before = self.host_kv.copy_s
        self.host_kv.apply(sched.kv_copies)
        return self.host_kv.copy_s - before

    @torch.inference_mode()
    def _execute(self, sched: SchedulerOutput) -> SampledStep:
        copy_s = self._copy_kv(sched)
        step = self._execute_forward(sched)
        step.kv_copy_s = copy_s
        return step

    def _execute_forward(self, sched: SchedulerOutput) -> SampledStep:
        input_ids, position_ids, md, sample_idx, packed = self.build_metadata(sched)
        # A step of only partial prefill chunks still computes one (discarded) logit row.
        keep = torch.tensor(sample_idx or [0], device=self.device)
        sampling_reqs = [s for s in packed if s.samples_token]
        speculating = len(sample_idx) > len(sampling_reqs)
        if speculating:  # a speculating decode samples a row per position (its draft's verification)
            sampling_reqs = [row for s in sampling_reqs
                             for row in (s.verify_rows(s.params.reads_history) if s.draft else (s,))]
        if any(s.has_placeholder and s.params.reads_history for s in sampling_reqs):
            sampling_reqs = self._resolve_for_penalty(sampling_reqs)
        # structured-output masks: filled on their own thread while this one runs the forward
        # where a core is left for it (`fill_beside_forward`), else after the forward
        masks = (start_token_bitmask(sampling_reqs, self._vocab_size, self.device)
                 if sample_idx and fill_beside_forward(self.device) else None)
        lora = None
        if sched.loras:  # slots first filled with their adapters' weights, then the tokens' grouping
            for slot, adapter in sched.loras.items():
                self.lora.fill(slot, adapter.load_id, adapter.weights)
            lora = build_step([s.lora_slot for s in packed for _ in range(s.num_tokens)], self.device,
                              self.lora.max_loras)
            if lora is not None:
                lora.bind(self.lora)
        graphs = self.graphs  # never set with LoRA adapters (worker.engine.compile.graphs_wanted)
        if graphs is not None and lora is None and graphs.fits(sched.num_decodes, len(packed), len(sample_idx)):
            logits = graphs.run(input_ids, position_ids, md)  # [num_decodes, vocab]
        else:
            logits = self._forward(input_ids, position_ids, md, keep, lora)
        if not sample_idx:
            self._last_sampled = (input_ids[:0], {})
            return SampledStep([], None, [], 0.0)
        timing: dict[str, float] = {}
        if not speculating:
            token_ids, logprobs = sample_on_device(logits, sampling_reqs, timing, masks)
            self._last_sampled = (token_ids, {s.request_id: i for i, s in enumerate(sampling_reqs)})
            return SampledStep([s.request_id for s in sampling_reqs], token_ids, logprobs, timing.get("mask_s", 0.0))
        reqs = [s for s in packed if s.samples_token]
        token_ids, logprobs, spans = verify_drafts(logits, reqs, sampling_reqs, timing, masks)
        self._last_sampled = (token_ids, {s.request_id: r0 for s, (r0, _) in zip(reqs, spans) if not s.draft})
        return SampledStep([s.request_id for s in reqs], token_ids, logprobs, timing.get("mask_s", 0.0), spans)

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, md: AttentionMetadata,
                 keep: torch.Tensor, lora: LoRAStep | None) -> torch.Tensor:
        """The model's forward over the packed step: logits `[len(keep), vocab]`."""
        # the compiled forward reads the metadata in its attention ops (an argument would be a graph input)
        extra = {} if self.compiled else {"inflight_metadata": md}
        ids2d, pos2d = input_ids.unsqueeze(0), position_ids.unsqueeze(0)
        # native_layers: set while compiled (only a compiled graph calls the C++ op)
        with step_metadata(md), lora_step(lora), native_attention_step(md, self.native_layers):
            try:
                out = self.forward_fn(input_ids=ids2d, position_ids=pos2d, use_cache=False, logits_to_keep=keep,
                                      **extra)
            except Exception as e:
                if not self.compiled or isinstance(e, OutOfMemoryError):
                    raise
                # the compiled forward failed while serving: eager for good, and this step again (the
                # layers that ran wrote the same K/V the eager forward writes)
                log.error("the compiled forward failed (%s: %s); the forward is eager from now on",
                          type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "")
                self.uncompile()
                self.compile_error = e
                out = self.model(input_ids=ids2d, position_ids=pos2d, use_cache=False, logits_to_keep=keep,
                                 inflight_metadata=md)
        return out.logits[0]

    def _resolve_for_penalty(self, reqs: list[ScheduledRequest]) -> list[ScheduledRequest]:
        """Rows with a penalty and a placeholder input get their history with the token in
        flight (`ScheduledRequest.resolved`): the penalties read the whole history."""
        prev_ids, prev_rows = self._last_sampled
        return [s.resolved(int(prev_ids[prev_rows[s.request_id]]))
                if s.has_placeholder and s.params.reads_history else s for s in reqs]
