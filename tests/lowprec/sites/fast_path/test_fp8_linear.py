"""The `torch` backend's fast path (`lowprec.sites.fp8_linear`) against the `emulated` backend.

A `PrecisionLinear` on the `torch` backend runs fp8_tensorwise, fp8_delayed and
fp8_rowwise through `FP8LinearFn` (fused casts as custom ops, `_scaled_mm`); on the
`emulated` backend through `QuantizedLinearFn` (quantize, FP32 GEMMs). On CPU both must
give the same scales, delayed histories, overflow counts, statistics and bias gradients bit
for bit (the same arithmetic by construction), and GEMM results within one FP32
re-association of each other (`reassociation_bound`: which kernel, and so which summation
order, the CPU's BLAS picks for each memory layout differs between machines), over several
steps with check and non-check steps. Run here with the reference quantizer
behind the ops and, in `test_fp8_ops.py::test_fast_path_files_under_interpreter`, with the Triton kernels.

Also: what a layer saves for its backward is FP8 (counted by saved_tensors_hooks), a
non-check step reads nothing on the host, torch.compile traces the fast path in one
graph and a format switch recompiles once.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fast_path_checks import INTERPRETED, ROOT, assert_same_stats
from lowprec.sites.backends import get_backend
from lowprec.sites.backends.emulated import gemm_bound
from lowprec.numerics.formats import get_format
from lowprec.sites.layers import PrecisionLinear

FAST = ["fp8_tensorwise", "fp8_delayed", "fp8_rowwise"]


U = 2.0 ** -24   # the unit roundoff of FP32


def _nan_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (a.isnan() & b.isnan())).all())


def reassociation_bound(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """How far two FP32 evaluations of `a @ b` may be apart when they multiply the same
    dequantized operands and differ only in the order of the sums (the CPU's BLAS picks its
    kernel, and so its summation order, by shape and memory layout), elementwise.

    A sum of K products in any order is within gamma(K-1) * sum|p_i| of the exact sum, with
    gamma(n) = n u / (1 - n u) (Higham, Accuracy and Stability of Numerical Algorithms, 3.1),
    so two orders are within 2 gamma(K-1) sum|p_i|. sum|p_i| is at most |a| @ |b| of the
    operands the GEMM saw; those are `a` and `b` dequantized, within 2**-3 of them relative to
    their amax (E4M3 and E5M2 round to 3 or 2 mantissa bits; scales divide amax onto the
    format's max), hence |a| + amax(a)/8 here. Each side also applies the two scales and
    rounds the product in an order of its own (`_scaled_mm` places the scales differently
    from the emulated backend), at most K + 2 roundings per term: the product's own bound,
    `lowprec.sites.backends.emulated.gemm_bound` = 2 gamma(K+2) mass (it contains the
    2 gamma(K-1) mass of the re-association alone). Then the epilogue: a `bias` add rounds
    the result once more to FP32, by u |g + bias| <= u (mass (1 + gamma) + |bias|) on each
    side, relative to the OUTPUT, not to the GEMM's mass: with d_in = 1 and a bias larger
    than x w that rounding is one ulp of the output apart while mass is smaller (seen:
    1.19e-7 apart at y = 1.09, bias 0.54). Last the rounding to `out_dtype` (BF16: a result
    within the bound of a rounding boundary may round either way, one BF16 ulp of |y|)."""
    fa, fb = a.double().nan_to_num(0, 0, 0).abs(), b.double().nan_to_num(0, 0, 0).abs()
    fa, fb = fa + fa.amax() / 8, fb + fb.amax() / 8
    mass = fa @ fb
    n = a.shape[-1] + 2
    gamma = n * U / (1 - n * U)
    size = mass * (1 + gamma)
    if bias is not None:
        size = size + bias.double().nan_to_num(0, 0, 0).abs()
    bound = gemm_bound(fa, fb.t()) + 2 * U * size
    if out_dtype == torch.bfloat16:
        bound = bound + 2.0 ** -7 * (size + bound)
    return bound


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """`got` equals `want` where either is NaN/Inf (the same positions), elsewhere within `bound`."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    special = ~want.isfinite()
    assert torch.equal(special, ~got.isfinite()) and _nan_equal(got[special], want[special]), what
    diff = (got.double() - want.double()).abs()[~special]
    over = diff > bound.expand_as(got)[~special]
    assert not over.any(), (what, diff[over][:4], bound.expand_as(got)[~special][over][:4])


def lockstep(fmt: str, shape, dtype, *, steps=3, specials=False, seed=0, bias=True) -> None:
    """`steps` training steps of one layer on the `torch` backend (fast path) and the same layer
    on `emulated`, side by side on the same inputs and output gradients (step 1 is a check
    step). What both compute the same way by construction must be equal bit for bit: the
    scales (delayed histories, their counts), the overflow counts, the statistics (counts
    exactly, sums to rounding: `assert_same_stats`) and the bias gradient (no GEMM). The GEMM
    results (output, input and weight gradients) are within `reassociation_bound` of each
    other. After each step both layers take the same SGD update (the emulated layer's), so
    every step starts from the same weights."""
    d_in, d_out, lead = shape
    torch.manual_seed(seed)
    base = nn.Linear(d_in, d_out, bias=bias).to(dtype)
    fast, ref = (PrecisionLinear.from_module(base, get_format(fmt), get_backend(b)) for b in ("torch", "emulated"))
    with torch.no_grad():   # separate parameters, the same values
        fast.weight = nn.Parameter(ref.weight.detach().clone())
        if bias:
            fast.bias = nn.Parameter(ref.bias.detach().clone())
    g = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        x = torch.randn(*lead, d_in, generator=g) * 2.0 ** (step * 3 - 3)
        if specials and step == 2:
            n = min(3, x.numel())
            x.view(-1)[:n] = torch.tensor([float("nan"), float("inf"), -float("inf")])[:n]
        x = x.to(dtype)
        w = ref.weight.detach().clone()
        grads = {}
        for name, layer in (("fast", fast), ("ref", ref)):
            layer.collect_stats = step == 1
            xi = x.clone().requires_grad_(True)
            y = layer(xi)
            gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed * 100 + step)).to(dtype)
            y.backward(gy)
            grads[name] = (y.detach(), xi.grad, layer.weight.grad.clone(), layer.bias.grad.clone() if bias else None)
        (y1, gx1, gw1, gb1), (y2, gx2, gw2, gb2) = grads["fast"], grads["ref"]
        x2, gy2 = x.reshape(-1, d_in), gy.reshape(-1, d_out)
        assert_within(y1, y2, reassociation_bound(x2, w.t(), dtype, ref.bias.detach() if bias else None)
                      .reshape(y2.shape), f"output, step {step}")
        assert_within(gx1, gx2, reassociation_bound(gy2, w, dtype).reshape(gx2.shape), f"input grad, step {step}")
        assert_within(gw1, gw2, reassociation_bound(gy2.t(), x2, dtype), f"weight grad, step {step}")
        if bias:
            assert _nan_equal(gb1, gb2), ("bias grad", step)
        if step == 1:
            for k in ("input", "weight", "grad_output"):
                assert_same_stats(fast.stats[k].packed, ref.stats[k].packed)
        with torch.no_grad():
            ref.weight.sub_(ref.weight.grad.nan_to_num() * 1e-2)
            fast.weight.copy_(ref.weight)
        for layer in (fast, ref):
            layer.weight.grad = None
            if bias:
                layer.bias.grad = None
    assert _nan_equal(fast.overflow_steps, ref.overflow_steps)
    for k, h in ref.histories.items():
        assert _nan_equal(fast.histories[k].history, h.history) and _nan_equal(fast.histories[k].count, h.count), k


@pytest.mark.parametrize("fmt", FAST)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fast_path_equals_emulated(fmt, dtype):
    lockstep(fmt, (48, 40, (2, 17)), dtype)


@settings(max_examples=6 if INTERPRETED else 40, deadline=None, derandomize=True)  # interpreted: slow
@given(d_in=st.integers(1, 70), d_out=st.integers(1, 70), tokens=st.integers(1, 70),
       fmt=st.sampled_from(FAST), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       specials=st.booleans(), bias=st.booleans(), seed=st.integers(0, 1000))
def test_fast_path_random_shapes(d_in, d_out, tokens, fmt, dtype, specials, bias, seed):
    """Odd sizes and NaN/Inf inputs (which make outputs and gradients NaN alike); the FP8
    operands themselves: tests/lowprec/sites/fast_path/test_fp8_ops.py, bit for bit."""
    lockstep(fmt, (d_in, d_out, (tokens,)), dtype, specials=specials, seed=seed, bias=bias)


def test_fast_path_is_taken():
    """The torch backend's FP8 formats run FP8LinearFn; nvfp4 and DTensor-free bf16 do not."""
    lin = nn.Linear(32, 16)
    for name, fast in (("fp8_tensorwise", True), ("fp8_rowwise", True), ("fp8_delayed", True),
                       ("mxfp8", False), ("nvfp4", False)):
        layer = PrecisionLinear.from_module(lin, get_format(name), get_backend("torch"))
        assert (layer._fast is not None) == fast, name
        emulated = PrecisionLinear.from_module(lin, get_format(name), get_backend("emulated"))
        assert emulated._fast is None
    y = PrecisionLinear.from_module(lin, get_format("fp8_tensorwise"), get_backend("torch"))(
        torch.randn(4, 32, requires_grad=True))
    assert type(y.grad_fn).__name__ == "FP8LinearFnBackward"


@pytest.mark.skipif(not INTERPRETED, reason="the paired kernels run in the interpreter subprocess")
def test_input_and_weight_are_cast_together():
    """Under the kernels, every fast format casts x and w in one pair, on plain and check steps
    (so the equality with the emulated backend above covers the pair: on check steps its
    statistics too), under torch.no_grad as well, and a cached weight leaves x to FP8LinearFn."""
    from lowprec.numerics.kernels import cast_pair
    calls = []
    real = cast_pair.pair

    def spy(*args, **kwargs):
        calls.append(args[2].name)
        return real(*args, **kwargs)
    cast_pair.pair = spy
    try:
        for name, check in (("fp8_tensorwise", False), ("fp8_delayed", False), ("fp8_rowwise", False),
                            ("fp8_tensorwise", True), ("fp8_delayed", True), ("fp8_rowwise", True)):
            calls.clear()
            layer = PrecisionLinear.from_module(nn.Linear(32, 16), get_format(name), get_backend("torch"))
            layer.collect_stats = check
            x = torch.randn(8, 32, requires_grad=True)
            for _ in range(2):   # the weight changes between the steps, as after an optimizer step
                layer(x).sum().backward()
                with torch.no_grad():
                    layer.weight.mul_(0.5)
            assert len(calls) == 2, (name, check, calls)
            with torch.no_grad():   # an evaluation after an optimizer step: a pair too, x transposed
                layer(x)            # as FP8LinearFn's needs_input_grad (w.requires_grad) asks
            assert len(calls) == 3
            if name == "fp8_tensorwise" and not check:
                layer(x).sum().backward()   # the same weight: a cache hit, x cast alone
                assert len(calls) == 3
    finally:
        cast_pair.pair = real


@pytest.mark.parametrize("fmt", FAST)
def test_saves_fp8_for_backward(fmt):
    """What the layer keeps for its backward is the FP8 input (transposed), the FP8 weight
    (transposed) and their scales: E bytes for the input, not an FP32 or BF16 copy."""
    tokens, d_in, d_out = 64, 96, 80
    layer = PrecisionLinear.from_module(nn.Linear(d_in, d_out).to(torch.bfloat16), get_format(fmt),
                                        get_backend("torch"))
    layer.collect_stats = False
    x = torch.randn(tokens, d_in, dtype=torch.bfloat16, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    # the layer's own state (delayed histories the backward updates) is referenced, not copied
    own = {t.data_ptr() for h in layer.histories.values() for t in (h.history, h.count, h.scratch, h.ticket)}
    saved = [t for t in saved if t is not None and t.data_ptr() not in own]
    big = [t for t in saved if t.numel() > max(d_in, d_out, tokens)]
    assert sorted(t.numel() for t in big) == sorted([tokens * d_in, d_out * d_in])
    assert all(t.element_size() == 1 and t.dtype in (torch.float8_e4m3fn,) for t in big), \
        [(t.dtype, tuple(t.shape)) for t in big]
    scales = sum(t.numel() * t.element_size() for t in saved if t.numel() <= max(d_in, d_out, tokens))
    rows = (d_in + d_in) if fmt == "fp8_rowwise" else 2
    assert scales <= 4 * rows + 8 * 3   # scale_inv (row-wise: one per row) + the overflow counters
    y.float().sum().backward()


def test_weight_cast_cached_across_micro_batches():
    """Gradient accumulation: the weight is cast once per optimizer step (both layouts),
    again after the step; results equal a layer without the cache bit for bit."""
    outs = {}
    for cache in (True, False):
        torch.manual_seed(0)
        layer = PrecisionLinear.from_module(nn.Linear(32, 24), get_format("fp8_rowwise"), get_backend("torch"),
                                            cache_weights=cache)
        layer.collect_stats = False
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        vals = []
        for _ in range(2):
            for _ in range(3):
                layer(torch.randn(8, 32, generator=g)).square().mean().backward()
            vals.append(layer.weight.grad.clone())
            opt.step()
            opt.zero_grad()
        outs[cache] = (vals, layer.weight_cache.hits, layer.weight_cache.misses)
    assert outs[True][1:] == (4, 2) and outs[False][1:] == (0, 0)
    assert all(torch.equal(a, b) for a, b in zip(outs[True][0], outs[False][0]))


@pytest.mark.skipif(INTERPRETED, reason="the graph is the same with the kernels behind the ops (opaque to "
                    "dynamo); 23 s under the interpreter for nothing new")
def test_compile_one_graph_and_one_recompile_per_switch():
    """torch._dynamo.explain: one graph, no break, over PrecisionLinears on the fast path
    (tensor-wise and delayed); compiled training equals eager; switching one site's format
    recompiles once, and running again recompiles nothing."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    model[0] = PrecisionLinear.from_module(model[0], get_format("fp8_tensorwise"), get_backend("torch"))
    model[2] = PrecisionLinear.from_module(model[2], get_format("fp8_delayed"), get_backend("torch"))
    for layer in (model[0], model[2]):
        layer.collect_stats = False
    x = torch.randn(16, 32)
    ex = torch._dynamo.explain(model)(x)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model)
    y = compiled(x)
    y.sum().backward()
    assert counters["stats"]["unique_graphs"] == 1
    model[0].set_format(get_format("fp8_rowwise"))
    for _ in range(2):
        compiled(x).sum().backward()
    assert counters["stats"]["unique_graphs"] == 2


def test_no_host_read_between_checks():
    """Ten training steps of two fast-path sites (tensor-wise and delayed) under the monitor,
    with a check every fifth step: no device value is read on the host in any step's
    forward, backward, optimizer step or `Monitor.record` (no .item(), bool(tensor),
    .tolist() or data-dependent shape), check steps included; only `Monitor.check` reads,
    once per check for all sites together (its one packed vector)."""
    import sys
    sys.path.insert(0, str(ROOT))
    from experiments.traffic import no_host_sync
    from lowprec.policy.monitor import Monitor, MonitorConfig
    from lowprec.sites.plan import PrecisionPlan
    from lowprec.sites.precision_state import prepare

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    plan = PrecisionPlan.from_dict({"backend": "torch", "default": "bf16", "rules": [
        {"name": "a", "select": {"fqns": ["0"]}, "format": "fp8_tensorwise"},
        {"name": "b", "select": {"fqns": ["2"]}, "format": "fp8_delayed"}]})
    state = prepare(model, plan)
    monitor = Monitor(state, MonitorConfig(check_every=5))
    # SGD: AdamW on CPU reads its (CPU-held) step count with .item(), not a GPU sync but a read
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    checks = 0
    for step in range(10):
        x = torch.randn(16, 32)
        with no_host_sync(allowed=0):
            monitor.before_step(step)
            loss = model(x).square().mean()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, foreach=True)
            opt.step()
            opt.zero_grad()
            monitor.record(step, loss, norm)
        if monitor.is_check_step(step):
            signals = monitor.check(step)
            checks += 1
            assert set(signals.sites) == {"0", "2"} and len(signals.losses) == 5
    assert checks == 2
