"""GPU check of the Triton back end, one command, under 5 minutes on one H100/H200:

  1. correctness: Triton KV write and paged attention vs the torch reference on the GPU
     (bf16 and fp16; decodes, chunked prefills, GQA 1/4/8, head dims 64/128, block sizes
     16/32), max abs error against an fp32 reference;
  2. decode attention bandwidth: batch 64, context 2048, bf16, 32 query / 8 KV heads,
     head dim 128: K/V bytes read per second, and % of the card's peak HBM bandwidth
     (from NVML memory clock x bus width, else a table); and batch 4 at context 16384,
     which takes the split-K (flash-decoding) path;
  3. prefill attention TFLOP/s at a few (batch, length) sizes (causal, 4·H·D·L(L+1)/2 FLOPs);
  3b. quantized linear layers (4096 x 4096; 1-256 rows): W8A8 through `torch._int_mm` (16
     rows and fewer padded), int8 / int4 weight-only through the Triton dequantize-in-the-
     matmul kernel (`kernels/triton_quant.py`), each against the float64 arithmetic of its
     integers, and timed against the bf16 layer; and FP8-dynamic through `torch._scaled_mm`;
  3c. the int8 KV cache in the Triton kernels (write and attention) against the reference;
  3d. recurrent-state and hybrid models (tiny Mamba, Mamba-2, Jamba, Bamba, Qwen3-Next,
      Zamba2): the engine's greedy ids against transformers' `generate` on the device;
  4. the engine benchmark with a random-init ~1.1B-parameter Llama in bf16: Inflight with
     Triton vs Inflight with the torch reference back end (tokens/s and ratio), and
     Triton with decode steps replayed from CUDA graphs (`model.cuda_graphs: auto`, the
     default) vs without (`off`), and with the forward compiled too (`model.compile: on`):
     tokens/s ratios, greedy agreement, and how each engine's forward ran (its start line's
     `forward=`: graphs captured or why not); and sequential steps with speculative
     decoding (prompt lookup, k = 4) vs without: tokens/s ratio and greedy agreement.

Prints one JSON object, also written to results/gpu_check.json after every part (a run cut
short, say by a lease's time limit, keeps what it measured). A part or engine run that
raises is recorded as its `error` (type, message, innermost frames), the others still run,
`failed` names them, and the exit status is 1.

    python -m tools.gpu_check                 # on a CUDA machine
    TRITON_INTERPRET=1 python -m tools.gpu_check --smoke --model PATH   # CPU: tiny sizes, checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

PEAK_GBPS = {"H200": 4800, "H100 SXM": 3350, "H100 80GB HBM3": 3350, "H100 PCIe": 2000, "H100 NVL": 3900,
             "A100-SXM4-80GB": 2039, "A100-SXM4-40GB": 1555, "A100 80GB PCIe": 1935, "L40S": 864, "L4": 300,
             "A10": 600}


def peak_bandwidth_gbps() -> tuple[float | None, str]:
    """Peak HBM bandwidth in GB/s: NVML (2 x max memory clock x bus width), else a name table."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        mhz = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM)
        bits = pynvml.nvmlDeviceGetMemoryBusWidth(h)
        return 2 * mhz * 1e6 * bits / 8 / 1e9, "nvml"
    except Exception:
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
        for key, gbps in PEAK_GBPS.items():
            if key in name:
                return float(gbps), "table"
    return None, "unknown"


def timed(fn, device: str, iters: int) -> float:
    """Median seconds of `fn()` over `iters` runs after 3 warm-ups (CUDA events on GPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def build(backend, seqs: list[tuple[int, int]], block_size: int, num_kv_heads: int, head_dim: int, dtype,
          device: str, num_blocks: int | None = None, seed: int = 0, kv_int8: bool = False):
    """A runner with a random cache and the metadata of a batch of (start_pos, num_new)
    sequences over shuffled blocks (decodes must come first); `kv_int8`: an int8 cache with
    its scales (`kv_int8.py`), filled from the same random values."""
    from schemas.params import SamplingParams
    from worker.engine.outputs import ScheduledRequest, SchedulerOutput
    from worker.model.capability import KVLayout
    from worker.model.runner import ModelRunner

    seqs = [x for x in seqs if x[1] == 1 and x[0] > 0] + [x for x in seqs if not (x[1] == 1 and x[0] > 0)]
    need = sum(-(-(s + n) // block_size) for s, n in seqs)
    num_blocks = num_blocks or need + 8
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    sched, nd = [], 0
    for i, (start, n) in enumerate(seqs):
        table = [free.pop() for _ in range(-(-(start + n) // block_size))]
        ids = [1] * (start + n)
        sched.append(ScheduledRequest(f"s{i}", ids[start:], start, table, True, SamplingParams(), ids))
        nd += n == 1 and start > 0
    out = SchedulerOutput(1, sched, sum(n for _, n in seqs), nd)
    runner = ModelRunner(None, num_blocks=num_blocks, block_size=block_size, kv_layout=KVLayout.uniform(1, num_kv_heads, head_dim),
                         device=torch.device(device), dtype=dtype, backend=backend, kv_int8=kv_int8)
    gen = torch.Generator().manual_seed(seed)
    for i, c in enumerate(runner.kv_caches[0]):
        values = torch.randn(c.shape, generator=gen).to(device)
        if kv_int8:
            from worker.model.kernels import kv_int8 as kv8

            q, scale = kv8.quantize(values.view(-1, *c.shape[2:]))
            c.copy_(q.view(c.shape))
            runner.kv_scales[0][i].copy_(scale.view(runner.kv_scales[0][i].shape))
        else:
            c.copy_(values.to(dtype))
    _, _, md, _, _ = runner.build_metadata(out)
    return runner, md


def correctness(device: str, smoke: bool) -> list[dict]:
    from worker.model.kernels import torch_ref, triton_attn

    rows = []
    dtypes = [torch.float32] if device == "cpu" else [torch.bfloat16, torch.float16]
    cases = [(64, 16, 1), (128, 32, 8)] if smoke else [(hd, bs, g) for hd in (64, 128) for bs in (16, 32)
                                                        for g in (1, 4, 8)]
    for dtype in dtypes:
        for head_dim, block_size, group in cases:
            seqs = [(0 if smoke else 700, 1), (block_size - 1, 1), (2 * block_size, 1), (0, 37),
                    (block_size, 50 if smoke else 300), (5, 3)]
            kvh = 2
            ref_runner, md_ref = build(torch_ref, seqs, block_size, kvh, head_dim, torch.float32, device)
            tri_runner, md_tri = build(triton_attn, seqs, block_size, kvh, head_dim, dtype, device)
            for ref_c, tri_c in zip(ref_runner.kv_caches[0], tri_runner.kv_caches[0]):
                tri_c.copy_(ref_c.to(dtype))
                ref_c.copy_(tri_c.float())  # same cached values; only the arithmetic differs
            n = md_ref.slot_mapping.shape[0]
            q = torch.randn(n, kvh * group, head_dim, device=device).to(dtype)
            k = torch.randn(n, kvh, head_dim, device=device).to(dtype)
            v = torch.randn(n, kvh, head_dim, device=device).to(dtype)
            torch_ref.write_kv(k.float(), v.float(), *ref_runner.kv_caches[0], md_ref.slot_mapping)
            triton_attn.write_kv(k, v, *tri_runner.kv_caches[0], md_tri.slot_mapping)
            write_ok = torch.equal(tri_runner.kv_caches[0][0].float(), ref_runner.kv_caches[0][0].to(dtype).float())
            expect = torch_ref.paged_attention(q.float(), k.float(), v.float(), *ref_runner.kv_caches[0], md_ref,
                                               head_dim**-0.5)
            got = triton_attn.paged_attention(q, k, v, *tri_runner.kv_caches[0], md_tri, head_dim**-0.5)
            err = (got.float() - expect).abs().max().item()
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            rows.append({"dtype": str(dtype).removeprefix("torch."), "head_dim": head_dim, "block_size": block_size,
                         "gqa": group, "max_abs_err": err, "kv_write_exact": write_ok, "ok": err <= tol and write_ok})
            # per-layer features on the same batch: sliding window, soft-capping, sinks
            for feature, params in _feature_params(kvh * group, head_dim, device).items():
                expect = torch_ref.paged_attention(q.float(), k.float(), v.float(), *ref_runner.kv_caches[0], md_ref,
                                                   params)
                got = triton_attn.paged_attention(q, k, v, *tri_runner.kv_caches[0], md_tri, params)
                err = (got.float() - expect).abs().max().item()
                rows.append({"dtype": str(dtype).removeprefix("torch."), "head_dim": head_dim,
                             "block_size": block_size, "gqa": group, "feature": feature, "max_abs_err": err,
                             "kv_write_exact": write_ok, "ok": err <= tol})
    return rows


def int8_kv(device: str, smoke: bool) -> list[dict]:
    """The int8 KV cache (`kv_cache_dtype: int8`) in the Triton back end against the torch
    reference on the same batch: the write kernel's bytes and scales equal the torch
    write's, and the attention (dequantized tile by tile) the reference's over
    dequantized gathers."""
    from worker.model.kernels import kv_int8 as kv8
    from worker.model.kernels import torch_ref, triton_attn

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    rows = []
    for head_dim, block_size, group in ([(64, 16, 4)] if smoke else [(64, 16, 4), (128, 32, 8)]):
        seqs = [(0 if smoke else 700, 1), (block_size - 1, 1), (0, 37), (block_size, 50 if smoke else 300)]
        kvh = 2
        ref_runner, md_ref = build(torch_ref, seqs, block_size, kvh, head_dim, torch.float32, device, kv_int8=True)
        tri_runner, md_tri = build(triton_attn, seqs, block_size, kvh, head_dim, dtype, device, kv_int8=True)
        n = md_ref.slot_mapping.shape[0]
        q = torch.randn(n, kvh * group, head_dim, device=device).to(dtype)
        k = torch.randn(n, kvh, head_dim, device=device).to(dtype)
        v = torch.randn(n, kvh, head_dim, device=device).to(dtype)
        kv8.write_kv(k.float(), v.float(), *ref_runner.kv_caches[0], ref_runner.kv_scales[0], md_ref.slot_mapping)
        triton_attn.write_kv_int8(k, v, *tri_runner.kv_caches[0], tri_runner.kv_scales[0], md_tri.slot_mapping)
        write_ok = all(torch.equal(a, b) for a, b in zip((*ref_runner.kv_caches[0], *ref_runner.kv_scales[0]),
                                                          (*tri_runner.kv_caches[0], *tri_runner.kv_scales[0])))
        expect = torch_ref.paged_attention(q.float(), k.float(), v.float(), *ref_runner.kv_caches[0], md_ref,
                                           head_dim**-0.5, scales=ref_runner.kv_scales[0])
        got = triton_attn.paged_attention(q, k, v, *tri_runner.kv_caches[0], md_tri, head_dim**-0.5,
                                          scales=tri_runner.kv_scales[0])
        err = (got.float() - expect).abs().max().item()
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        rows.append({"dtype": str(dtype).removeprefix("torch."), "head_dim": head_dim, "block_size": block_size,
                     "gqa": group, "max_abs_err": err, "kv_write_exact": write_ok, "ok": err <= tol and write_ok})
    return rows


def _feature_params(num_heads: int, head_dim: int, device: str) -> dict:
    from worker.model.kernels.params import AttentionParams

    scale = head_dim**-0.5
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(0)).to(device)
    return {"sliding_window": AttentionParams(scale, sliding_window=40),
            "softcap": AttentionParams(scale * 8, softcap=5.0),
            "sinks": AttentionParams(scale, sinks=sinks)}


def decode_bandwidth(device: str, smoke: bool, peak: float | None, batch: int = 64, ctx: int = 2048) -> dict:
    from worker.model.kernels import triton_attn

    heads, kvh, hd, bs = (8, 2, 64, 16) if smoke else (32, 8, 128, 16)
    if smoke:
        batch, ctx = min(batch, 4), min(ctx, 64) if batch > 4 else min(ctx, 1100)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    runner, md = build(triton_attn, [(ctx - 1, 1)] * batch, bs, kvh, hd, dtype, device)
    q = torch.randn(batch, heads, hd, device=device, dtype=dtype)
    kc, vc = runner.kv_caches[0]
    secs = timed(lambda: triton_attn.paged_attention(q, q, q, kc, vc, md, hd**-0.5), device, 3 if smoke else 50)
    elem = torch.empty((), dtype=dtype).element_size()
    bytes_moved = batch * ctx * kvh * hd * 2 * elem + 2 * batch * heads * hd * elem
    gbps = bytes_moved / secs / 1e9
    return {"batch": batch, "context": ctx, "num_heads": heads, "num_kv_heads": kvh, "head_dim": hd,
            "block_size": bs, "splits": triton_attn.decode_splits(batch, kvh, ctx), "dtype": str(dtype).removeprefix("torch."), "seconds": secs, "gb_per_s": gbps,
            "percent_of_peak": 100 * gbps / peak if peak else None}


def prefill_tflops(device: str, smoke: bool) -> list[dict]:
    from worker.model.kernels import triton_attn

    sizes = [(1, 64)] if smoke else [(16, 512), (4, 2048), (1, 8192)]
    heads, kvh, hd, bs = (8, 2, 64, 16) if smoke else (32, 8, 128, 16)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    rows = []
    for batch, length in sizes:
        runner, md = build(triton_attn, [(0, length)] * batch, bs, kvh, hd, dtype, device)
        q = torch.randn(batch * length, heads, hd, device=device, dtype=dtype)
        kc, vc = runner.kv_caches[0]
        secs = timed(lambda q=q, md=md, kc=kc, vc=vc: triton_attn.paged_attention(q, q, q, kc, vc, md, hd**-0.5),
                     device, 3 if smoke else 20)
        flops = 4 * heads * hd * batch * length * (length + 1) / 2
        rows.append({"batch": batch, "length": length, "seconds": secs, "tflops": flops / secs / 1e12})
    return rows


def quantized_linear(device: str, smoke: bool) -> list[dict]:
    """`QuantLinear` on the device (W8A8 through `torch._int_mm`, 16 rows and fewer padded
    on CUDA; weight-only int8 and int4 through the Triton kernel on CUDA, dequantized per
    call on the CPU) against the float64 arithmetic
    of the same integers, and its time against the float layer's (bf16 on CUDA)."""
    from worker.model.quant_linear import QuantLinear, WeightScheme

    k, n = (64, 96) if smoke else (4096, 4096)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    schemes = {"w8a8_int8": WeightScheme(bits=8, act_int8=True), "int8": WeightScheme(bits=8),
               "int4": WeightScheme(bits=4, group_size=32 if smoke else 128)}
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=False).to(device, dtype)
    rows = []
    for name, scheme in schemes.items():
        layer = QuantLinear.quantize(lin, scheme)
        w = layer.dequantized(torch.float64)
        for m in ((1, 17) if smoke else (1, 16, 17, 64, 256)):
            x = torch.randn(m, k, device=device, dtype=dtype)
            got = layer(x).double()
            if scheme.act_int8:  # the reference rounds the activations by the same rule
                xf = x.double()
                sx = xf.abs().amax(-1, keepdim=True) / 127.5
                xf = torch.round(xf / sx).clamp(-128, 127) * sx
            else:
                xf = x.double()
            ref = xf @ w.T
            err = float((got - ref).abs().max() / ref.abs().max())
            iters = 3 if smoke else 50
            bound = 1e-4 if dtype == torch.float32 else 1e-2
            rows.append({"scheme": name, "rows": m, "rel_error": err, "ok": err < bound,
                         "quantized_s": timed(lambda x=x, layer=layer: layer(x), device, iters),
                         "float_s": timed(lambda x=x: lin(x), device, iters)})
    rows += _fp8_linear(lin, device, smoke)
    return rows


def _fp8_linear(lin: torch.nn.Linear, device: str, smoke: bool) -> list[dict]:
    """FP8-dynamic `Fp8Linear` (`torch._scaled_mm` on CUDA; a dequantized weight on the CPU)
    against float64 arithmetic of the same FP8 values."""
    from worker.model.quant_linear import FP8_MAX, Fp8Linear, fake_quant_fp8

    w = lin.weight.detach().float()
    scale = w.abs().amax(1, keepdim=True) / FP8_MAX
    q = (w / scale).to(torch.float8_e4m3fn)
    layer = Fp8Linear(lin.in_features, lin.out_features, q, scale, act="token", dtype=lin.weight.dtype)
    rows = []
    for m in ((1, 17) if smoke else (1, 16, 64, 256)):
        x = torch.randn(m, lin.in_features, device=device, dtype=lin.weight.dtype)
        xq, sx = fake_quant_fp8(x, None)
        ref = (xq.double() * sx.double()) @ (q.double() * scale.double()).T
        err = float((layer(x).double() - ref).abs().max() / ref.abs().max())
        iters = 3 if smoke else 50
        rows.append({"scheme": "fp8_dynamic", "rows": m, "rel_error": err, "ok": err < 1e-2,
                     "quantized_s": timed(lambda x=x: layer(x), device, iters),
                     "float_s": timed(lambda x=x: lin(x), device, iters)})
    return rows


def hybrid_models(device: str, smoke: bool) -> list[dict]:
    """Recurrent-state and hybrid models (`worker/model/recurrent.py`) on the device: four
    staggered requests in 16-token chunks through the engine (fp32, the device's back end)
    against transformers' `generate` on the same device, per tiny family; `ok`: the greedy
    ids are identical. transformers runs the mixers with `mamba_ssm` / `causal_conv1d` /
    `fla` where they are installed (the report's `state_kernels`), else in torch."""
    from tests.conftest import arch_checkpoint
    from tools.tiny_archs import verdict

    families = ["Mamba"] if smoke else ["Mamba", "Mamba-2", "Jamba", "Bamba", "Qwen3-Next", "Zamba2"]
    rows = []
    for family in families:
        result = verdict(arch_checkpoint(family), max_tokens=16, device=device, backend="auto")
        rows.append({"family": family, "ok": result["result"] == "exact", **result})
    return rows


def engine_bench(a, device: str, on_progress=lambda out: None) -> dict:
    """The engine runs of part 4 (module docstring); `on_progress(out)` after each run, finished or failed."""
    from tools.bench.engine import agreement, run_inflight
    from tools.bench.harness import DEFAULT_MODEL, GPU_MODEL, ensure_model
    from tools.bench.workloads import make_workload

    path = ensure_model(Path(a.model) if a.model else (GPU_MODEL if device == "cuda" else DEFAULT_MODEL))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    work = make_workload("sharegpt", a.num_requests, vocab_size=vocab, scale=a.scale, seed=0, max_input=1024,
                         max_output=a.max_output, avoid_ids=frozenset({0, 1, 2, 3, 4}))
    total = sum(r.max_tokens for r in work)
    kv = a.max_batch * 2048
    out = {"model": str(path), "num_requests": len(work), "output_tokens": total, "max_batch": a.max_batch}

    class NoBar:
        def update(self, n):
            pass

    max_model_len = None
    if device == "cpu":  # the smoke run: graphs replay emulated (worker.model.graphs), the same steps but the capture
        from worker.engine import compile as compile_rules

        compile_rules.emulate_graphs_on_cpu()
        # A graph's decode attention is fixed at capture for the longest context: at the tiny model's 1024
        # it is split in 4 (flash-decoding) and the interpreter ran 4 programs per (sequence, KV head),
        # 3 of them empty, in every replay (57% of this run); under SPLIT_MIN_CONTEXT, one. The split
        # path is checked by decode_attention_long_context here and tests/kernels/test_triton_attention.py.
        from worker.model.kernels.triton_attn import SPLIT_MIN_CONTEXT

        max_model_len = SPLIT_MIN_CONTEXT // 2
        out["max_model_len"] = max_model_len
    ids = {}
    # "triton": asynchronous steps (the CUDA default: scheduled one ahead, sampled ids fed on
    # the device) and decode graphs (the CUDA default), forced so the CPU smoke run takes the
    # same path; "triton_no_graphs": the same without graphs; "triton_compiled": with the
    # forward under torch.compile too (model.compile: on)
    # "triton_ngram": sequential steps with prompt lookup (speculative decoding) on every request
    from worker.config import SpeculativeConfig

    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=4, disable_by_batch_size=None, min_speedup=None)
    # "triton_draft": sequential steps with a draft model (the checkpoint cut to its first layer, untrained: the
    # mechanism's cost and exactness, not a good draft's acceptance)
    draft_path = path.parent / f"{path.name}-cut1"
    if not (draft_path / "model.safetensors").is_file():
        from tools.make_draft import distill

        distill(path, draft_path, layers=1, steps=0, corpus_chars=200_000, log=lambda *_: None)
    draft = SpeculativeConfig(method="draft", draft_model=str(draft_path), num_speculative_tokens=4,
                              disable_by_batch_size=None, min_speedup=None)
    runs = (("triton", "triton", True, "off", "auto", None), ("triton_no_graphs", "triton", True, "off", "off", None),
            ("torch", "torch", None, "off", "auto", None), ("triton_sequential", "triton", False, "off", "auto", None),
            ("triton_compiled", "triton", True, "on", "auto", None), ("triton_ngram", "triton", None, "off", "auto", ngram),
            ("triton_draft", "triton", None, "off", "auto", draft))
    for name, backend, async_steps, compiled, graphs, spec in runs:
        forward, t0 = [], time.time()
        try:
            secs, ids[name] = run_inflight(path, work, a.max_batch, kv, 2048, NoBar(), device, backend, async_steps,
                                           compile_mode=compiled, cuda_graphs=graphs, max_model_len=max_model_len,
                                           on_engine=lambda e, seen=forward: seen.append(e.compile_report.describe()),
                                           speculative=spec)
        except Exception as e:  # one mode that breaks (a first GPU) must not lose the others' figures
            out[name] = {"error": _error(e), "forward": forward[0] if forward else None}
            on_progress(out)
            continue
        finally:
            _free(device)
        out[name] = {"seconds": secs, "output_tokens_per_s": total / secs, "forward": forward[0],
                     "wall_with_start_seconds": time.time() - t0}
        on_progress(out)
    # each ratio where both of its runs finished: the first against the second
    pairs = {"triton_vs_torch": ("triton", "torch"),
             # asynchronous against sequential steps on the same kernels: speed, and how many requests got
             # the same ids (fp32 on the CPU: all; bf16 on a GPU: batch composition may move a few)
             "async_vs_sequential": ("triton", "triton_sequential"),
             "graphs_vs_no_graphs": ("triton", "triton_no_graphs"),
             "compiled_vs_eager": ("triton_compiled", "triton"),
             "ngram_vs_sequential": ("triton_ngram", "triton_sequential"),
             "draft_vs_sequential": ("triton_draft", "triton_sequential")}
    agreements = {"async_vs_sequential": "async_sequential_agreement", "graphs_vs_no_graphs": "graphs_agreement",
                  "compiled_vs_eager": "compiled_eager_agreement", "ngram_vs_sequential": "ngram_agreement",
                  "draft_vs_sequential": "draft_agreement"}
    for key, (x, y) in pairs.items():
        if x in ids and y in ids:
            out[key] = out[x]["output_tokens_per_s"] / out[y]["output_tokens_per_s"]
            if key in agreements:  # the later mode's ids against the earlier's (eager, sequential, no graphs)
                out[agreements[key]] = agreement(ids[y], ids[x])
    return out


def _error(e: BaseException) -> str:
    """`Type: message` and the innermost frames of `e`'s traceback, for the report."""
    import traceback

    frames = traceback.format_exception(e)
    return "".join(frames[-3:])[-2000:]


def _free(device: str) -> None:
    """Release what the last engine held before the next is built (its KV cache alone is
    gigabytes on the GPU benchmark model)."""
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes (checks the script, e.g. on the CPU interpreter)")
    p.add_argument("--model", default=None, help="checkpoint for the engine benchmark (default: a ~1.1B Llama)")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--scale", type=float, default=2.0, help="divide ShareGPT mean lengths")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-output", type=int, default=1024,
                   help="cap on each request's output tokens (the CPU smoke run: a few steps per engine mode)")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--out", default="results")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("no CUDA device: run with TRITON_INTERPRET=1 and --smoke to check the script on the CPU", file=sys.stderr)
        return 2
    t0 = time.time()
    peak, peak_src = peak_bandwidth_gbps() if device == "cuda" else (None, "cpu")
    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__, "triton": _version("triton"), "transformers": _version("transformers"),
        "peak_bandwidth_gb_per_s": peak, "peak_source": peak_src,
        "state_kernels": {m: _version(m) for m in ("mamba-ssm", "causal-conv1d", "flash-linear-attention")},
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every part: a run cut short (a lease's time limit) keeps what it measured
        report["wall_seconds"] = time.time() - t0
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2))

    parts = {"correctness": lambda: correctness(device, a.smoke),
             "decode_attention": lambda: decode_bandwidth(device, a.smoke, peak),
             # small batch, long context: the split-K (flash-decoding) path
             "decode_attention_long_context": lambda: decode_bandwidth(device, a.smoke, peak, batch=4, ctx=16384),
             "prefill_attention": lambda: prefill_tflops(device, a.smoke),
             "quantized_linear": lambda: quantized_linear(device, a.smoke),
             "int8_kv": lambda: int8_kv(device, a.smoke),
             "hybrid_models": lambda: hybrid_models(device, a.smoke)}
    if not a.skip_engine:
        parts["engine"] = lambda: engine_bench(a, device, on_progress=lambda eng: (report.update(engine=eng), save()))
    failed = []
    for name, part in parts.items():
        started = time.time()
        try:
            report[name] = part()
        except Exception as e:  # the next parts still run and report
            report[name] = {"error": _error(e)}
            failed.append(name)
        print(f"gpu_check: {name} {'failed' if name in failed else 'done'} in {time.time() - started:.1f} s",
              file=sys.stderr, flush=True)
        checked = ("correctness", "quantized_linear", "int8_kv", "hybrid_models")
        report["all_correct"] = (not set(checked) & set(failed)
                                 and all(r["ok"] for part in checked for r in report.get(part, [])))
        save()
    failed += [k for k, v in report.get("engine", {}).items() if isinstance(v, dict) and "error" in v]
    report["failed"] = failed
    save()
    print(json.dumps(report, indent=2))
    return 0 if report["all_correct"] and not failed else 1


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None

if __name__ == "__main__":
    raise SystemExit(main())
