"""Property tests of quantization: every element format and every named format's specs.

What is idempotent, and why (x' = fake_quantize(x), quantized again):

* round_to_grid: a grid point is its own nearest grid point, so rounding twice equals
  rounding once, bit for bit; under stochastic rounding a grid point never moves either.
* A fixed scale (delayed scaling's scale=, tensor/row scaling with an explicit amax=):
  x' * s is the grid value q up to FP32 rounding far smaller than half a step, so it
  rounds back to q and x' is reproduced bit for bit.
* Power-of-two scales from the data (MX's E8M0, Float8BlockScaling's POW2): the new amax
  may halve the scale (q_max = max/2 exactly), but then every value is doubled exactly on
  the grid; bit for bit again.
* FP32 scales from the data (current tensor/row scaling): the amax of x' is amax up to
  1 ulp, so the scale can move by an ulp or two: the grid values q are the same, the
  dequantized output only equal within a few ulps.
* NVFP4 with a fixed tensor amax: blocks whose E4M3 scale is a normal number come back
  bit for bit (the scale's rounding error is at most 1/16, so the block max still maps
  to 6). Blocks whose E4M3 scale is subnormal need not:
  test_nvfp4_not_idempotent_with_subnormal_block_scale shows one that flushes to zero.
  Nor do tensors with amax below 2688 / FLT_MAX, whose clamped FP32 scales no longer
  invert each other.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lowprec.numerics import (E2M1, E4M3, E5M2, FORMATS, RandomHadamard, Rounding, Scaling, ScaleEncoding,
                     fake_quantize, quantize, round_to_grid)
from lowprec.numerics.block_scales import nvfp4_up
from lowprec.numerics.quantize import operand_blocks

ELEMENTS = [E4M3, E5M2, E2M1]


def _named_specs():
    out, seen = [], set()
    for name, fmt in FORMATS.items():
        if fmt.is_high_precision:
            continue
        for role, spec in fmt.specs().items():
            if spec not in seen:
                seen.add(spec)
                out.append(pytest.param(spec, id=f"{name}.{role}"))
    return out


SPECS = _named_specs()
PROP = settings(deadline=None, max_examples=12, suppress_health_check=[HealthCheck.too_slow])


def test_every_format_contributes_specs():
    ids = {p.id.split(".")[0] for p in SPECS}
    assert ids == {n for n, f in FORMATS.items() if not f.is_high_precision}
    assert len(SPECS) >= 14


# ----------------------------------------------------------------------------- strategies

finite32 = st.floats(allow_nan=False, allow_infinity=False, width=32)


@st.composite
def operands(draw, spec) -> torch.Tensor:
    """A 2-D FP32 operand that fits `spec`: log-uniform magnitudes around a drawn centre,
    zeros, and a few values drawn freely by hypothesis. |x| < 2**120: next to FLT_MAX a
    dequantized grid value can exceed the FP32 range (a value rounded up to 2**128)."""
    r, c = spec.block if spec.scaling is Scaling.BLOCK else (1, 1)
    if spec.hadamard:
        c = math.lcm(c, 16)
    rows = r * draw(st.integers(1, 4 if r == 1 else 2 if r == 16 else 1))
    cols = c * draw(st.integers(1, 2 if c >= 128 else 3 if c >= 16 else 40))
    seed = draw(st.integers(0, 2**31 - 1))
    spread = draw(st.floats(0.0, 40.0))
    centre = draw(st.floats(-150.0, 100.0))
    zeros = draw(st.sampled_from([0.0, 0.0, 0.3, 1.0]))
    g = torch.Generator().manual_seed(seed)
    expo = (centre + spread * (torch.rand(rows, cols, generator=g) - 0.5)).clamp(max=119.0)
    x = torch.randn(rows, cols, generator=g).sign() * torch.exp2(expo)
    x[torch.rand(rows, cols, generator=g) < zeros] = 0.0
    for v in draw(st.lists(finite32.filter(lambda v: abs(v) < 2.0**120), max_size=6)):
        x.view(-1)[draw(st.integers(0, x.numel() - 1))] = v
    return x


def _transformed(x2: torch.Tensor, spec) -> torch.Tensor:
    return RandomHadamard(0).apply(x2) if spec.hadamard else x2


def _fixed_scale_kwargs(spec, x2: torch.Tensor) -> dict:
    """Arguments that pin the scale: scale= for delayed, amax= where the scale comes from one."""
    xt = _transformed(x2, spec)
    if spec.scaling is Scaling.DELAYED:
        amax = xt.abs().amax().item()
        return {"scale": min(spec.element.max / amax, 1e30) if amax > 0 else 1.0}
    if spec.scaling is Scaling.TENSOR or spec.scale_encoding is ScaleEncoding.E4M3_FP32:
        return {"amax": xt.abs().amax()}
    if spec.scaling is Scaling.ROW:
        return {"amax": xt.abs().amax(dim=1)}
    return {}        # power-of-two block scales: idempotent from the data alone


def _rne(spec):
    return spec.with_rounding(Rounding.NEAREST_EVEN)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.float().contiguous().view(torch.int32),
                                              b.float().contiguous().view(torch.int32))


def _on_grid(values: torch.Tensor, elem) -> bool:
    return bool(torch.isin(values.abs().double(), elem.grid()).all())


def _neighbours(a: torch.Tensor, elem) -> tuple[torch.Tensor, torch.Tensor]:
    """Grid points lo <= a <= hi around non-negative float64 `a` (both max beyond max)."""
    grid = elem.grid()
    i = (torch.searchsorted(grid, a, right=True) - 1).clamp(0, len(grid) - 1)
    lo = grid[i]
    hi = grid[(i + 1).clamp(max=len(grid) - 1)]
    beyond = a >= elem.max
    return torch.where(beyond, elem.max, lo), torch.where(beyond, elem.max, hi)


def _blocks(t: torch.Tensor, block) -> torch.Tensor:
    rows, k = t.shape
    return t.reshape(rows // block[0], block[0], k // block[1], block[1])


# ----------------------------------------------------------------------------- element level


def _ties(elem) -> list[float]:
    """Midpoints between neighbouring grid values, and the one above max."""
    g = elem.grid().tolist()
    top = g[-1] + 2.0 ** (elem.max_exp - elem.mantissa_bits) / 2
    return [(a + b) / 2 for a, b in zip(g, g[1:])] + [top]


@pytest.mark.parametrize("elem", ELEMENTS, ids=lambda e: e.name)
@settings(deadline=None, max_examples=60)
@given(data=st.data())
def test_round_to_grid_is_rne_and_saturating(elem, data):
    special = st.tuples(st.sampled_from(_ties(elem) + elem.grid().tolist()), st.sampled_from([1.0, -1.0]))
    vals = data.draw(st.lists(st.one_of(finite32, special.map(lambda p: p[0] * p[1])),
                              min_size=1, max_size=64))
    v = torch.tensor(vals, dtype=torch.float32)
    r = round_to_grid(v, elem)
    assert _on_grid(r, elem)
    assert torch.equal(torch.signbit(r), torch.signbit(v))
    assert _bits_equal(round_to_grid(r, elem), r)                       # idempotent
    a = v.abs().double()
    lo, hi = _neighbours(a, elem)
    ra = r.abs().double()
    assert bool(((ra == lo) | (ra == hi)).all())
    # nearest: never farther than the other neighbour; at a tie the even code wins
    # (in the ascending grid, a code's index has the parity of its mantissa's last bit)
    # (below max; at and beyond max it saturates)
    inr = a < elem.max
    a, lo, hi, ra = a[inr], lo[inr], hi[inr], ra[inr]
    err, other = (ra - a).abs(), torch.where(ra == lo, hi - a, a - lo).abs()
    assert bool((err <= other).all())
    assert bool((err <= (hi - lo) / 2).all())
    tie = err == other
    idx = torch.searchsorted(elem.grid(), ra[tie])
    assert bool((idx % 2 == 0).all())
    sat = v.abs().double() >= elem.max
    assert bool((r.abs()[sat] == elem.max).all())


@pytest.mark.parametrize("elem", ELEMENTS, ids=lambda e: e.name)
def test_round_to_grid_saturates_everything_beyond_max(elem):
    big = torch.tensor([elem.max, elem.max * 1.0001, elem.max * 2, 1e30, 3.4e38, math.inf])
    assert torch.equal(round_to_grid(big, elem), torch.full_like(big, elem.max))
    assert torch.equal(round_to_grid(-big, elem), torch.full_like(big, -elem.max))
    assert torch.isnan(round_to_grid(torch.tensor([math.nan]), elem)).all()


@pytest.mark.parametrize("elem", ELEMENTS, ids=lambda e: e.name)
@settings(deadline=None, max_examples=40)
@given(vals=st.lists(finite32, min_size=1, max_size=64), seed=st.integers(0, 2**31 - 1))
def test_stochastic_rounding_lands_on_a_neighbour(elem, vals, seed):
    v = torch.tensor(vals, dtype=torch.float32)
    noise = torch.rand(v.shape, generator=torch.Generator().manual_seed(seed))
    r = round_to_grid(v, elem, noise)
    lo, hi = _neighbours(v.abs().double(), elem)
    ra = r.abs().double()
    assert bool(((ra == lo) | (ra == hi)).all())
    # grid points are fixed points of stochastic rounding too, whatever the noise
    assert _bits_equal(round_to_grid(r, elem, noise), r)
    assert _bits_equal(round_to_grid(r, elem, torch.full_like(noise, 0.999999)), r)


# ----------------------------------------------------------------------------- every named spec


@pytest.mark.parametrize("spec", SPECS)
@PROP
@given(data=st.data())
def test_values_on_grid_and_within_half_a_step(spec, data):
    x = data.draw(operands(spec))
    kw = data.draw(st.sampled_from([{}, _fixed_scale_kwargs(spec, x)]))
    if spec.scaling is Scaling.DELAYED:
        kw = _fixed_scale_kwargs(spec, x)
        kw["scale"] *= data.draw(st.sampled_from([1.0, 0.25, 8.0]))       # 8: saturates
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    q = quantize(x, spec, generator=gen, **kw)
    elem = spec.element
    assert q.values.dtype == torch.float32 and q.values.shape == x.shape
    assert _on_grid(q.values, elem)
    assert torch.isfinite(q.scale).all() and (q.scale >= 0).all()
    # in the scaled domain, the value is a grid neighbour of x * scale, the nearest one
    # under RNE (up to the FP32 rounding of the product), and +-max beyond max
    block = operand_blocks(spec, x.shape)
    xt = _transformed(x, spec)
    up = 1.0
    if spec.scale_encoding is ScaleEncoding.E4M3_FP32:   # a tensor too small for NVFP4's FP32 tensor scale
        up = nvfp4_up(torch.as_tensor(kw.get("amax", xt.abs().amax()), dtype=torch.float32)).double()
    v = (_blocks(xt, block).double() * up * q.scale.double()).reshape(x.shape)
    qa, a = q.values.abs().double(), v.abs()
    lo, hi = _neighbours(a, elem)
    assert torch.equal(qa[a >= elem.max], torch.full_like(qa[a >= elem.max], elem.max))
    inr = a < elem.max
    qa, a, lo, hi = qa[inr], a[inr], lo[inr], hi[inr]
    slack = a * 2.0**-23
    if spec.rounding is Rounding.NEAREST_EVEN:
        bad = (qa - a).abs() > (hi - lo) / 2 * (1 + 2.0**-20) + slack
    else:
        bad = (qa < lo - slack) | (qa > hi + slack)
    assert not bad.any(), f"x*scale {a[bad][:4].tolist()} -> {qa[bad][:4].tolist()}"
    assert torch.equal(torch.signbit(q.values[q.values != 0]), torch.signbit(v[q.values != 0]))
    deq = q.dequantize()
    assert torch.isfinite(deq).all()


@pytest.mark.parametrize("spec", SPECS)
@PROP
@given(data=st.data())
def test_fake_quantize_idempotent(spec, data):
    """See the module docstring for which of these are bit-exact and why."""
    spec = _rne(spec)          # stochastic rounding: covered by the fixed-point test above
    x = data.draw(operands(spec))
    kw = _fixed_scale_kwargs(spec, x)
    once = fake_quantize(x, spec, **kw)
    twice = fake_quantize(once, spec, **kw)
    if spec.scale_encoding is ScaleEncoding.E4M3_FP32:
        # compare the blocks whose E4M3 scale is zero or normal, unless the FP32 tensor scale
        # is clamped to FLT_MAX (amax < 2688 / FLT_MAX ~ 7.9e-36): then the encode scale is
        # clamped too and no longer the inverse of the decode scale
        q = quantize(x, spec, **kw)
        amax = kw["amax"].item()
        flt_max = torch.finfo(torch.float32).max
        if 0 < amax < 2688.0 / flt_max:
            assert torch.isfinite(twice).all()
            return
        s_enc = 2688.0 / amax if amax > 0 else 1.0
        sb = q.scale_inv.double() * s_enc                 # ~ the E4M3 block scales
        ok = (sb == 0) | (sb >= 2.0**-6 * (1 - 1e-5))
        block = operand_blocks(spec, x.shape)
        ok = ok.expand(_blocks(x, block).shape).reshape(x.shape)
        assert _bits_equal(twice[ok], once[ok])
    else:
        assert _bits_equal(twice, once)
    if spec.scaling in (Scaling.TENSOR, Scaling.ROW) and spec.scale_encoding is ScaleEncoding.FP32:
        # current scaling from the data: the grid values are idempotent; the output within
        # a few ulps (the amax, hence the FP32 scale, can move by an ulp). Not with power-of-two
        # row scales (fp8_rowwise_e4m3_pow2): an amax that rounding moved below max / 2**k
        # doubles the scale and the grid value, which dequantizes to the same number (checked above)
        q1, q2 = quantize(x, spec), quantize(fake_quantize(x, spec), spec)
        assert _bits_equal(q2.values, q1.values)
        torch.testing.assert_close(fake_quantize(fake_quantize(x, spec), spec), fake_quantize(x, spec),
                                   rtol=2.0**-20, atol=0.0)


def test_nvfp4_not_idempotent_with_subnormal_block_scale():
    """A block whose E4M3 scale is the subnormal 2**-9 and whose max maps to 3 (not 6):
    quantized again, its amax asks for a scale of 2**-10, a tie that rounds to 0."""
    spec = FORMATS["nvfp4"].input
    x = torch.zeros(2, 16)
    x[0, 0] = 1000.0                     # s_enc = 2.688
    # 448 * b / 1000 = 0.54 * 2**-9: sb = 2**-9, b * s_enc / sb = 6 * 0.54 = 3.24 -> 3
    x[1, 0] = 0.54 * 2.0**-9 * 1000.0 / 448.0
    amax = torch.tensor(1000.0)
    once = fake_quantize(x, spec, amax=amax)
    assert quantize(x, spec, amax=amax).values[1, 0] == 3.0 and once[1, 0] != 0
    twice = fake_quantize(once, spec, amax=amax)
    assert twice[1, 0] == 0 and twice[0, 0] == once[0, 0]


@pytest.mark.parametrize("spec", [p for p in SPECS if p.values[0].scaling in (Scaling.TENSOR, Scaling.ROW)
                                  or p.values[0].scale_encoding is ScaleEncoding.E4M3_FP32])
@PROP
@given(data=st.data())
def test_saturation_with_a_too_small_amax(spec, data):
    """amax= below the data's (e.g. a stale or shard-local amax) saturates, never overflows.
    (Only where amax= sets the scale: MX and power-of-two block scales ignore it.)"""
    x = data.draw(operands(spec))
    assume(x.abs().amax() > 1e-10)          # above the 1e-12 amax floor once divided by 4
    xt = _transformed(x, spec)
    amax = xt.abs().amax() / 4 if spec.scaling is not Scaling.ROW else xt.abs().amax(dim=1) / 4
    q = quantize(x, spec, amax=amax, generator=torch.Generator().manual_seed(0))
    assert q.values.abs().max() == spec.element.max
    assert _on_grid(q.values, spec.element) and torch.isfinite(q.dequantize()).all()


def test_delayed_scaling_saturates_at_max():
    for spec in (FORMATS["fp8_delayed"].input, FORMATS["fp8_delayed"].grad_output):
        x = torch.tensor([[1.0, -2.0, 1e5, -1e30, 3.0e38, 0.5]])
        q = quantize(x, spec, scale=448.0)
        m = spec.element.max
        assert q.values[0].tolist() == [448.0, -896.0 if m > 896 else -m, m, -m, m, 224.0]
        assert fake_quantize(x, spec, scale=448.0)[0, 3].item() == -m / 448.0


# ----------------------------------------------------------------------------- stochastic rounding


def _tiled(spec, reps: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A base operand (one block row high) and `reps` copies stacked: every copy sees the
    same scales, so each draw is an independent rounding of the same values."""
    r, c = spec.block if spec.scaling is Scaling.BLOCK else (1, 1)
    rows, cols = max(r, 16), max(c, 128)
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-6, 6, (rows, 1), generator=g).float())
    return base, base.repeat(reps, 1)


@pytest.mark.parametrize("spec", SPECS)
def test_stochastic_rounding_is_unbiased(spec):
    """Mean over N draws of fake_quantize (stochastic) is x within 6 standard errors.

    One draw's error has sd <= step/2, so the mean of N has sd <= step / (2 sqrt N), with
    step the grid spacing around x * scale, back in x's units. RNE fails this badly (errors
    up to step/2 that do not average out); so does any rounding biased by >~1% of a step.
    """
    spec = spec.with_rounding(Rounding.STOCHASTIC)
    base, _ = _tiled(spec, 1, seed=7)
    reps = max(64, 2**20 // base.numel())
    base, x = _tiled(spec, reps, seed=7)
    kw = _fixed_scale_kwargs(spec, x) if spec.scaling is Scaling.DELAYED else {}
    gen = torch.Generator().manual_seed(11)
    draws = fake_quantize(x, spec, generator=gen, **kw).reshape(reps, *base.shape).double()
    mean = draws.mean(0)
    # the local step, from the scale lowprec used (in the Hadamard domain the step is
    # mixed by an orthonormal matrix: bound it by the block's largest step)
    q = quantize(base, spec.with_rounding(Rounding.NEAREST_EVEN), **kw)
    block = operand_blocks(spec, base.shape)
    v = (_blocks(_transformed(base, spec), block).double() * q.scale.double()).reshape(base.shape)
    lo, hi = _neighbours(v.abs(), spec.element)
    scale = (q.scale.double().expand(_blocks(base, block).shape).reshape(base.shape))
    step = torch.where(scale > 0, (hi - lo) / scale, 0.0)
    step_t = step                    # in the domain where the rounding happens
    if spec.hadamard:
        step = step.reshape(base.shape[0], -1, 16).amax(-1, keepdim=True).expand(-1, -1, 16).reshape(base.shape)
    # Values at or beyond max saturate: deterministic, hence biased. Only NVFP4 has them
    # under current scaling (the E4M3 block scale is rounded, down by up to 1/16, so the
    # block max can map above 6); with the Hadamard transform they bias their whole block.
    inr = v.abs() < spec.element.max
    if spec.hadamard:
        inr = inr.reshape(base.shape[0], -1, 16).all(-1, keepdim=True).expand(-1, -1, 16).reshape(base.shape)
    assert inr.float().mean() > (0.25 if spec.hadamard else 0.8)
    n = reps
    tol = 6 * step / (2 * math.sqrt(n)) + 1e-6 * base.abs().double()
    err = mean - base.double()
    bad = (err.abs() > tol) & inr
    assert not bad.any(), f"{int(bad.sum())} biased, worst {float((err.abs() / tol)[inr].max()):.2f} x tolerance"
    # and on average over the elements, no drift of magnitudes (towards or away from 0),
    # relative to the steps: a 1% bias of the rounding probability fails this
    xt = _transformed(base, spec).double()
    err_t = _transformed(mean.float(), spec).double() - xt if spec.hadamard else err
    ok_t = (step_t > 0) & (v.abs() < spec.element.max)
    rel = (err_t * xt.sign() / step_t.clamp(min=1e-300))[ok_t]
    assert abs(rel.mean().item()) < 6 * 0.5 / math.sqrt(n * rel.numel()), rel.mean().item()
    # it is actually random: off-grid values take both neighbours across draws
    assert bool((draws.amax(0) != draws.amin(0)).any())


@pytest.mark.parametrize("spec", SPECS)
def test_stochastic_rounding_is_reproducible(spec):
    spec = spec.with_rounding(Rounding.STOCHASTIC)
    base, x = _tiled(spec, 4, seed=3)
    kw = _fixed_scale_kwargs(spec, x) if spec.scaling is Scaling.DELAYED else {}

    def run(seed):
        return quantize(x, spec, generator=torch.Generator().manual_seed(seed), **kw).values

    assert _bits_equal(run(5), run(5))
    assert not torch.equal(run(5), run(6))


# ----------------------------------------------------------------------------- Hadamard


def _walsh(n: int) -> torch.Tensor:
    """H[i, j] = (-1)**popcount(i & j): the Sylvester Hadamard matrix, written differently."""
    return torch.tensor([[(-1.0) ** bin(i & j).count("1") for j in range(n)] for i in range(n)],
                        dtype=torch.float64)


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_hadamard_matrix_is_orthonormal_signed_walsh(seed):
    h = RandomHadamard(seed)
    m = h.matrix(dtype=torch.float64)
    assert m.shape == (16, 16)
    assert torch.equal(m @ m.T, torch.eye(16, dtype=torch.float64))    # exact: entries are +-1/4
    assert torch.equal(m.abs(), torch.full((16, 16), 0.25, dtype=torch.float64))
    signs = (m * 4 / _walsh(16))                                       # rows of +-1: D
    assert torch.equal(signs, signs[:, :1].expand(16, 16)) and bool((signs.abs() == 1).all())
    assert torch.equal(RandomHadamard(seed).matrix(dtype=torch.float64), m)       # seeded


def test_hadamard_built_under_a_meta_default_device_has_its_matrix():
    """A model built under `torch.device("meta")` (torchtitan's, NVFP4 sites included) gets the same
    transform as one built on the CPU (before: a meta matrix, 'Cannot copy out of meta tensor')."""
    with torch.device("meta"):
        h = RandomHadamard(3)
    assert torch.equal(h.matrix(dtype=torch.float64), RandomHadamard(3).matrix(dtype=torch.float64))


def test_hadamard_seeds_differ():
    assert not torch.equal(RandomHadamard(0).matrix(), RandomHadamard(1).matrix())


@settings(deadline=None, max_examples=40)
@given(rows=st.integers(1, 4), blocks=st.integers(1, 4), seed=st.integers(0, 2**16),
       data=st.data())
def test_hadamard_round_trips_and_preserves_norms(rows, blocks, seed, data):
    vals = data.draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=rows * blocks * 16,
                              max_size=rows * blocks * 16))
    x = torch.tensor(vals, dtype=torch.float32).reshape(rows, blocks * 16)
    h = RandomHadamard(seed)
    y = h.apply(x)
    xb = x.double().reshape(rows, blocks, 16)
    block_norm = xb.norm(dim=-1, keepdim=True)
    tol = 1e-6 * block_norm + 1e-30
    # y is x times the block-diagonal matrix, computed in float64 independently
    y64 = (xb @ h.matrix(dtype=torch.float64))
    assert bool(((y.double().reshape_as(y64) - y64).abs() <= tol).all())
    back = h.invert(y).double().reshape(rows, blocks, 16)
    assert bool(((back - xb).abs() <= tol).all())
    assert torch.allclose(y.double().reshape(rows, blocks, 16).norm(dim=-1, keepdim=True), block_norm,
                          rtol=1e-6, atol=1e-30)


def test_hadamard_rejects_bad_width():
    with pytest.raises(ValueError, match="multiple of 16"):
        RandomHadamard(0).apply(torch.zeros(2, 24))


@pytest.mark.parametrize("spec", [p for p in SPECS if p.values[0].hadamard])
@PROP
@given(data=st.data())
def test_fake_quantize_with_hadamard_returns_to_the_original_domain(spec, data):
    x = data.draw(operands(spec))
    assume(x.abs().amax() > 1e-30)
    spec = _rne(spec)
    h = RandomHadamard(data.draw(st.integers(0, 100)))
    out = fake_quantize(x, spec, hadamard=h)
    q = quantize(x, spec, hadamard=h)
    assert torch.equal(out, h.invert(q.dequantize()))
    # the Hadamard-domain values are far from x; the result is close to x, as close as the
    # quantization of the transformed tensor is to that tensor (an orthonormal map)
    xt = h.apply(x)
    err_t = (q.dequantize().double() - xt.double()).norm()
    torch.testing.assert_close((out.double() - x.double()).norm(), err_t, rtol=1e-4,
                               atol=1e-6 * x.double().norm().item())
    if x.abs().amax() > 1e-20 and (x != 0).sum() > 16:
        assert (out.double() - x.double()).norm() < 0.5 * (xt.double() - x.double()).norm()
