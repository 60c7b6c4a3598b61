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
from worker.model.kernels import get_backend, torch_ref
from worker.model.runner import ModelRunner

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
triton_attn = get_backend("triton", DEVICE)
NUM_KV_HEADS = 2
NUM_BLOCKS = 48
PARAMS = SamplingParams()


def runner(backend, block_size: int, head_dim: int, dtype) -> ModelRunner:
    return ModelRunner(None, num_blocks=NUM_BLOCKS, block_size=block_size, num_layers=1, num_kv_heads=NUM_KV_HEADS,
                       head_dim=head_dim, device=torch.device(DEVICE), dtype=dtype, backend=backend)


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
    assert get_backend("auto", "cpu") is torch_ref
    assert get_backend("torch", "cuda") is torch_ref
    with pytest.raises(ValueError, match="attention_backend"):
        get_backend("flash", "cpu")


@pytest.mark.parametrize("group,splits", [(1, 3), (4, 4), (8, 7)])
def test_split_k_decode_matches_reference(group, splits):
    """Flash-decoding: long contexts split over programs (some splits see no key at all:
    the short contexts), partials combined by the reduce kernel."""
    rng = random.Random(splits)
    block_size, head_dim = 16, 64
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    sched = []
    for i, ctx in enumerate((300, 1, 17, 129, 64)):  # decodes only
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        ids = [1] * ctx
        sched.append(ScheduledRequest(f"d{i}", ids[-1:], ctx - 1, table, True, PARAMS, ids))
    out = SchedulerOutput(step=1, scheduled=sched, num_scheduled_tokens=len(sched), num_decodes=len(sched))
    ref_runner = runner(torch_ref, block_size, head_dim, torch.float32)
    tri_runner = runner(triton_attn, block_size, head_dim, torch.float32)
    _, _, md_ref, _, _ = ref_runner.build_metadata(out)
    _, _, md_tri, _, _ = tri_runner.build_metadata(out)
    assert md_tri.max_seq_len == 300
    for ref_c, tri_c in zip(ref_runner.kv_caches[0], tri_runner.kv_caches[0]):
        ref_c.copy_(torch.randn_like(ref_c))
        tri_c.copy_(ref_c)
    n = len(sched)
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
