"""Bad input gets a clear exception; non-finite input follows the documented policy;
QuantStats counts what it says it counts.

The non-finite policy (lowprec/numerics/quantize.py's docstring): NaN stays NaN in every format;
+-Inf stays +-Inf in E5M2 and becomes NaN in E4M3 and E2M1 (which have no Inf); the
other values are quantized with scales from the finite values only, exactly as if the
non-finite entries were not there; the statistics count the non-finite entries.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from lowprec.numerics import (E2M1, E4M3, E5M2, FORMATS, QuantSpec, RandomHadamard, Rounding, Scaling,
                     fake_quantize, format_names, get_format, quantize)
from lowprec.numerics.quantize import QuantStats, operand_blocks

import quant_reference as ref

REF_ELEM = {"e4m3": ref.E4M3, "e5m2": ref.E5M2, "e2m1": ref.E2M1}


def _specs():
    out, seen = [], set()
    for name, fmt in FORMATS.items():
        for role, spec in fmt.specs().items():
            if spec not in seen:
                seen.add(spec)
                out.append(pytest.param(spec, id=f"{name}.{role}"))
    return out


SPECS = _specs()


def _scale_kw(spec, x) -> dict:
    return {"scale": 2.0} if spec.scaling is Scaling.DELAYED else {}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.float().contiguous().view(torch.int32),
                                              b.float().contiguous().view(torch.int32))


# ----------------------------------------------------------------------------- shapes


def test_shape_not_fitting_mx_block_names_shape_block_and_fix():
    spec = get_format("mxfp8").input
    with pytest.raises(ValueError) as e:
        quantize(torch.randn(4, 30), spec)
    msg = str(e.value)
    for part in ("(4, 30)", "1x32", "30", "multiple of 32", "Pad"):
        assert part in msg, (part, msg)
    assert "fp8_tensorwise" in msg or "bf16" in msg          # an alternative that fits


def test_shape_not_fitting_weight_block_rows():
    spec = get_format("fp8_blockwise").weight
    with pytest.raises(ValueError) as e:
        fake_quantize(torch.randn(2, 50, 128), spec)             # rows: 2 * 50 = 100
    msg = str(e.value)
    assert "(2, 50, 128)" in msg and "128x128" in msg and "100 rows" in msg and "multiple of 128" in msg


def test_shape_not_fitting_hadamard():
    spec = replace(get_format("fp8_tensorwise").input, hadamard=True)
    with pytest.raises(ValueError, match=r"Hadamard.*\(24\).*multiple of 16"):
        quantize(torch.randn(3, 24), spec)


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_every_block_format_rejects_an_odd_width(name):
    for role, spec in get_format(name).specs().items():
        with pytest.raises(ValueError, match=r"\(16, 17\)"):
            quantize(torch.randn(16, 17), spec)


# ----------------------------------------------------------------------------- format names


def test_unknown_format_suggests_and_lists():
    with pytest.raises(ValueError) as e:
        get_format("fp8_tensorwse")
    msg = str(e.value)
    assert "'fp8_tensorwse'" in msg
    assert "Did you mean 'fp8_tensorwise'" in msg
    for name in format_names():
        assert name in msg


def test_unknown_format_without_close_match_still_lists():
    with pytest.raises(ValueError) as e:
        get_format("int8")
    assert "Did you mean" not in str(e.value)
    assert all(n in str(e.value) for n in format_names())


@pytest.mark.parametrize("bad", [None, 8, ("fp8",)])
def test_format_name_of_the_wrong_type(bad):
    with pytest.raises(ValueError, match="unknown precision format"):
        get_format(bad)


def test_format_object_passes_through():
    fmt = FORMATS["nvfp4"]
    assert get_format(fmt) is fmt and get_format("nvfp4") is fmt


# ----------------------------------------------------------------------------- amax / scale


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1.0])
@pytest.mark.parametrize("name,role", [("fp8_tensorwise", "input"), ("fp8_rowwise", "grad_output"),
                                       ("nvfp4", "input")])
def test_bad_amax_is_a_value_error(name, role, bad):
    spec = getattr(get_format(name), role)
    x = torch.randn(4, 32)
    for amax in (bad, torch.tensor(bad)):
        with pytest.raises(ValueError, match=r"amax must be finite and >= 0"):
            quantize(x, spec, amax=amax)


def test_bad_amax_inside_a_vector():
    spec = get_format("fp8_rowwise").input
    with pytest.raises(ValueError, match="amax"):
        quantize(torch.randn(3, 8), spec, amax=torch.tensor([1.0, math.nan, 2.0]))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -2.0, 0.0])
def test_bad_scale_is_a_value_error(bad):
    spec = get_format("fp8_delayed").input
    with pytest.raises(ValueError, match=r"scale must be finite and > 0"):
        quantize(torch.randn(4, 8), spec, scale=bad)


def test_zero_amax_is_allowed_and_gives_no_nan():
    for name in ("fp8_tensorwise", "nvfp4"):
        spec = get_format(name).input
        out = fake_quantize(torch.randn(4, 32), spec, amax=0.0)
        assert torch.isfinite(out).all()
        assert torch.equal(fake_quantize(torch.zeros(4, 32), spec, amax=0.0), torch.zeros(4, 32))


def test_delayed_without_scale():
    with pytest.raises(ValueError, match=r"DELAYED needs scale=.*Scaling.TENSOR"):
        quantize(torch.randn(4, 8), get_format("fp8_delayed").input)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64])
def test_non_float_tensors(dtype):
    x = torch.ones(4, 32, dtype=dtype)
    with pytest.raises(TypeError, match=str(dtype)):
        quantize(x, get_format("fp8_tensorwise").input)
    with pytest.raises(TypeError, match="floating-point"):
        fake_quantize(x, get_format("mxfp8").input)


def test_bad_spec_construction():
    with pytest.raises(ValueError, match="block shape"):
        QuantSpec(E4M3, Scaling.BLOCK)
    with pytest.raises(ValueError, match="only applies to Scaling.BLOCK"):
        QuantSpec(E4M3, Scaling.TENSOR, block=(1, 32))
    with pytest.raises(ValueError, match="mx_scale_rounding"):
        QuantSpec(E4M3, Scaling.BLOCK, block=(1, 32), mx_scale_rounding="up")


# ----------------------------------------------------------------------------- non-finite input


def _with_non_finite(spec, seed=0):
    r, c = spec.block if spec.scaling is Scaling.BLOCK else (1, 1)
    rows, cols = max(r, 4), max(c, 64)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 10
    x[0, 0] = math.nan
    x[0, 1] = math.inf           # the same block as the NaN
    x[1, 5] = -math.inf
    x[2, cols - 1] = math.nan
    x[3, 3] = 1e4                # a finite outlier: the amax the scales must come from
    return x


@pytest.mark.parametrize("spec", SPECS)
def test_non_finite_policy(spec):
    x = _with_non_finite(spec)
    nan, pinf, ninf = torch.isnan(x), x == math.inf, x == -math.inf
    fin = torch.isfinite(x)
    kw = _scale_kw(spec, x)

    def fq(t):
        return fake_quantize(t, spec, stats=True, generator=torch.Generator().manual_seed(1), **kw)

    out, stats = fq(x)
    assert stats.numel.item() == x.numel()
    if spec.hadamard:
        # the transform mixes each 16-wide group: a non-finite entry makes its group
        # non-finite (no Inf in E2M1: NaN); the other groups stay finite. The stats are of
        # the transformed operand: every entry of those groups counts.
        groups = (~fin).reshape(x.shape[0], -1, 16).any(-1, keepdim=True).expand(-1, -1, 16).reshape(x.shape)
        assert torch.isnan(out[groups]).all() and torch.isfinite(out[~groups]).all()
        assert stats.nonfinite.item() == groups.sum().item() == 48
        return
    assert stats.nonfinite.item() == (~fin).sum().item() == 4
    assert stats.amax.item() == 1e4
    assert torch.isnan(out[nan]).all()
    if spec.element.has_inf:
        assert (out[pinf] == math.inf).all() and (out[ninf] == -math.inf).all()
    else:
        assert torch.isnan(out[pinf | ninf]).all()
    # the finite entries: as if the non-finite ones were zeros (zeros change no amax)
    expected, _ = fq(torch.where(fin, x, 0.0))
    assert _bits_equal(out[fin], expected[fin])
    if spec.scaling in (Scaling.TENSOR, Scaling.DELAYED) and spec.rounding is Rounding.NEAREST_EVEN:
        # ... and as if they were not there at all
        assert _bits_equal(out[fin], fake_quantize(x[fin], spec, **kw))


def test_non_finite_policy_fused():
    """fused=True (torch.compile) follows the same policy, bit for bit with eager."""
    fmt = get_format("fp8_tensorwise")
    for spec in (fmt.input, fmt.grad_output):
        # (255, 256): the shape test_quantize_torch_parity compiles for, so a full run
        # compiles each spec once (the first shape compiles static, a second recompiles)
        x = torch.full((255, 256), 0.5)
        x[:4, :64] = _with_non_finite(spec)
        eager = fake_quantize(x, spec)
        fused = fake_quantize(x, spec, fused=True)
        assert torch.equal(torch.isnan(fused), torch.isnan(eager))
        ok = ~torch.isnan(eager)
        assert _bits_equal(fused[ok], eager[ok])
        if spec.element is E5M2:
            assert (fused[x == math.inf] == math.inf).all() and (fused[x == -math.inf] == -math.inf).all()
        else:
            assert torch.isnan(fused[torch.isinf(x)]).all()


def test_nan_scale_never_appears():
    """A tensor that is all NaN/Inf has no finite amax: scales stay finite, values non-finite."""
    for spec in [p.values[0] for p in SPECS]:
        x = torch.full((128, 128), math.nan)
        x[::2] = math.inf
        kw = _scale_kw(spec, x)
        q = quantize(x, spec, **kw)
        assert torch.isfinite(q.scale).all() and torch.isfinite(q.scale_inv).all()
        assert not torch.isfinite(q.values).any()


# ----------------------------------------------------------------------------- QuantStats


def _direct_saturated(v: torch.Tensor, elem) -> int:
    """How many finite |v| round (RNE, unbounded exponent) past max: the reference's
    rule per element, vectorised over values that are not near the threshold."""
    r = REF_ELEM[elem.name]
    a = v[torch.isfinite(v)].abs().double()
    clear = (a - 1.125 * r.max).abs() > 0.124 * r.max        # far from max + half a step
    near = a[~clear].tolist()
    return int((a[clear] > 1.125 * r.max).sum()) + sum(ref.rounds_beyond_max(x, r) for x in near)


@pytest.mark.parametrize("elem", [E4M3, E5M2, E2M1], ids=lambda e: e.name)
def test_stats_of_known_content(elem):
    """Delayed scaling with scale 1: the scaled values are the inputs, so every count can be
    read off the list. Ties at the top (max + half a step) are saturated exactly when
    round-to-nearest-even would go past max: not for E4M3 (448 is even), yes for E5M2 and
    E2M1 (57344 and 6 are odd; PyTorch's E5M2 cast gives inf at 61440)."""
    spec = QuantSpec(elem, Scaling.DELAYED)
    top_step = 2.0 ** (elem.max_exp - elem.mantissa_bits)
    tiny = elem.min_subnormal
    vals = [elem.max + top_step / 2,                      # tie at the top
            elem.max + top_step / 2 + top_step / 64,      # just past it: saturated
            -(elem.max + top_step / 4),                   # rounds to -max: not saturated
            -1e30, 3.0e38,                                # saturated
            elem.max, 1.0, -1.5, 0.0, -0.0,
            tiny / 2,                                     # tie with 0: rounds to 0, underflow
            tiny * 0.75,                                  # rounds up to tiny: no underflow
            -tiny / 4, 1e-40,                             # underflow (1e-40 is an FP32 subnormal)
            math.nan, math.inf, -math.inf]
    x = torch.tensor(vals, dtype=torch.float32)
    out, stats = fake_quantize(x, spec, scale=1.0, stats=True)
    fin = torch.isfinite(x)
    saturated = _direct_saturated(x, elem)
    assert saturated == (3 if elem is E4M3 else 4)           # by hand, from the list above
    assert stats.saturated.item() == saturated
    if elem is E5M2:      # the independent oracle: PyTorch's non-saturating cast
        assert saturated == int(torch.isinf(x[fin].to(torch.float8_e5m2).float()).sum())
    assert stats.underflow.item() == 3
    # the energy of those three is below FP32's resolution next to 3e38**2: see the exhaustive test
    assert stats.nonfinite.item() == 3
    assert stats.numel.item() == len(vals)
    assert stats.amax.item() == x[fin].abs().max().item()
    err = (x[fin].double() - out[fin].double())
    torch.testing.assert_close(stats.sq_error, (err * err).sum(), rtol=1e-6, atol=0.0)
    torch.testing.assert_close(stats.signal_power, (x[fin].double() ** 2).sum(), rtol=1e-6, atol=0.0)
    d = stats.to_dict()
    assert d["saturated_frac"] == saturated / len(vals)
    assert d["rel_mse"] == pytest.approx(d["sq_error"] / d["signal_power"])
    assert d["sqnr_db"] == pytest.approx(10 * math.log10(d["signal_power"] / d["sq_error"]))


@pytest.mark.parametrize("spec", SPECS)
def test_stats_against_direct_computation(spec):
    g = torch.Generator().manual_seed(3)
    r, c = spec.block if spec.scaling is Scaling.BLOCK else (1, 1)
    shape = (max(r, 8), max(c, 64))
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-30, 10, (shape[0], 1), generator=g).float())
    x[0, :8] = 0.0
    kw = _scale_kw(spec, x)
    if spec.scaling is Scaling.DELAYED:
        kw = {"scale": spec.element.max / x.abs().max().item() * 4}     # some saturate
    gen = torch.Generator().manual_seed(4)
    q = quantize(x, spec, stats=True, generator=gen, **kw)
    out = fake_quantize(x, spec, generator=torch.Generator().manual_seed(4), **kw)
    st = q.stats
    assert st.packed.dtype == torch.float64 and st.packed.device == x.device
    xt = RandomHadamard(0).apply(x) if spec.hadamard else x
    block = operand_blocks(spec, x.shape)
    rows, k = x.shape
    v = (xt.reshape(rows // block[0], block[0], k // block[1], block[1]) * q.scale).reshape(x.shape)
    assert st.saturated.item() == _direct_saturated(v, spec.element)
    flushed = (xt != 0) & (q.values == 0)
    assert st.underflow.item() == int(flushed.sum())
    torch.testing.assert_close(st.underflow_energy, (xt[flushed].double() ** 2).sum(), rtol=1e-6, atol=0.0)
    dq = q.dequantize()
    torch.testing.assert_close(st.sq_error, ((xt.double() - dq.double()) ** 2).sum(), rtol=1e-5, atol=0.0)
    torch.testing.assert_close(st.signal_power, (xt.double() ** 2).sum(), rtol=1e-6, atol=0.0)
    if not spec.hadamard:     # in the original domain the error is the same
        torch.testing.assert_close(st.sq_error, ((x.double() - out.double()) ** 2).sum(), rtol=1e-5, atol=0.0)
    assert st.nonfinite.item() == 0 and st.numel.item() == x.numel()
    if spec.scaling is Scaling.DELAYED:
        assert st.saturated.item() > 0
    # the rows span 2**-30 to 2**10: every format with one scale per tensor or row flushes some
    d = st.to_dict()
    assert d["underflow_energy_frac"] == pytest.approx(d["underflow_energy"] / d["signal_power"])
    assert 0 <= d["underflow_energy_frac"] <= 1


@pytest.mark.parametrize("elem", [E4M3, E5M2, E2M1], ids=lambda e: e.name)
def test_underflow_of_every_bf16_value(elem):
    """Delayed scaling with scale 1 on every BF16 value up to twice the format's max: a value
    is flushed exactly when the reference (quant_reference.round_rne, written from the bit
    layouts) rounds it to zero; the underflow count and energy are those values' count and
    sum of squares. (The energies are FP32 sums of squares scaled by the amax: exact to
    FP32's resolution relative to the largest terms, which beyond the format's range would
    be the saturated values, not the flushed ones.)"""
    spec = QuantSpec(elem, Scaling.DELAYED)
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    x = x[x.abs() <= 2 * elem.max]
    r = REF_ELEM[elem.name]
    flushed = [v for v in x.tolist() if v != 0 and ref.round_rne(v, r) == 0]
    assert len(flushed) > 1000       # the BF16 values below half the smallest subnormal
    _, st = fake_quantize(x.reshape(1, -1), spec, scale=1.0, stats=True)
    assert st.underflow.item() == len(flushed)
    assert st.underflow_energy.item() == pytest.approx(math.fsum(v * v for v in flushed), rel=1e-6)
    assert st.signal_power.item() == pytest.approx(math.fsum(v * v for v in x.tolist()), rel=1e-6)


@pytest.mark.parametrize("spec", SPECS)
def test_underflow_energy_of_tiny_and_large_values(spec):
    """Half of each row tiny (2**-40 of the rest): a scale per tensor or row flushes the tiny
    half, whose energy is a negligible share; the fraction of flushed values is not."""
    g = torch.Generator().manual_seed(6)
    r, c = spec.block if spec.scaling is Scaling.BLOCK else (1, 1)
    shape = (max(r, 16), max(2 * c, 64))
    x = (torch.rand(shape, generator=g) + 3.0) * torch.randint(0, 2, shape, generator=g).mul(2).sub(1)
    x[:, shape[1] // 2:] *= 2.0 ** -40
    kw = {"scale": spec.element.max / x.abs().max().item()} if spec.scaling is Scaling.DELAYED else {}
    q = quantize(x, spec, stats=True, **kw)
    xt = RandomHadamard(0).apply(x) if spec.hadamard else x
    flushed = (xt != 0) & (q.values == 0)
    d = q.stats.to_dict()
    expected = (xt[flushed].double() ** 2).sum() / (xt.double() ** 2).sum()
    assert d["underflow_energy_frac"] == pytest.approx(expected.item(), rel=1e-6, abs=0.0)
    assert d["underflow_frac"] == flushed.sum().item() / x.numel()
    if spec.scaling in (Scaling.TENSOR, Scaling.DELAYED, Scaling.ROW) and not spec.hadamard:
        assert d["underflow_frac"] == 0.5 and d["underflow_energy_frac"] < 1e-20


def test_stats_fused_equal_eager():
    """fused=True (torch.compile) computes the same statistics as eager, NaN and Inf included."""
    fmt = get_format("fp8_tensorwise")
    for spec in (fmt.input, fmt.grad_output):
        x = torch.full((255, 256), 0.5)       # the shape the other fused tests compile for
        x[:4, :64] = _with_non_finite(spec)
        x[8:16] *= 1e-9                         # flushed to zero
        x[20, :7] = 1e4                         # with this amax, 0.5 is on the grid for neither
        eager = quantize(x, spec, stats=True).stats
        fused = quantize(x, spec, stats=True, fused=True).stats
        assert eager.underflow.item() > 0 and eager.underflow_energy.item() > 0
        counts = [QuantStats.FIELDS.index(f) for f in ("amax", "saturated", "underflow", "nonfinite", "numel")]
        assert torch.equal(fused.packed[counts], eager.packed[counts])
        torch.testing.assert_close(fused.packed, eager.packed, rtol=1e-6, atol=0.0)   # sums in another order


def test_stats_live_on_the_input_device():
    """Stats are device tensors, never host floats (checked on 'meta' too: nothing in the
    stats path may create a tensor on the default device); CUDA when there is one."""
    devices = ["cpu", "meta"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        for spec in (get_format("fp8_tensorwise").input, get_format("nvfp4").weight,
                     get_format("mxfp4").input, get_format("fp8_delayed").grad_output):
            x = torch.randn(16, 64, device=device)
            kw = {"scale": torch.tensor(2.0, device=device)} if spec.scaling is Scaling.DELAYED else {}
            out, stats = fake_quantize(x, spec, stats=True, validate=device != "meta", **kw)
            assert isinstance(stats.packed, torch.Tensor)
            assert stats.packed.device.type == device and stats.packed.shape == (len(QuantStats.FIELDS),)
            assert out.device.type == device


@pytest.mark.parametrize("magnitude", [1e-30, 1e25])
def test_stats_do_not_overflow_or_flush(magnitude):
    """Squares are taken in FP64: FP32 squares of 1e25 overflow and of 1e-30 flush to 0."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 32, generator=g) * magnitude
    # (not fp8_tensorwise at 1e-30: its amax floor of 1e-12 flushes such a tensor to zero)
    cases = [(get_format("fp8_delayed").input, {"scale": 100.0 / magnitude}),
             (get_format("mxfp4").input, {}), (get_format("nvfp4").input, {})]
    if magnitude > 1e-12:
        cases.append((get_format("fp8_tensorwise").input, {}))
    for spec, kw in cases:
        out, st = fake_quantize(x, spec, stats=True, **kw)
        power = (x.double() ** 2).sum()
        err = ((x.double() - out.double()) ** 2).sum()
        assert 0 < err < power < math.inf
        torch.testing.assert_close(st.signal_power, power, rtol=1e-6, atol=0.0)
        torch.testing.assert_close(st.sq_error, err, rtol=1e-5, atol=0.0)
        assert 0 < st.to_dict()["sqnr_db"] < 60


def test_stats_of_an_error_that_overflowed_do_not_raise():
    """A delayed scale far too small (2^-120) dequantizes the largest BF16 values past FP32's
    range: the squared error is inf. SQNR is then -inf dB (the worst), not a math error."""
    from lowprec.numerics.formats import get_format
    from lowprec.numerics.quantize import QuantStats, quantize
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    x = bits[torch.isfinite(bits)].reshape(1, -1)
    spec = get_format("fp8_delayed").specs()["weight"]
    q = quantize(x, spec, scale=torch.tensor(2.0 ** -120), stats=True)
    d = q.stats.to_dict()
    assert d["sq_error"] == math.inf and d["sqnr_db"] == -math.inf
    both = QuantStats(torch.tensor([1.0, 0, 0, math.inf, math.inf, 0, 4, 0], dtype=torch.float64)).to_dict()
    assert math.isnan(both["sqnr_db"])
    clean = QuantStats(torch.tensor([1.0, 0, 0, 0.0, 2.0, 0, 4, 0], dtype=torch.float64)).to_dict()
    assert clean["sqnr_db"] == math.inf
    usual = QuantStats(torch.tensor([1.0, 0, 0, 0.01, 1.0, 0, 4, 0], dtype=torch.float64)).to_dict()
    assert usual["sqnr_db"] == pytest.approx(20.0)
