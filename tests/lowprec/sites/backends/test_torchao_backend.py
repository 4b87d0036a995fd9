"""Backend `torchao`: torchao's Float8Linear as lowprec sites, against the `emulated` backend.

How bit equality is obtained, honestly: both backends quantize to the same bits (same scale
formula, same saturating round-to-nearest-even cast: `test_torchao_casts_are_lowprec_quantizations`),
and both multiply in FP32 with `torch.mm`. They differ in one place only: torchao's emulated
GEMM dequantizes as `fp8 / scale` where lowprec computes `fp8 * scale_inv` (what cuBLAS does
with the reciprocal scales torchao itself passes to `torch._scaled_mm` on CUDA). The two are
the same number exactly when the scale is a power of two. So:

* the `rowwise` recipe (`fp8_rowwise_e4m3_pow2`) has power-of-two scales by construction and
  is compared bit for bit on arbitrary inputs;
* the `tensorwise` recipe (`fp8_tensorwise`) is compared bit for bit on inputs whose amaxes
  are 7 * 2**j (E4M3's max is 7 * 2**6, E5M2's 7 * 2**13, so every scale is a power of two;
  the test asserts that it is), and within 1e-6 of the output's scale on arbitrary inputs
  (the last-bit differences of `/ scale` against `* scale_inv`).

One more thing differs, and not in numerics: a GEMM whose result is 1x1 (two of tokens,
in_features, out_features equal to 1) is a dot product, and PyTorch's CPU `mm` picks its
kernel by the layout of the (K, 1) operand, which torchao's elementwise cast makes
row-major where lowprec's transposed view stays column-major: the same products summed in
another order. The bit-for-bit tests leave those shapes out (`_no_dot_products`); the
last-bits test covers them.

Everything runs on CPU in torchao's emulation mode (`emulate=True`), the backend's default
off CUDA.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

pytest.importorskip("torchao", reason="backend 'torchao' needs torchao: pip install 'lowprec[torchao]'")

from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic  # noqa: E402
from torchao.float8.float8_training_tensor import LinearMMConfig  # noqa: E402
from torchao.float8.config import ScalingGranularity  # noqa: E402

from lowprec import prepare  # noqa: E402
from lowprec.sites.backends import BACKEND_NAMES, get_backend  # noqa: E402
from lowprec.sites.backends.torchao_backend import (TorchAOBackend, TorchAOLinearSite,  # noqa: E402
                                              UnsupportedFormatError, recipe_name)
from lowprec.numerics.formats import get_format  # noqa: E402
from lowprec.sites.layers import PrecisionLinear  # noqa: E402
from lowprec.policy.monitor import Monitor, MonitorConfig  # noqa: E402
from lowprec.sites.plan import PlanError, PrecisionPlan  # noqa: E402
from lowprec.sites.resolution import resolve  # noqa: E402
from lowprec.numerics.quantize import quantize  # noqa: E402

ROWWISE, TENSORWISE = "fp8_rowwise_e4m3_pow2", "fp8_tensorwise"
EMULATED = get_backend("emulated")
PROP = settings(deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow])


def _step(layer, lin: nn.Linear, x: torch.Tensor, g: torch.Tensor, x_grad: bool = True):
    """One forward and backward: (y, dx, dw, db, {operand: packed stats})."""
    x = x.detach().clone().requires_grad_(x_grad)
    lin.weight.grad = None
    if lin.bias is not None:
        lin.bias.grad = None
    y = layer(x)
    y.backward(g)
    db = None if lin.bias is None else lin.bias.grad.clone()
    return (y.detach(), x.grad, lin.weight.grad.clone(), db,
            {k: v.packed.clone() for k, v in layer.stats.items()})


def _both(lin: nn.Linear, fmt: str, x, g, x_grad: bool = True):
    ao = TorchAOBackend(emulate=True).make_site(lin, fmt, name="site")
    ref = PrecisionLinear.from_module(lin, get_format(fmt), EMULATED)
    return _step(ao, lin, x, g, x_grad), _step(ref, lin, x, g, x_grad)


def _assert_bitwise(got, want):
    for name, a, b in zip(("y", "dx", "dw", "db"), got[:4], want[:4]):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name}: max |diff| {(a - b).abs().max().item()}"
    assert got[4].keys() == want[4].keys() == {"input", "weight", "grad_output"}
    for role in want[4]:
        assert torch.equal(got[4][role], want[4][role]), role


@st.composite
def layers(draw):
    """(nn.Linear, x, grad_output): odd sizes included, 1-3 leading dims, bias or not."""
    in_f, out_f = draw(st.integers(1, 72)), draw(st.integers(1, 72))
    lead = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    lin = nn.Linear(in_f, out_f, bias=draw(st.booleans()))
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=gen) * draw(st.sampled_from([1e-3, 0.1, 1.0])))
    x = _spread(torch.randn(*lead, in_f, generator=gen), gen) * draw(st.sampled_from([1e-4, 1.0, 300.0]))
    g = _spread(torch.randn(*lead, out_f, generator=gen), gen) * draw(st.sampled_from([1e-6, 1e-2, 10.0]))
    return lin, x, g


def _spread(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """`t` with rows and columns scaled by different powers of two (2**-6 .. 2**6), so that
    row-wise scales differ along both axes: scaling along the wrong axis cannot pass."""
    rows = torch.randint(-6, 7, t.shape[:-1] + (1,), generator=gen).float()
    cols = torch.randint(-6, 7, (t.shape[-1],), generator=gen).float()
    return t * torch.exp2(rows) * torch.exp2(cols)


def _no_dot_products(lin: nn.Linear, x: torch.Tensor) -> bool:
    """No GEMM of the layer is a dot product (1x1 result): see the module docstring."""
    return sorted((x.numel() // x.shape[-1], lin.in_features, lin.out_features))[1] > 1


def _amax_to_7_pow2(t: torch.Tensor) -> torch.Tensor:
    """`t` with its largest |element| raised to 7 * 2**j (the next one up): E4M3 and E5M2
    tensor-wise scales of the result are powers of two."""
    t = t.clone()
    flat = t.view(-1)
    i = int(flat.abs().argmax())
    a = float(flat[i].abs())
    flat[i] = math.copysign(7.0 * 2.0 ** math.ceil(math.log2(max(a, 1e-30) / 7.0)), float(flat[i]) or 1.0)
    return t


# ---------------------------------------------------------------------- bit for bit


@PROP
@given(layers())
def test_rowwise_recipe_equals_emulated_bit_for_bit(case):
    """torchao's `rowwise` recipe (E4M3 everywhere, power-of-two row scales) and lowprec's
    fp8_rowwise_e4m3_pow2 on the emulated backend: y, dx, dw, db and the statistics."""
    lin, x, g = case
    assume(_no_dot_products(lin, x))
    got, want = _both(lin, ROWWISE, x, g)
    _assert_bitwise(got, want)


@PROP
@given(layers())
def test_tensorwise_recipe_equals_emulated_bit_for_bit_with_pow2_scales(case):
    """torchao's `tensorwise` recipe and lowprec's fp8_tensorwise, where every tensor-wise
    scale is a power of two (amaxes 7 * 2**j; see the module docstring)."""
    lin, x, g = case
    assume(_no_dot_products(lin, x))
    with torch.no_grad():
        lin.weight.copy_(_amax_to_7_pow2(lin.weight))
    x, g = _amax_to_7_pow2(x), _amax_to_7_pow2(g)
    fmt = get_format(TENSORWISE)
    for t, spec in ((x, fmt.input), (lin.weight.detach(), fmt.weight), (g, fmt.grad_output)):
        s = quantize(t.reshape(-1, t.shape[-1]), spec).scale.reshape(())
        assert torch.equal(s, torch.exp2(torch.log2(s).round())), f"scale {s.item()} is not a power of two"
    got, want = _both(lin, TENSORWISE, x, g)
    _assert_bitwise(got, want)


@PROP
@given(layers())
def test_tensorwise_recipe_on_any_input_differs_only_in_the_last_bits(case):
    """Arbitrary amaxes and every shape: torchao's `/ scale` against lowprec's `* scale_inv`
    in the GEMM operands (and the summation order of a dot product), nothing more. Each
    element is within 1e-5 of the sum of the magnitudes it adds up (|x| @ |w|^T + |b| for
    y, and so on): a last-bit difference of every product is far below that, and one
    element quantized a grid step (2**-4 relative, or more) apart is above it unless that
    product is below 1e-4 of the sum. The statistics come from lowprec's quantizer on
    both backends and are equal bit for bit."""
    lin, x, g = case
    got, want = _both(lin, TENSORWISE, x, g)
    x2, g2, w = x.reshape(-1, x.shape[-1]).abs(), g.reshape(-1, g.shape[-1]).abs(), lin.weight.detach().abs()
    sums = {"y": (x2 @ w.t() + (0 if lin.bias is None else lin.bias.detach().abs())).reshape(g.shape),
            "dx": (g2 @ w).reshape(x.shape), "dw": g2.t() @ x2, "db": g2.sum(0)}
    for name, a, b in zip(("y", "dx", "dw", "db"), got[:4], want[:4]):
        if b is not None:
            assert ((a - b).abs() <= 1e-5 * sums[name]).all(), name
    for role in want[4]:
        assert torch.equal(got[4][role], want[4][role]), role


@pytest.mark.parametrize("fmt", [ROWWISE, TENSORWISE])
def test_grad_output_statistics_without_an_input_gradient(fmt):
    """A first layer whose input needs no gradient: only wgrad runs, and grad_output's
    statistics are those of its quantization along the tokens, as on the emulated backend."""
    gen = torch.Generator().manual_seed(3)
    lin = nn.Linear(24, 40)
    x, g = _spread(torch.randn(5, 3, 24, generator=gen), gen), _spread(torch.randn(5, 3, 40, generator=gen), gen)
    if fmt == TENSORWISE:
        with torch.no_grad():
            lin.weight.copy_(_amax_to_7_pow2(lin.weight))
        x, g = _amax_to_7_pow2(x), _amax_to_7_pow2(g)
    got, want = _both(lin, fmt, x, g, x_grad=False)
    assert got[1] is None and want[1] is None
    _assert_bitwise(got, want)


@pytest.mark.parametrize("fmt, granularity, dim", [
    (TENSORWISE, ScalingGranularity.TENSORWISE, None), (ROWWISE, ScalingGranularity.AXISWISE, -1)])
@pytest.mark.parametrize("role", ["input", "grad_output"])
def test_torchao_casts_are_lowprec_quantizations(fmt, granularity, dim, role):
    """torchao's own cast (`hp_tensor_to_float8_dynamic`) gives the FP8 bits and scales of
    lowprec's quantizer with the format's spec, on arbitrary (not power-of-two) amaxes."""
    spec = getattr(get_format(fmt), role)
    torch.manual_seed(4)
    x = torch.randn(37, 29) * torch.logspace(-3, 3, 29)
    ao = hp_tensor_to_float8_dynamic(x, spec.element.torch_dtype, LinearMMConfig(), scaling_granularity=granularity,
                                     axiswise_dim=dim, round_scales_to_power_of_2=fmt == ROWWISE)
    q = quantize(x, spec)
    assert torch.equal(ao._data.view(torch.uint8), q.to_storage().view(torch.uint8))
    assert torch.equal(ao._scale.reshape(-1), q.scale.reshape(-1))


def test_torchao_pow2_rounding_rounds_up_just_below_a_power_of_two():
    """The one known quantization difference (module docstring, docs/config.md): torchao
    rounds a scale down to a power of two as exp2(floor(log2(s))) in FP32, and log2 of
    the FP32 number just below 8 rounds to 3.0, so torchao picks 8 where lowprec picks 4.
    If this fails, torchao changed its rounding: update both documents."""
    x = torch.tensor([[torch.nextafter(torch.tensor(56.0), torch.tensor(99.0)).item(), 1.0]])
    spec = get_format(ROWWISE).input
    assert (448.0 / x.double().abs().max()).float() < 8.0
    ao = hp_tensor_to_float8_dynamic(x, torch.float8_e4m3fn, LinearMMConfig(),
                                     scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=-1,
                                     round_scales_to_power_of_2=True)
    assert ao._scale.item() == 8.0 and quantize(x, spec).scale.item() == 4.0


def test_bf16_site_equals_the_emulated_backend():
    """bf16 bypasses torchao: BF16-rounded operands on an FP32 model, as PrecisionLinear."""
    torch.manual_seed(5)
    lin = nn.Linear(19, 11)
    x, g = torch.randn(4, 19), torch.randn(4, 11)
    ao = TorchAOBackend().make_site(lin, "bf16")
    ref = PrecisionLinear.from_module(lin, get_format("bf16"), EMULATED)
    for a, b in zip(_step(ao, lin, x, g)[:4], _step(ref, lin, x, g)[:4]):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------- switching and state


def _mlp() -> nn.Sequential:
    torch.manual_seed(6)
    return nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16))


def _plan(fmt: str, backend: str = "torchao") -> PrecisionPlan:
    return PrecisionPlan.from_dict({"backend": backend, "rules": [
        {"select": {"glob": "*"}, "format": fmt, "ladder": [fmt, "bf16"]}]})


def test_switching_keeps_parameters_and_optimizer_state():
    """bf16 <-> fp8 per site during training: the same Parameter objects throughout (in the
    site and in every torchao module built for it), the optimizer's state keeps counting,
    and the state_dict keys are those of the original model."""
    model = _mlp()
    keys = list(model.state_dict())
    params = list(model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)           # built BEFORE prepare
    state = prepare(model, _plan(TENSORWISE))
    assert all(isinstance(s.module, TorchAOLinearSite) for s in state.sites.values())
    x = torch.randn(8, 32)
    schedule = [TENSORWISE, "bf16", ROWWISE, "bf16", TENSORWISE]
    for fmt in schedule:
        assert state.set_format("0", fmt) in (["0"], [])
        before = model[0].weight.detach().clone()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        assert not torch.equal(before, model[0].weight.detach())
    assert list(model.parameters()) == params and all(a is b for a, b in zip(model.parameters(), params))
    assert list(model.state_dict()) == keys
    assert opt.state[params[0]]["step"].item() == len(schedule)
    site = state.site("0").module
    assert {k[0] for k in site._float8} == {TENSORWISE, ROWWISE}
    for module in site._float8.values():
        assert module.weight is params[0] and module.bias is params[1]


def test_statistics_appear_on_check_steps_only():
    model = _mlp()
    state = prepare(model, _plan(ROWWISE))
    x = torch.randn(8, 32)
    state.collect_stats(False)
    model(x).sum().backward()
    assert state.stats() == {}
    state.collect_stats(True)
    model(x).sum().backward()
    assert {f: set(s) for f, s in state.stats().items()} == {f: {"input", "weight", "grad_output"}
                                                            for f in ("0", "2")}


def test_monitor_signals_equal_the_emulated_backends():
    """Four training steps under the Monitor (a check every second step, rowwise recipe):
    the losses, gradient norms and every site signal it reports are the same numbers on
    both backends, and the weights after the optimizer steps are the same bits."""
    results = []
    for backend in ("torchao", "emulated"):
        model = _mlp()
        state = prepare(model, _plan(ROWWISE, backend))
        mon = Monitor(state, MonitorConfig(check_every=2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        checks = []
        for step in range(4):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))
            mon.before_step(step)
            opt.zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            loss.backward()
            mon.record(step, loss, torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
            opt.step()
            if mon.is_check_step(step):
                checks.append(mon.check(step))
        results.append((checks, [p.detach().clone() for p in model.parameters()]))
    (ao, ao_params), (em, em_params) = results
    assert len(ao) == len(em) == 2
    for a, b in zip(ao, em):
        assert a.losses == b.losses and a.grad_norms == b.grad_norms
        assert a.sites.keys() == b.sites.keys() == {"0", "2"}
        for fqn in a.sites:
            assert a.sites[fqn] == b.sites[fqn], fqn
            assert set(a.sites[fqn].amax) >= {"input", "weight", "grad_output"}
    assert all(torch.equal(p, q) for p, q in zip(ao_params, em_params))


def test_precision_state_round_trip_and_high_precision_block():
    model = _mlp()
    state = prepare(model, _plan(TENSORWISE))
    state.set_format("2", ROWWISE)
    saved = state.state_dict()
    with state.high_precision():
        assert set(state.formats().values()) == {"bf16"}
    assert state.formats() == {"0": TENSORWISE, "2": ROWWISE}
    other = prepare(_mlp(), _plan(TENSORWISE))
    other.load_state_dict(saved)
    assert other.formats() == {"0": TENSORWISE, "2": ROWWISE}


# ---------------------------------------------------------------------- what is refused, and how


@pytest.mark.parametrize("fmt, says", [
    ("fp8_delayed", "fp8_tensorwise on backend 'torchao'"),
    ("fp8_rowwise", "fp8_rowwise_e4m3_pow2"),
    ("mxfp8", "backend 'te'"), ("nvfp4", "backend 'te'"), ("mxfp4", "'emulated'"),
    ("fp8_blockwise", "Float8BlockScaling"), ("fp4_tensorwise", "'emulated'"),
])
def test_refused_formats_say_what_to_use(fmt, says):
    backend = get_backend("torchao")
    ok, why = backend.supports(fmt)
    assert not ok and says in why and f"{fmt!r}" in why
    site = backend.make_site(nn.Linear(16, 16), "bf16", name="blocks.0.fc")
    with pytest.raises(UnsupportedFormatError, match=r"site 'blocks\.0\.fc': format .* runs: bf16, fp8_tensorwise, "
                                                     r"fp8_rowwise_e4m3_pow2\.$"):
        site.set_format(fmt)
    assert site.format.name == "bf16"
    state = prepare(_mlp(), _plan(TENSORWISE))
    with pytest.raises(ValueError, match="cannot switch"):
        state.set_format("0", fmt)
    with pytest.raises(PlanError, match="backend 'torchao' cannot run"):
        resolve(_mlp(), _plan(fmt), supported=backend.supports)


def test_supported_formats_and_recipes():
    assert "torchao" in BACKEND_NAMES
    backend = get_backend("torchao")
    assert isinstance(backend, TorchAOBackend) and backend.emulate is None
    assert [backend.supports(f) for f in ("bf16", TENSORWISE, ROWWISE)] == [(True, "")] * 3
    assert (recipe_name("bf16"), recipe_name(TENSORWISE), recipe_name(ROWWISE)) == (None, "tensorwise", "rowwise")
    assert get_backend("torchao").supports("fp8_tensorwize")[1].startswith("unknown precision format")


def test_emulation_mode_default_and_forced():
    """Off CUDA the default is torchao's emulation; emulate=False runs torchao's CUDA code
    path (`torch._scaled_mm` with the reciprocal scales), which PyTorch also has on CPU:
    for fp8_tensorwise it is within the last bits of the emulated backend."""
    torch.manual_seed(7)
    lin = nn.Linear(64, 48)
    x, g = torch.randn(32, 64), torch.randn(32, 48)
    auto = get_backend("torchao").make_site(lin, TENSORWISE)
    auto(x)
    assert list(auto._float8) == [(TENSORWISE, True)] and auto.float8_module().config.emulate is True
    real = TorchAOBackend(emulate=False).make_site(lin, TENSORWISE)
    assert real.float8_module().config.emulate is False
    got = _step(real, lin, x, g)
    want = _step(PrecisionLinear.from_module(lin, get_format(TENSORWISE), EMULATED), lin, x, g)
    for a, b in zip(got[:4], want[:4]):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()


def test_amax_group_and_conv1d_are_refused():
    plan = PrecisionPlan.from_dict({"backend": "torchao", "amax_scope": "group", "rules": [
        {"select": {"glob": "*"}, "format": TENSORWISE}]})
    with pytest.raises(ValueError, match="without amax_group"):
        prepare(_mlp(), plan, amax_group=object())
    with pytest.raises(TypeError, match=r"nn\.Linear layers.*Conv1d"):
        TorchAOBackend().make_site(nn.Conv1d(4, 4, 1), TENSORWISE)


def test_importing_the_backend_does_not_import_torchao():
    """torchao (8 s, log lines about CUDA extensions) is imported when the first FP8 site is
    built: not by `import lowprec`, the backend module, get_backend or supports."""
    code = ("import sys, lowprec\nfrom lowprec.sites.backends import get_backend\n"
            "b = get_backend('torchao'); assert b.supports('fp8_tensorwise')[0]\n"
            "s = b.make_site(__import__('torch').nn.Linear(4, 4), 'bf16')\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torchao'))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]" and res.stderr == ""
