"""The CPU back end's decode kernel (kernels/cpu_decode.c through cpu_attn.py) against the
plain-torch reference on randomized packed batches: decodes of context 1, block
boundaries and random lengths in shuffled blocks, a prefix shared by two sequences, the
prefill chunks of the batch (the reference path of the same call), GQA ratios 1/2/4/8,
head dims 32/80/128, block sizes 16/32, a sliding window, a value cache that is a view
of the key cache (latent attention); the layers it leaves to the reference; the same bits
on one thread and several; and the fallback when no C compiler can build it."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from tests.kernels.test_triton_attention import (
    NUM_BLOCKS,
    NUM_KV_HEADS,
    PARAMS,
    dense_attention,
    make_batch,
    runner,
)
from worker.engine.outputs import ScheduledRequest, SchedulerOutput
from worker.model.kernels import cpu_attn, get_backend, torch_ref
from worker.model.kernels.params import AttentionParams

pytestmark = pytest.mark.skipif(not cpu_attn.available(), reason=f"no CPU kernel: {cpu_attn.unavailable_reason()}")

CASES = [(hd, bs, g, w) for hd in (32, 80, 128) for bs in (16, 32) for g in (1, 2, 4, 8) for w in (None, 7)]


def filled_runners(head_dim: int, block_size: int, sched):
    """A reference and a CPU-back-end runner whose caches hold the same random K/V."""
    ref, cpu = runner(torch_ref, block_size, head_dim, torch.float32), runner(cpu_attn, block_size, head_dim,
                                                                               torch.float32)
    for a, b in zip(ref.kv_caches[0], cpu.kv_caches[0]):
        a.copy_(torch.randn_like(a))
        b.copy_(a)
    return ref, cpu, ref.build_metadata(sched)[2], cpu.build_metadata(sched)[2]


@pytest.mark.parametrize("head_dim,block_size,group,window", CASES)
def test_decode_kernel_matches_the_reference(head_dim, block_size, group, window):
    rng = random.Random(hash((head_dim, block_size, group, window)) % 1000)
    torch.manual_seed(rng.randrange(1 << 30))
    sched = make_batch(rng, block_size)
    ref, cpu, md_ref, md_cpu = filled_runners(head_dim, block_size, sched)
    n, num_heads = sched.num_scheduled_tokens, NUM_KV_HEADS * group
    q = torch.randn(n, num_heads, head_dim).transpose(0, 1).contiguous().transpose(0, 1)  # strided, as the model's
    k, v = torch.randn(n, NUM_KV_HEADS, head_dim), torch.randn(n, NUM_KV_HEADS, head_dim)
    torch_ref.write_kv(k, v, *ref.kv_caches[0], md_ref.slot_mapping)
    cpu_attn.write_kv(k, v, *cpu.kv_caches[0], md_cpu.slot_mapping)
    params = AttentionParams(scale=head_dim**-0.5, sliding_window=window)
    expect = torch_ref.paged_attention(q, k, v, *ref.kv_caches[0], md_ref, params)
    nd = sched.num_decodes
    decodes = torch.empty(nd, num_heads, head_dim)
    assert cpu_attn.paged_decode(q[:nd], *cpu.kv_caches[0], md_cpu.block_tables, md_cpu.seq_lens, params.scale,
                                 window, decodes)  # the kernel itself, whatever the thread count
    torch.testing.assert_close(decodes, expect[:nd], atol=2e-5, rtol=2e-5)
    got = cpu_attn.paged_attention(q, k, v, *cpu.kv_caches[0], md_cpu, params)
    torch.testing.assert_close(got, expect, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("head_dim,block_size,group,window", [(32, 16, 4, None), (80, 32, 1, 7), (128, 16, 8, None)])
def test_int8_caches_decode_in_the_kernel_as_the_reference_dequantizes_them(head_dim, block_size, group, window):
    """`kv_cache_dtype: int8` (kernels/kv_int8.py): the kernel reads the int8 values and their
    per-token-head scales in place, the reference gathers them dequantized; the same
    result, decodes and the batch's prefill chunks."""
    from worker.model.capability import KVLayout
    from worker.model.kernels import kv_int8
    from worker.model.runner import ModelRunner

    rng = random.Random(head_dim + group)
    torch.manual_seed(head_dim + group)
    sched = make_batch(rng, block_size)
    r = ModelRunner(None, num_blocks=64, block_size=block_size, kv_layout=KVLayout.uniform(1, NUM_KV_HEADS, head_dim),
                    device=torch.device("cpu"), dtype=torch.float32, backend=cpu_attn, kv_int8=True)
    md = r.build_metadata(sched)[2]
    (k_cache, v_cache), scales = r.kv_caches[0], r.kv_scales[0]
    assert k_cache.dtype == torch.int8 and md.kv_scales is r.kv_scales
    n, num_heads = sched.num_scheduled_tokens, NUM_KV_HEADS * group
    for cache, scale in ((k_cache, scales[0]), (v_cache, scales[1])):  # every slot filled, as earlier steps would
        q_all, s_all = kv_int8.quantize(torch.randn(cache.shape[0] * cache.shape[1], NUM_KV_HEADS, head_dim))
        cache.view(-1, NUM_KV_HEADS, head_dim).copy_(q_all)
        scale.view(-1, NUM_KV_HEADS).copy_(s_all)
    q = torch.randn(n, num_heads, head_dim)
    k, v = torch.randn(n, NUM_KV_HEADS, head_dim), torch.randn(n, NUM_KV_HEADS, head_dim)
    kv_int8.write_kv(k, v, k_cache, v_cache, scales, md.slot_mapping)
    params = AttentionParams(scale=head_dim**-0.5, sliding_window=window)
    expect = torch_ref.paged_attention(q, k, v, k_cache, v_cache, md, params, scales=scales)
    nd = sched.num_decodes
    decodes = torch.empty(nd, num_heads, head_dim)
    assert cpu_attn.paged_decode(q[:nd], k_cache, v_cache, md.block_tables, md.seq_lens, params.scale, window,
                                 decodes, scales)
    torch.testing.assert_close(decodes, expect[:nd], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(cpu_attn.paged_attention(q, k, v, k_cache, v_cache, md, params, scales=scales), expect,
                               atol=2e-5, rtol=2e-5)


def test_a_value_cache_inside_the_key_cache_and_a_wider_key():
    """Latent attention: the value is the first Dv channels of a wider cached key."""
    rng = random.Random(5)
    torch.manual_seed(5)
    block_size, head_dim, v_dim, num_heads = 16, 72, 64, 8
    sched = make_batch(rng, block_size)
    nd = sched.num_decodes
    ref = runner(torch_ref, block_size, head_dim, torch.float32)
    md = ref.build_metadata(sched)[2]
    k_cache = torch.randn(ref.kv_caches[0][0].shape[:2] + (1, head_dim))
    v_cache = k_cache[..., :v_dim]
    q = torch.randn(sched.num_scheduled_tokens, num_heads, head_dim)
    key = torch.randn(sched.num_scheduled_tokens, 1, head_dim)
    torch_ref.write_kv(key, None, k_cache, v_cache, md.slot_mapping)
    expect = torch_ref.paged_attention(q, key, key[..., :v_dim], k_cache, v_cache, md, 0.1)
    got = torch.empty(nd, num_heads, v_dim)
    assert cpu_attn.paged_decode(q[:nd], k_cache, v_cache, md.block_tables, md.seq_lens, 0.1, None, got)
    torch.testing.assert_close(got, expect[:nd], atol=2e-5, rtol=2e-5)


def test_layers_the_kernel_does_not_cover_take_the_reference_path():
    rng = random.Random(9)
    torch.manual_seed(9)
    sched = make_batch(rng, 16)
    ref, cpu, md_ref, md_cpu = filled_runners(32, 16, sched)
    n = sched.num_scheduled_tokens
    q, k, v = torch.randn(n, 4, 32), torch.randn(n, 2, 32), torch.randn(n, 2, 32)
    for params in (AttentionParams(scale=0.2, softcap=5.0), AttentionParams(scale=0.2, sinks=torch.randn(4))):
        expect = torch_ref.paged_attention(q, k, v, *ref.kv_caches[0], md_ref, params)
        assert torch.equal(cpu_attn.paged_attention(q, k, v, *cpu.kv_caches[0], md_cpu, params), expect)


@pytest.mark.parametrize(("group", "rows"), [(1, 4), (4, 4), (3, 1), (1, 2)])
def test_the_kernel_gives_the_same_bits_on_one_thread_and_on_several(group, rows):
    """Its rows (with fewer rows than threads, parts of a row's KV heads) are spread over
    torch's threads; each head's sums run in one order, so the thread count changes no
    bit (an engine's threads change as engines come and go)."""
    rng = random.Random(10 + group)
    torch.manual_seed(10 + group)
    sched = make_batch(rng, 16)
    _, cpu, _, md = filled_runners(32, 16, sched)
    nd = min(rows, sched.num_decodes)  # fewer rows than threads: a row's KV heads are split among them
    q_all = torch.randn(sched.num_scheduled_tokens, NUM_KV_HEADS * group, 32)
    q = q_all[:nd]
    outs = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3, 5):  # more threads than rows, KV heads, and this box's cores: still exact
            torch.set_num_threads(threads)
            out = torch.full((nd, NUM_KV_HEADS * group, 32), float("nan"))
            assert cpu_attn.paged_decode(q, *cpu.kv_caches[0], md.block_tables[:nd], md.seq_lens[:nd], 0.2, None,
                                         out)
            outs.append(out)
            empty = torch.empty(0, NUM_KV_HEADS * group, 32)  # no rows: nothing to split, nothing written
            assert cpu_attn.paged_decode(q[:0], *cpu.kv_caches[0], md.block_tables[:0], md.seq_lens[:0], 0.2, None,
                                         empty)
    finally:
        torch.set_num_threads(before)
    assert not outs[0].isnan().any()
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    want = dense_attention(q_all, *cpu.kv_caches[0], sched, md, AttentionParams(scale=0.2))[:nd].float()
    torch.testing.assert_close(outs[0], want, atol=2e-5, rtol=2e-5)



def test_without_a_compiler_auto_falls_back_to_the_reference(monkeypatch, tmp_path, caplog):
    with monkeypatch.context() as m:
        m.setenv("CC", str(tmp_path / "no-such-compiler"))
        m.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built there yet
        cpu_attn._library.cache_clear()
        try:
            with caplog.at_level(logging.WARNING):
                assert get_backend("auto", "cpu") is torch_ref
            assert "no-such-compiler" in cpu_attn.unavailable_reason()
            assert "CPU decode kernel is unavailable" in caplog.text
            with pytest.raises(ValueError, match="attention_backend='cpu'"):
                get_backend("cpu", "cpu")
        finally:
            cpu_attn._library.cache_clear()
    assert get_backend("auto", "cpu") is cpu_attn  # the real compiler's build again


def test_a_compiler_without_openmp_builds_the_kernel_for_one_thread(monkeypatch, caplog):
    real = cpu_attn.cbuild.build

    def no_openmp(source, extra_flags=()):
        return "cc: unsupported option '-fopenmp'" if "-fopenmp" in extra_flags else real(source, extra_flags)

    with monkeypatch.context() as m:
        m.setattr(cpu_attn.cbuild, "build", no_openmp)
        cpu_attn._library.cache_clear()
        try:
            with caplog.at_level(logging.WARNING):
                assert cpu_attn.available()
            assert "built without OpenMP" in caplog.text
            rng = random.Random(12)
            sched = make_batch(rng, 16)
            _, cpu, _, md = filled_runners(32, 16, sched)
            q_all = torch.randn(sched.num_scheduled_tokens, NUM_KV_HEADS * 2, 32)
            q = q_all[: sched.num_decodes]
            out = torch.empty_like(q)
            before = torch.get_num_threads()
            torch.set_num_threads(2)  # the pragmas ignored: one thread, the same answer
            try:
                assert cpu_attn.paged_decode(q, *cpu.kv_caches[0], md.block_tables[: len(q)], md.seq_lens[: len(q)],
                                             0.2, None, out)
            finally:
                torch.set_num_threads(before)
            want = dense_attention(q_all, *cpu.kv_caches[0], sched, md, AttentionParams(scale=0.2))[: len(q)]
            torch.testing.assert_close(out, want.float(), atol=2e-5, rtol=2e-5)
        finally:
            cpu_attn._library.cache_clear()
    assert cpu_attn.available()


@pytest.mark.parametrize("backend", [torch_ref, cpu_attn], ids=["reference", "kernel"])
def test_decode_steps_are_the_steps_build_metadata_packs(backend):
    """`ModelRunner._decode_steps` (a draft model's guesses after its first forward) gives,
    for each later step, the slots, contexts, positions and attention that
    `build_metadata` gives for the same one-token decodes, whatever the first step held
    (decodes and chunks, not in context order), the reference's one decode group included."""
    rng = random.Random(23)
    torch.manual_seed(23)
    bs, head_dim, steps = 16, 32, 3
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    first = []
    for i, (start, n) in enumerate([(40, 1), (3, 9), (15, 1), (0, 17), (31, 2), (1, 1)]):
        table = [free.pop() for _ in range(-(-(start + n + steps) // bs))]  # room for the later steps
        ids = [rng.randrange(500) for _ in range(start + n)]
        first.append(ScheduledRequest(f"s{i}", ids[start:], start, table, True, PARAMS, ids))
    decodes = [s for s in first if len(s.token_ids) == 1 and s.start_pos > 0]
    first = decodes + [s for s in first if s not in decodes]
    r = runner(backend, bs, head_dim, torch.float32)
    for cache in r.kv_caches[0]:
        cache.copy_(torch.randn_like(cache))
    sched = SchedulerOutput(step=1, scheduled=first, num_decodes=len(decodes),
                            num_scheduled_tokens=sum(len(s.token_ids) for s in first))
    _, _, md, _, packed = r.build_metadata(sched)
    later = r._decode_steps(md, steps)
    assert len(later) == steps
    params = AttentionParams(scale=head_dim**-0.5)
    for i, (positions, got) in enumerate(later):
        rows = [ScheduledRequest(s.request_id, [7], s.start_pos + len(s.token_ids) + i, s.block_ids, True, PARAMS, [])
                for s in packed]
        _, want_pos, want, _, want_packed = r.build_metadata(
            SchedulerOutput(step=2 + i, scheduled=rows, num_decodes=len(rows), num_scheduled_tokens=len(rows)))
        order = [[s.request_id for s in want_packed].index(s.request_id) for s in packed]  # want's row of each
        assert positions.tolist() == [want_pos.tolist()[j] for j in order]
        assert got.slot_mapping.tolist() == [want.slot_mapping.tolist()[j] for j in order]
        assert got.seq_lens.tolist() == [want.seq_lens.tolist()[j] for j in order]
        assert (got.num_decodes, got.max_query_len, got.max_seq_len) == (len(rows), 1, want.max_seq_len)
        assert got.query_start_loc.tolist() == want.query_start_loc.tolist()
        q = torch.randn(len(rows), NUM_KV_HEADS * 2, head_dim)
        kv = torch.randn(len(rows), NUM_KV_HEADS, head_dim)
        expect = torch_ref.paged_attention(q[torch.tensor(order).argsort()], kv, kv, *r.kv_caches[0], want, params)
        torch.testing.assert_close(backend.paged_attention(q, kv, kv, *r.kv_caches[0], got, params), expect[order],
                                   atol=2e-5, rtol=2e-5)


def test_the_reference_gathers_are_built_once_and_only_when_read():
    """`AttentionMetadata.dense`: the runner defers the reference back end's decode groups
    and prefill masks; the first read builds them, later reads reuse them."""
    rng = random.Random(3)
    sched = make_batch(rng, 16)
    r = runner(torch_ref, 16, 32, torch.float32)
    md = r.build_metadata(sched)[2]
    assert md.build_dense is not None and md.decode_groups == [] and md.prefills == []
    groups, prefills = md.dense()
    assert md.build_dense is None and groups and len(prefills) == len(sched.scheduled) - sched.num_decodes
    assert md.dense()[0] is groups
