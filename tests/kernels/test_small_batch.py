"""Float32 linear layers at decode batch sizes on the CPU (`worker/model/small_batch.py`, the
op `inflight::float_linear` over `cpu_woq.c`'s `inflight_float_linear` and oneDNN's packed
weights) against `F.linear` in float64: every row count up to `MAX_ROWS` (the kernel's
4-row tiles and their tails), widths with a partial block of output channels, a bias,
rows past the limit and layers the kernel does not take (torch's path), the AVX2 tiles,
what `install` does to a model under each `model.cpu_linear` policy, how `auto`
turns timings into a plan, and how its plans are kept per box."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from worker.model import small_batch
from worker.model.kernels import cpu_woq
from worker.model.quant_linear import QuantLinear, WeightScheme

pytestmark = pytest.mark.skipif(not cpu_woq.vectorized(), reason="no C compiler, or no vector tiles on this CPU")

op = torch.ops.inflight.float_linear.default
KERNEL_PLAN = tuple(small_batch.KERNEL if r <= small_batch.MAX_ROWS else small_batch.TORCH
                    for r in small_batch.PROBE_ROWS)


def planned(w: torch.Tensor, plan=KERNEL_PLAN) -> torch.Tensor:
    """`w` (another tensor on its storage) with the plan `install` would give a layer the
    kernel takes: the kernel up to `MAX_ROWS` rows, torch's GEMM above."""
    w = w.detach()
    w.inflight_plan = plan
    return w


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()))


@pytest.mark.parametrize("rows", list(range(1, small_batch.MAX_ROWS + 1)) + [small_batch.MAX_ROWS + 1, 40])
@pytest.mark.parametrize(("k", "n", "bias"), [(256, 256, False), (64, 70, True), (768, 33, False), (48, 5, True)])
def test_the_op_equals_f_linear(rows, k, n, bias):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = op(x, planned(w), b)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert close(got, reference(x, w, b)), (got.double() - reference(x, w, b)).abs().max()


def test_leading_dims_strided_rows_and_what_the_kernel_does_not_take():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 64, generator=g)
    x = torch.randn(1, 3, 64, generator=g)  # [batch, tokens, features], as a model calls it
    assert close(op(x, planned(w), None), reference(x, w, None))
    wide = torch.randn(3, 128, generator=g)[:, ::2]  # rows with a stride: copied, not read past
    assert close(op(wide, planned(w), None), reference(wide, w, None))
    assert close(op(x.double(), w.double(), None), reference(x, w, None))  # no plan: torch's GEMM, any dtype
    with pytest.raises(RuntimeError):  # a bias of another width: torch's own error, never a read past it
        op(torch.randn(2, 64, generator=g), planned(w), torch.randn(41, generator=g))
    with pytest.raises(RuntimeError):  # rows of another width: the same
        op(torch.randn(2, 48, generator=g), planned(w), None)
    odd = torch.nn.Sequential(torch.nn.Linear(36, 8), torch.nn.Linear(40, 64).double(),  # 36: not whole vectors
                              torch.nn.Linear(64, 24))
    odd[2].weight = torch.nn.Parameter(torch.randn(64, 24, generator=g).T)  # a transposed weight
    small_batch.install(odd, policy="inflight")
    kernel_planned = [getattr(m.weight, "inflight_plan", ()) for m in odd]
    assert [small_batch.KERNEL in p for p in kernel_planned] == [False, False, False]
    assert type(odd[1]) is torch.nn.Linear  # float64: left alone
    assert type(odd[0]) is torch.nn.Linear  # 36 inputs are no whole vectors: the fixed rule leaves the layer


def test_the_avx2_tiles_equal_f_linear():
    lib = cpu_woq.load(("-mno-avx512f",))
    if isinstance(lib, str) or lib.inflight_woq_vectorized() != 8:
        pytest.skip("no AVX2 + FMA build on this machine")
    g = torch.Generator().manual_seed(2)
    for rows in (1, 3, 4, 5, 8):
        x, w, b = torch.randn(rows, 72, generator=g), torch.randn(70, 72, generator=g), torch.randn(70, generator=g)
        y = torch.empty(rows, 70)
        assert lib.inflight_float_linear(x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(), rows, 72, 70, 2) == 0
        assert close(y, reference(x, w, b))


def test_one_thread_and_two_give_the_same_bits():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 256, generator=g), torch.randn(300, 256, generator=g)
    threads = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            outs.append(op(x, planned(w), None))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(*outs)


def test_install_turns_float_linears_and_keeps_their_hooks_and_outputs():
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 36),
                                QuantLinear.quantize(torch.nn.Linear(36, 16), WeightScheme(bits=8)),
                                torch.nn.Linear(16, 7))  # 16 inputs: whole vectors with AVX-512 and AVX2
    seen = []
    model[0].register_forward_hook(lambda m, args, out: seen.append(out.shape))
    x = torch.randn(3, 64)
    want = model(x)
    assert small_batch.install(model, policy="inflight") == 3
    assert [type(m).__name__ for m in model] == ["SmallBatchLinear", "ReLU", "SmallBatchLinear", "QuantLinear",
                                                 "SmallBatchLinear"]
    assert torch.allclose(model(x), want, rtol=1e-5, atol=1e-5)
    assert seen == [(3, 48), (3, 48)]  # the hook ran for both forwards
    assert isinstance(model[0], torch.nn.Linear) and "weight" in dict(model[0].named_parameters())


def test_without_vector_tiles_no_layer_takes_the_kernel_and_without_onednn_none_changes(monkeypatch):
    monkeypatch.setattr(small_batch, "_width", lambda: 0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 8))
    small_batch.install(model, policy="inflight")
    assert small_batch.KERNEL not in getattr(model[0].weight, "inflight_plan", ())
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    model = torch.nn.Sequential(torch.nn.Linear(64, 8))
    for policy in ("inflight", "auto", "torch"):
        assert small_batch.install(model, policy=policy) == 0
    assert type(model[0]) is torch.nn.Linear
    with pytest.raises(ValueError, match=r"model.cpu_linear must be one of \['auto', 'inflight', 'torch'\]"):
        small_batch.install(model, policy="mkl")


def test_a_compiled_function_keeps_the_op():
    w = planned(torch.randn(24, 32))

    def f(x):
        return torch.ops.inflight.float_linear(x, w, None).relu()

    compiled = torch.compile(f, dynamic=True, fullgraph=True)
    for rows in (2, 3, 20):
        x = torch.randn(rows, 32)
        assert close(compiled(x), reference(x, w, None).relu())


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("plain_copy_bytes", [0, 1 << 30])
def test_packed_layers_equal_f_linear_at_every_row_count(plain_copy_bytes):
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 33, bias=False))
    want = {rows: model(torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))) for rows in range(1, 41)}
    weights = [model[0].weight.detach().clone(), model[2].weight.detach().clone()]
    assert small_batch.install(model, plain_copy_bytes=plain_copy_bytes, policy="inflight") == 2
    for layer, w in zip((model[0], model[2]), weights):
        assert layer.weight.inflight_packed.is_mkldnn
        if plain_copy_bytes:  # kept: the kernel serves the smallest batches
            assert torch.equal(layer.weight, w)
        else:  # held packed only: a placeholder that still says the layer's width
            assert layer.weight.shape == (w.shape[0], 0) and layer.out_features == w.shape[0]
    for rows, y in want.items():
        got = model(torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)))
        assert got.shape == y.shape and close(got, y.double()), rows
    assert small_batch.packed_bytes(model) >= (64 * 48 + 48 * 33) * 4
    assert model(torch.randn(0, 64)).shape == (0, 33)  # an empty batch: no rows, the layer's width


@needs_onednn
def test_a_module_that_reads_its_weight_keeps_it_and_a_placeholder_refuses_other_inputs():
    torch.manual_seed(6)
    read, packed_only, small_read = torch.nn.Linear(32, 16), torch.nn.Linear(32, 16), torch.nn.Linear(32, 16)
    read.inflight_reads_weight = small_read.inflight_reads_weight = True
    small_batch.install(torch.nn.Sequential(read, packed_only), plain_copy_bytes=0, policy="inflight")
    assert type(read) is torch.nn.Linear and read.weight.shape == (16, 32)  # too large to copy: left as it is
    assert packed_only.weight.shape == (16, 0)
    small_batch.install(torch.nn.Sequential(small_read), plain_copy_bytes=4096, policy="inflight")
    assert small_read.weight.shape == (16, 32) and small_read.weight.inflight_packed is not None
    with pytest.raises(RuntimeError, match="packed layout"):
        packed_only(torch.randn(3, 32, dtype=torch.float64))


@needs_onednn
def test_a_graph_shared_by_two_models_multiplies_each_ones_own_packed_weights():
    """A compiled forward takes the parameters as inputs: the packed weight rides on its
    placeholder, so a graph traced for one model serves another of the same shapes with
    that model's weights (what `compiled._code_of` does for engines of one checkpoint)."""
    layers = []
    for seed in (7, 8):
        torch.manual_seed(seed)
        layers.append(torch.nn.Linear(64, 40).requires_grad_(False))
    plain = [(lin.weight.clone(), lin.bias.clone()) for lin in layers]
    for lin in layers:
        small_batch.install(torch.nn.Sequential(lin), plain_copy_bytes=0, policy="inflight")

    def f(x, w, b):
        return torch.ops.inflight.float_linear(x, w, b).relu()

    compiled = torch.compile(f, dynamic=True, fullgraph=True)
    with torch.inference_mode():  # as the engine runs
        for rows in (3, 20, 33):
            x = torch.randn(rows, 64)
            for lin, (w, b) in zip(layers, plain):
                assert close(compiled(x, lin.weight, lin.bias), reference(x, w, b).relu())


@needs_onednn
def test_the_inflight_rule_takes_the_kernel_up_to_2_rows_on_one_thread_and_8_on_more(monkeypatch):
    used = []
    real = small_batch.cpu_woq.float_linear
    monkeypatch.setattr(small_batch.cpu_woq, "float_linear", lambda *args: used.append(args[0].shape[0]) or real(*args))
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):  # the plan is made with the threads torch has at load
            torch.set_num_threads(t)
            model = torch.nn.Sequential(torch.nn.Linear(64, 48))
            small_batch.install(model, plain_copy_bytes=1 << 30, policy="inflight")
            for rows in range(1, 11):
                model(torch.randn(rows, 64))
    finally:
        torch.set_num_threads(threads)
    assert used == [1, 2, *range(1, 9)]


def test_auto_plans_from_timings_the_fastest_path_beating_torch_by_min_gain():
    T, K, P = small_batch.TORCH, small_batch.KERNEL, small_batch.PACKED
    n = len(small_batch.PROBE_ROWS)

    def best(torch_s, kernel_s=None, packed_s=None):
        out = {}
        for i, r in enumerate(small_batch.PROBE_ROWS):
            out[T, i] = torch_s[i]
            if kernel_s is not None and r <= small_batch.MAX_ROWS:
                out[K, i] = kernel_s[i]
            if packed_s is not None:
                out[P, i] = packed_s[i]
        return out

    same = [1.0] * n
    choose = small_batch._choose
    assert choose(best(same, same, same), large=False) is None  # ties stay on torch's GEMM
    assert choose(best(same, [0.97] * n, [0.97] * n), large=False) is None  # within MIN_GAIN: noise
    plan = choose(best(same, [0.5, 2, 2, 2, 0, 0, 0], [2, 0.97, 2, 0.5, 0.5, 2, 0.9]), large=False)
    assert plan == (K, T, T, P, P, T, P)  # the kernel is never timed, nor planned, past MAX_ROWS
    assert small_batch.describe(plan) == "rows 1: kernel, 2-4: torch, 5-16: oneDNN, 17-32: torch, 33+: oneDNN"
    assert small_batch.describe(None) == "torch"
    # a large weight: packed only, or torch's GEMM throughout, by the probes together
    assert choose(best(same, packed_s=[1.3, 1.2, 0.6, 0.6, 0.5, 0.5, 0.5]), large=True) == (P,) * n
    assert choose(best(same, packed_s=[0.9, 1.3, 1.3, 1.0, 0.9, 0.9, 1.0]), large=True) is None
    assert choose(best(same), large=True) is None


def test_auto_on_a_real_model_plans_only_what_serves_and_keeps_its_outputs(caplog):
    torch.manual_seed(9)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256, bias=False),
                                torch.nn.Linear(256, 3000))  # 3 MB: over PLAIN_COPY_BYTES
    xs = {rows: torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)) for rows in (1, 2, 3, 7, 9, 40, 90)}
    with torch.no_grad():
        want = {rows: model(x) for rows, x in xs.items()}
        with caplog.at_level("INFO", logger="worker.model.small_batch"):
            n = small_batch.install(model)
        assert "cpu_linear auto" in caplog.text and "512x256" in caplog.text
        assert n == sum(type(m) is small_batch.SmallBatchLinear for m in model)
        for m in model:
            plan = getattr(getattr(m, "weight", None), "inflight_plan", None)
            if type(m) is small_batch.SmallBatchLinear:
                assert plan is not None and any(plan)  # a layer changes class only to leave torch's GEMM somewhere
                assert all(how != small_batch.KERNEL or r <= small_batch.MAX_ROWS
                           for how, r in zip(plan, small_batch.PROBE_ROWS))
                if small_batch.PACKED not in plan:
                    assert getattr(m.weight, "inflight_packed", None) is None  # no copy it never multiplies by
        large = model[3]
        assert type(large) is torch.nn.Linear or large.weight.shape == (3000, 0)  # never plain under the op
        for rows, x in xs.items():
            assert close(model(x), want[rows].double()), rows


def test_the_setting_names_its_field_and_values_and_matches_the_policies():
    from worker.config import ConfigError, ModelConfig
    from worker.config.engine import CPU_LINEAR_MODES

    assert CPU_LINEAR_MODES == small_batch.POLICIES
    with pytest.raises(ConfigError, match=r"model.cpu_linear must be one of \['auto', 'inflight', 'torch'\], got 'mkl'"):
        ModelConfig(cpu_linear="mkl")
    assert ModelConfig().cpu_linear == "auto"


def test_layers_sharing_a_weight_each_multiply_by_their_own_bias():
    """A plan rides on the weight, so layers sharing one share it (the last installed
    decides); the kernel takes a bias only as it can read it, whichever layer planned."""
    torch.manual_seed(11)
    strided = torch.nn.Linear(64, 48)
    strided.bias = torch.nn.Parameter(torch.randn(96)[::2])  # not contiguous: the kernel cannot read it
    plain = torch.nn.Linear(64, 48, bias=False)
    plain.weight = strided.weight
    model = torch.nn.Sequential(strided, plain)
    x = torch.randn(1, 64)
    want = [reference(x, strided.weight, strided.bias), reference(x, plain.weight, None)]
    for policy in ("inflight", "auto"):
        small_batch.install(model, plain_copy_bytes=1 << 30, policy=policy)
        plain.weight.inflight_plan = KERNEL_PLAN  # as `plain`'s own plan would be, installed last
        for layer, y in zip(model, want):
            assert close(layer(x), y), policy


def test_auto_keeps_its_plans_per_box_and_a_later_start_reads_them(monkeypatch, tmp_path, caplog):
    """The plans decide which layers change class (a captured forward's key): timed once,
    they are read at every later start instead of timed again (`worker.model.linear_plans`),
    so two starts make the same model; a file that does not parse is timed again."""
    from worker.model import linear_plans

    monkeypatch.setattr(linear_plans, "plans_dir", lambda: tmp_path / "plans")

    def model():
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256, bias=False),
                                   torch.nn.Linear(256, 512))  # the first shape again: timed once

    timed = []
    real = small_batch._timed_plan
    monkeypatch.setattr(small_batch, "_timed_plan", lambda m, *a: timed.append(m.weight.shape) or real(m, *a))
    first = model()
    small_batch.install(first)
    assert timed == [(512, 256), (256, 512)]
    (kept,) = (tmp_path / "plans").glob("*.json")
    assert json.loads(kept.read_text()).keys() == {"512,256,1,0,1", "256,512,0,0,1"}

    def refuse(*a):
        raise AssertionError("timed again")

    monkeypatch.setattr(small_batch, "_timed_plan", refuse)
    monkeypatch.setattr(linear_plans, "_TABLES", {})  # as a new process: the file is read
    second = model()
    with caplog.at_level("INFO", logger="worker.model.small_batch"):
        small_batch.install(second)
    assert "0 of 2 shapes timed" in caplog.text
    assert [type(m) for m in second] == [type(m) for m in first]
    assert [getattr(m.weight, "inflight_plan", None) for m in second] == \
        [getattr(m.weight, "inflight_plan", None) for m in first]
    x = torch.randn(3, 256)
    with torch.no_grad():
        assert torch.equal(second(x), first(x))

    kept.write_text("{not json")
    monkeypatch.setattr(linear_plans, "_TABLES", {})  # as a new process, which reads the file again
    monkeypatch.setattr(small_batch, "_timed_plan", real)
    with caplog.at_level("WARNING", logger="worker.model.linear_plans"):
        small_batch.install(model())
    assert "unreadable" in caplog.text and len(json.loads(kept.read_text())) == 2  # timed again, rewritten
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # another thread count: another table
        small_batch.install(model())
    finally:
        torch.set_num_threads(threads)
    assert len(list((tmp_path / "plans").glob("*.json"))) == 2


@pytest.mark.parametrize("bad", [[9] * 7, [1], [], [0] * 7, [True] * 7, [small_batch.KERNEL] * 7])
def test_a_kept_plan_that_does_not_fit_its_shape_is_timed_again(bad, monkeypatch, tmp_path):
    """Out of range, the wrong length, all torch (the layer would change class for
    nothing), not ints, or the kernel past `MAX_ROWS`: timed again, never applied."""
    from worker.model import linear_plans

    monkeypatch.setattr(linear_plans, "plans_dir", lambda: tmp_path)
    monkeypatch.setattr(linear_plans, "_TABLES", {})
    cache = linear_plans.PlanCache.for_this_box(torch.backends.mkldnn.is_available())
    cache.put((48, 64, True, False, True), tuple(bad))
    cache.save()
    monkeypatch.setattr(linear_plans, "_TABLES", {})  # as a new process
    timed = []
    real = small_batch._timed_plan
    monkeypatch.setattr(small_batch, "_timed_plan", lambda m, *a: timed.append(m.weight.shape) or real(m, *a))
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48))
    want = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    small_batch.install(model)
    assert timed == [(48, 64)]
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert close(model(x), reference(x, *want))
    assert small_batch._plan_fits(getattr(model[0].weight, "inflight_plan", None), False, True)
