"""Triton kernels against the plain-torch reference on randomized packed batches
(interpreter on the CPU, real kernels on CUDA): ragged lengths including 1, exact block
boundaries, non-contiguous block tables, prefix blocks shared by two sequences, GQA
ratios 1/4/8, head dims 64/128, block sizes 16/32."""

from __future__ import annotations

import random

import pytest
import torch

from schemas.params import SamplingParams
from worker.engine.outputs import ScheduledRequest, SchedulerOutput
from worker.model.capability import KVLayout, LayerKV
from worker.model.kernels import get_backend, torch_ref
from worker.model.kernels.params import AttentionParams
from worker.model.runner import ModelRunner

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
triton_attn = get_backend("triton", DEVICE)
NUM_KV_HEADS = 2
NUM_BLOCKS = 48
PARAMS = SamplingParams()


def runner(backend, block_size: int, head_dim: int, dtype) -> ModelRunner:
    return ModelRunner(None, num_blocks=NUM_BLOCKS, block_size=block_size, kv_layout=KVLayout.uniform(1, NUM_KV_HEADS, head_dim),
                       device=torch.device(DEVICE), dtype=dtype, backend=backend)


def make_batch(rng: random.Random, block_size: int) -> SchedulerOutput:
    """Decodes (context 1, block boundaries, random) then prefill chunks (fresh of
    length 1 and longer, continued from a block boundary and from mid-block, and one
    that reuses another sequence's cached prefix blocks)."""
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)  # non-contiguous, unordered physical blocks

    def blocks(n_tokens: int, prefix: list[int] | None = None) -> list[int]:
        table = list(prefix or [])
        while len(table) * block_size < n_tokens:
            table.append(free.pop())
        return table

    bs = block_size
    specs: list[tuple[int, int, list[int] | None]] = []  # (start_pos, num_new, prefix blocks)
    for ctx in (1, bs, 2 * bs + 1, rng.randint(2, 3 * bs)):  # decodes: context after this step
        specs.append((ctx - 1, 1, None))
    specs += [(0, 1, None), (0, rng.randint(2, 2 * bs), None), (bs, rng.randint(1, bs + 3), None),
              (rng.randint(1, bs - 1), rng.randint(2, bs), None)]
    shared = blocks(2 * bs)  # a prefix of two full blocks, cached by sequence "A"
    specs += [(2 * bs, 1, shared), (2 * bs, rng.randint(2, bs), shared)]  # both continue after it
    sched = []
    for i, (start, n, prefix) in enumerate(specs):
        table = blocks(start + n, prefix[: -(-start // bs)] if prefix else None)
        ids = [rng.randrange(500) for _ in range(start + n)]
        sched.append(ScheduledRequest(f"s{i}", ids[start:], start, table, True, PARAMS, ids))
    nd = 4
    return SchedulerOutput(step=1, scheduled=sched, num_scheduled_tokens=sum(s.num_tokens for s in sched),
                           num_decodes=nd)


CASES = [(hd, bs, g) for hd in (64, 128) for bs in (16, 32) for g in (1, 4, 8)]


@pytest.mark.parametrize("head_dim,block_size,group", CASES)
def test_kernels_match_reference(head_dim, block_size, group):
    rng = random.Random(hash((head_dim, block_size, group)) % 1000)
    torch.manual_seed(rng.randrange(1 << 30))
    dtype = torch.float32
    sched = make_batch(rng, block_size)
    ref_runner = runner(torch_ref, block_size, head_dim, dtype)
    tri_runner = runner(triton_attn, block_size, head_dim, dtype)
    _, _, md_ref, _, _ = ref_runner.build_metadata(sched)
    _, _, md_tri, _, _ = tri_runner.build_metadata(sched)
    assert md_tri.decode_groups == [] and md_tri.prefills == []  # kernels need only the tables
    n = sched.num_scheduled_tokens
    num_heads = NUM_KV_HEADS * group
    q = torch.randn(n, num_heads, head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(n, NUM_KV_HEADS, head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn(n, NUM_KV_HEADS, head_dim, device=DEVICE, dtype=dtype)
    # the cache already holds the earlier positions' K/V (random), identical for both
    kc, vc = ref_runner.kv_caches[0]
    kc.copy_(torch.randn_like(kc))
    vc.copy_(torch.randn_like(vc))
    tri_runner.kv_caches[0][0].copy_(kc)
    tri_runner.kv_caches[0][1].copy_(vc)

    torch_ref.write_kv(k, v, kc, vc, md_ref.slot_mapping)
    triton_attn.write_kv(k, v, *tri_runner.kv_caches[0], md_tri.slot_mapping)
    assert torch.equal(tri_runner.kv_caches[0][0], kc) and torch.equal(tri_runner.kv_caches[0][1], vc)

    scale = head_dim**-0.5
    expect = torch_ref.paged_attention(q, k, v, kc, vc, md_ref, scale)
    got = triton_attn.paged_attention(q, k, v, *tri_runner.kv_caches[0], md_tri, scale)
    torch.testing.assert_close(got, expect, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("head_dim,block_size,group", [(64, 16, 4), (128, 32, 1)])
def test_int8_caches_match_the_reference(head_dim, block_size, group):
    """`kv_cache_dtype: int8`: the Triton write stores the bytes and scales the torch write
    does (padding slots skipped), and its attention, dequantizing tile by tile, equals the
    reference's over dequantized gathers, decodes and prefill chunks, split-K too."""
    from worker.model.capability import KVLayout
    from worker.model.kernels import kv_int8
    from worker.model.runner import ModelRunner

    rng = random.Random(head_dim + group)
    torch.manual_seed(head_dim + group)
    sched = make_batch(rng, block_size)

    def int8_runner(backend):
        return ModelRunner(None, num_blocks=NUM_BLOCKS, block_size=block_size,
                           kv_layout=KVLayout.uniform(1, NUM_KV_HEADS, head_dim), device=torch.device(DEVICE),
                           dtype=torch.float32, backend=backend, kv_int8=True)

    ref, tri = int8_runner(torch_ref), int8_runner(triton_attn)
    md_ref, md_tri = ref.build_metadata(sched)[2], tri.build_metadata(sched)[2]
    n, num_heads = sched.num_scheduled_tokens, NUM_KV_HEADS * group
    for (cache, scale), (tcache, tscale) in zip(zip(ref.kv_caches[0], ref.kv_scales[0]),
                                                 zip(tri.kv_caches[0], tri.kv_scales[0])):
        values, s = kv_int8.quantize(torch.randn(cache.shape[0] * block_size, NUM_KV_HEADS, head_dim))
        for c, sc in ((cache, scale), (tcache, tscale)):  # earlier steps' context
            c.view(-1, NUM_KV_HEADS, head_dim).copy_(values.to(c.device))
            sc.view(-1, NUM_KV_HEADS).copy_(s.to(sc.device))
    q = torch.randn(n, num_heads, head_dim, device=DEVICE)
    k, v = torch.randn(n, NUM_KV_HEADS, head_dim, device=DEVICE), torch.randn(n, NUM_KV_HEADS, head_dim, device=DEVICE)
    slots = md_tri.slot_mapping.clone()
    slots[0] = -1  # a padding row of a decode graph: written by neither
    kv_int8.write_kv(k, v, *ref.kv_caches[0], ref.kv_scales[0], slots.to(md_ref.slot_mapping.device))
    triton_attn.write_kv_int8(k, v, *tri.kv_caches[0], tri.kv_scales[0], slots)
    for a, b in zip((*ref.kv_caches[0], *ref.kv_scales[0]), (*tri.kv_caches[0], *tri.kv_scales[0])):
        assert torch.equal(a.cpu(), b.cpu())
    params = AttentionParams(scale=head_dim**-0.5)
    expect = torch_ref.paged_attention(q, k, v, *ref.kv_caches[0], md_ref, params, scales=ref.kv_scales[0])
    for splits in (None, 3):
        got = triton_attn.paged_attention(q, k, v, *tri.kv_caches[0], md_tri, params, scales=tri.kv_scales[0],
                                          num_splits=splits)
        torch.testing.assert_close(got.cpu(), expect.cpu(), atol=1e-4, rtol=1e-4)


def test_write_kv_skips_negative_slots_and_converts_dtype():
    kc = torch.zeros(4, 16, 2, 64, device=DEVICE, dtype=torch.float16)
    vc = torch.zeros_like(kc)
    k = torch.randn(3, 2, 64, device=DEVICE)
    v = torch.randn(3, 2, 64, device=DEVICE)
    slots = torch.tensor([5, -1, 63], device=DEVICE)
    triton_attn.write_kv(k, v, kc, vc, slots)
    flat_k = kc.view(-1, 2, 64)
    assert torch.equal(flat_k[5], k[0].half()) and torch.equal(flat_k[63], k[2].half())
    assert torch.count_nonzero(flat_k).item() == 2 * 2 * 64 - torch.count_nonzero(k[[0, 2]].half() == 0).item()
    assert torch.equal(vc.view(-1, 2, 64)[63], v[2].half())


def test_backend_selection():
    from worker.model.kernels import cpu_attn

    assert get_backend("auto", "cpu") is (cpu_attn if cpu_attn.available() else torch_ref)
    assert get_backend("torch", "cuda") is torch_ref
    with pytest.raises(ValueError, match="attention_backend"):
        get_backend("flash", "cpu")


def long_decodes(rng: random.Random, head_dim: int, block_size: int = 16):
    """Five decodes of contexts 300, 1, 17, 129 and 64 in shuffled blocks, on a reference
    and a Triton runner whose caches hold the same random values. Returns (number of
    sequences, ref runner, Triton runner, ref metadata, Triton metadata)."""
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    sched = []
    for i, ctx in enumerate((300, 1, 17, 129, 64)):
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        ids = [1] * ctx
        sched.append(ScheduledRequest(f"d{i}", ids[-1:], ctx - 1, table, True, PARAMS, ids))
    out = SchedulerOutput(step=1, scheduled=sched, num_scheduled_tokens=len(sched), num_decodes=len(sched))
    ref_runner = runner(torch_ref, block_size, head_dim, torch.float32)
    tri_runner = runner(triton_attn, block_size, head_dim, torch.float32)
    _, _, md_ref, _, _ = ref_runner.build_metadata(out)
    _, _, md_tri, _, _ = tri_runner.build_metadata(out)
    for ref_c, tri_c in zip(ref_runner.kv_caches[0], tri_runner.kv_caches[0]):
        ref_c.copy_(torch.randn_like(ref_c))
        tri_c.copy_(ref_c)
    return len(sched), ref_runner, tri_runner, md_ref, md_tri


@pytest.mark.parametrize("group,splits", [(1, 3), (4, 4), (8, 7)])
def test_split_k_decode_matches_reference(group, splits):
    """Flash-decoding: long contexts split over programs (some splits see no key at all:
    the short contexts), partials combined by the reduce kernel."""
    head_dim = 64
    n, ref_runner, tri_runner, md_ref, md_tri = long_decodes(random.Random(splits), head_dim)
    assert md_tri.max_seq_len == 300
    q = torch.randn(n, NUM_KV_HEADS * group, head_dim, device=DEVICE)
    kv = torch.randn(n, NUM_KV_HEADS, head_dim, device=DEVICE)
    expect = torch_ref.paged_attention(q, kv, kv, *ref_runner.kv_caches[0], md_ref, 0.125)
    got = triton_attn.paged_attention(q, kv, kv, *tri_runner.kv_caches[0], md_tri, 0.125, num_splits=splits)
    torch.testing.assert_close(got, expect, atol=2e-5, rtol=2e-5)


def test_split_heuristic():
    assert triton_attn.decode_splits(64, 8, 2048) == 1  # 512 programs already
    assert triton_attn.decode_splits(4, 8, 8192) == 16
    assert triton_attn.decode_splits(2, 8, 1500) == 5
    assert triton_attn.decode_splits(1, 8, 512) == 1  # short context: never split


def dense_attention(q, k_cache, v_cache, sched: SchedulerOutput, md, p: AttentionParams) -> torch.Tensor:
    """The definition, one query at a time, from each sequence's full context: what both
    back ends must compute (window, cap, sinks, ALiBi as `AttentionParams` documents)."""
    bs = k_cache.shape[1]
    num_heads, kvh = q.shape[1], k_cache.shape[2]
    group = num_heads // kvh
    out = torch.zeros(q.shape[0], num_heads, v_cache.shape[-1], dtype=torch.float64)
    row = 0
    nd = sched.num_decodes
    packed = sorted(sched.scheduled[:nd], key=lambda s: -s.start_pos) + sched.scheduled[nd:]
    for s in packed:
        ctx = s.start_pos + s.num_tokens
        slots = [s.block_ids[j // bs] * bs + j % bs for j in range(ctx)]
        k = k_cache.reshape(-1, kvh, k_cache.shape[-1])[slots].double()  # [ctx, kvh, D]
        v = v_cache.reshape(-1, kvh, v_cache.shape[-1])[slots].double()
        for t in range(s.num_tokens):
            pos = s.start_pos + t
            for h in range(num_heads):
                keys = [j for j in range(pos + 1) if p.sliding_window is None or j > pos - p.sliding_window]
                logits = (k[keys, h // group] @ q[row + t, h].double()) * p.scale
                if p.alibi_slopes is not None:
                    logits = logits + p.alibi_slopes[h].double() * torch.tensor(keys, dtype=torch.float64)
                if p.softcap is not None:
                    logits = torch.tanh(logits / p.softcap) * p.softcap
                if p.sinks is not None:
                    logits = torch.cat([logits, p.sinks[h].double().view(1)])
                w = torch.softmax(logits, 0)[: len(keys)]
                out[row + t, h] = w @ v[keys, h // group]
        row += s.num_tokens
    return out


def layer_params(kind: str, num_heads: int, scale: float) -> AttentionParams:
    gen = torch.Generator().manual_seed(len(kind))
    if kind == "window":
        return AttentionParams(scale, sliding_window=5)
    if kind == "window-long":
        return AttentionParams(scale, sliding_window=20)
    if kind == "softcap":
        return AttentionParams(scale * 8, softcap=2.0)  # large logits, so the cap matters
    if kind == "sinks":
        return AttentionParams(scale, sinks=torch.randn(num_heads, generator=gen).to(DEVICE) * 2)
    if kind == "alibi":
        return AttentionParams(scale, alibi_slopes=(2.0 ** -torch.arange(1, num_heads + 1, dtype=torch.float32)).to(DEVICE))
    if kind == "all":
        return AttentionParams(scale * 4, sliding_window=9, softcap=3.0,
                               sinks=torch.randn(num_heads, generator=gen).to(DEVICE))
    return AttentionParams(scale)


FEATURES = ["plain", "window", "window-long", "softcap", "sinks", "alibi", "all"]


@pytest.mark.parametrize("kind", FEATURES)
@pytest.mark.parametrize("group", [1, 4])
def test_layer_features_match_definition_in_both_back_ends(kind, group):
    """Sliding window (keys in (p - W, p]), soft-capping, sinks and ALiBi on the same
    randomized packed batches (decodes at block boundaries, chunks with cached context,
    shared prefix blocks): the reference and the kernels against the per-query definition."""
    rng = random.Random(hash((kind, group)) % 1000)
    torch.manual_seed(rng.randrange(1 << 30))
    block_size, head_dim = 16, 64
    sched = make_batch(rng, block_size)
    ref_runner = runner(torch_ref, block_size, head_dim, torch.float32)
    tri_runner = runner(triton_attn, block_size, head_dim, torch.float32)
    _, _, md_ref, _, _ = ref_runner.build_metadata(sched)
    _, _, md_tri, _, _ = tri_runner.build_metadata(sched)
    n, num_heads = sched.num_scheduled_tokens, NUM_KV_HEADS * group
    q = torch.randn(n, num_heads, head_dim, device=DEVICE)
    kc, vc = ref_runner.kv_caches[0]
    kc.copy_(torch.randn_like(kc))
    vc.copy_(torch.randn_like(vc))
    tri_runner.kv_caches[0][0].copy_(kc)
    tri_runner.kv_caches[0][1].copy_(vc)
    p = layer_params(kind, num_heads, head_dim**-0.5)
    k = torch.randn(n, NUM_KV_HEADS, head_dim, device=DEVICE)
    v = torch.randn(n, NUM_KV_HEADS, head_dim, device=DEVICE)
    for backend, r, md in ((torch_ref, ref_runner, md_ref), (triton_attn, tri_runner, md_tri)):
        backend.write_kv(k, v, *r.kv_caches[0], md.slot_mapping)
    expect = dense_attention(q.cpu(), kc.cpu(), vc.cpu(), sched, md_ref, p).float()
    got_ref = torch_ref.paged_attention(q, k, v, kc, vc, md_ref, p)
    got_tri = triton_attn.paged_attention(q, k, v, *tri_runner.kv_caches[0], md_tri, p)
    torch.testing.assert_close(got_ref.cpu(), expect, atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(got_tri.cpu(), expect, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("kind", ["window-long", "sinks", "all"])
def test_split_k_with_layer_features(kind):
    """Flash-decoding splits of a window (and a sink counted once, in the reduce)."""
    head_dim, group = 64, 4
    n, ref_runner, tri_runner, md_ref, md_tri = long_decodes(random.Random(len(kind)), head_dim)
    q = torch.randn(n, NUM_KV_HEADS * group, head_dim, device=DEVICE)
    kv = torch.randn(n, NUM_KV_HEADS, head_dim, device=DEVICE)
    p = layer_params(kind, NUM_KV_HEADS * group, 0.125)
    expect = torch_ref.paged_attention(q, kv, kv, *ref_runner.kv_caches[0], md_ref, p)
    got = triton_attn.paged_attention(q, kv, kv, *tri_runner.kv_caches[0], md_tri, p, num_splits=3)
    torch.testing.assert_close(got, expect, atol=2e-5, rtol=2e-5)


def test_latent_layout_value_inside_key():
    """MLA's cache: one KV head of rank + rope channels, the value its first `rank`
    channels (a view); write_kv with no value; the output has the value's width."""
    rng = random.Random(7)
    block_size, rank, rope = 16, 32, 8
    sched = make_batch(rng, block_size)
    layout = KVLayout((LayerKV(1, rank + rope, rank, value_in_key=True),))
    r_ref = ModelRunner(None, num_blocks=NUM_BLOCKS, block_size=block_size, kv_layout=layout,
                        device=torch.device(DEVICE), dtype=torch.float32, backend=torch_ref)
    r_tri = ModelRunner(None, num_blocks=NUM_BLOCKS, block_size=block_size, kv_layout=layout,
                        device=torch.device(DEVICE), dtype=torch.float32, backend=triton_attn)
    kc, vc = r_ref.kv_caches[0]
    assert vc.data_ptr() == kc.data_ptr() and vc.shape[-1] == rank
    kc.copy_(torch.randn_like(kc))
    r_tri.kv_caches[0][0].copy_(kc)
    _, _, md_ref, _, _ = r_ref.build_metadata(sched)
    _, _, md_tri, _, _ = r_tri.build_metadata(sched)
    n = sched.num_scheduled_tokens
    latent = torch.randn(n, 1, rank + rope, device=DEVICE)
    q = torch.randn(n, 4, rank + rope, device=DEVICE)
    torch_ref.write_kv(latent, None, kc, vc, md_ref.slot_mapping)
    triton_attn.write_kv(latent, None, *r_tri.kv_caches[0], md_tri.slot_mapping)
    assert torch.equal(r_tri.kv_caches[0][0], kc)
    p = AttentionParams((rank + rope) ** -0.5)
    expect = dense_attention(q.cpu(), kc.cpu(), vc.cpu(), sched, md_ref, p).float()
    got_ref = torch_ref.paged_attention(q, latent, latent[..., :rank], kc, vc, md_ref, p)
    got_tri = triton_attn.paged_attention(q, latent, latent[..., :rank], *r_tri.kv_caches[0], md_tri, p)
    assert got_ref.shape == (n, 4, rank)
    torch.testing.assert_close(got_ref.cpu(), expect, atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(got_tri.cpu(), expect, atol=3e-5, rtol=3e-5)
