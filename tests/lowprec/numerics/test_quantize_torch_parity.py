"""Tensorwise FP8 quantization agrees bit for bit with PyTorch's own float8 casts.

The definition (docs: DESIGN.md "Numerics"): scale s = fp8_max / max(amax, 1e-12) in FP32,
values x * s saturated to +-fp8_max and rounded to nearest even, then divided back by s.
The "naive route" below writes that with PyTorch's casts: (x * s).to(float8).float() / s.

One known difference is not a bug: PyTorch's float8_e5m2 cast does not saturate
(|v| >= 61440 gives inf, the rounding of the first value past 57344), while lowprec
saturates every finite value to +-57344. The naive route therefore clamps to +-max before
casting, and test_e5m2_cast_differs_only_by_saturation pins the difference down.
float8_e4m3fn casts saturate in PyTorch 2.13 but gave NaN past 464 in 2.11
(seen on CPU and CUDA), so E4M3 values are clamped before the cast too.

The CUDA variants run where a GPU is present (and are skipped elsewhere): the same
bits on the GPU, eager and fused (Triton).

Comparisons are of FP32 bit patterns, so -0.0 and +0.0 are told apart; NaN never occurs
because the inputs are finite.
"""

from __future__ import annotations

import math

import pytest
import torch

from lowprec.numerics import E4M3, E5M2, fake_quantize, get_format, quantize, round_to_grid

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])
DEVICES = ["cpu", CUDA]
TENSORWISE = get_format("fp8_tensorwise")
SPECS = {"e4m3": TENSORWISE.input, "e5m2": TENSORWISE.grad_output}


def _all_bf16(finite: bool = True, device: str = "cpu") -> torch.Tensor:
    """Every BF16 bit pattern (65,536 of them) as FP32; without Inf/NaN when `finite`."""
    v = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    if finite:
        v = v[torch.isfinite(v)]
    return v.float().to(device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous().view(torch.int32)


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = actual.float(), expected.float()
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    assert torch.equal(nan_a, nan_e), f"{what}: NaN in different places: {int((nan_a != nan_e).sum())}"
    diff = (_bits(a) != _bits(e)) & ~nan_a
    if diff.any():
        idx = diff.flatten().nonzero()[:5].flatten()
        pytest.fail(f"{what}: {int(diff.sum())} of {diff.numel()} differ; "
                    f"lowprec {a.flatten()[idx].tolist()} vs torch {e.flatten()[idx].tolist()}")


def naive_fake_quant(x: torch.Tensor, elem_name: str, amax: torch.Tensor | None = None) -> torch.Tensor:
    """(x * s) cast by PyTorch to float8 and back, / s, with s = max / max(amax, 1e-12)."""
    fmax = torch.finfo(FP8[elem_name]).max
    xf = x.float()
    if amax is None:
        amax = xf.abs().amax()
    amax = torch.as_tensor(amax, dtype=torch.float32, device=xf.device).clamp(min=1e-12)
    s = torch.tensor(fmax, dtype=torch.float32, device=xf.device) / amax   # IEEE FP32 division
    v = (xf * s).clamp(-fmax, fmax)                             # e5m2: saturate (torch gives inf)
    return v.to(FP8[elem_name]).float() / s


# ----------------------------------------------------------------------------- round_to_grid


def test_formats_match_torch_finfo():
    assert E4M3.max == torch.finfo(torch.float8_e4m3fn).max
    assert E5M2.max == torch.finfo(torch.float8_e5m2).max
    assert E4M3.min_normal == torch.finfo(torch.float8_e4m3fn).tiny
    assert E5M2.min_normal == torch.finfo(torch.float8_e5m2).tiny


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_round_to_grid_equals_torch_cast_on_every_bf16(name, device):
    elem = E4M3 if name == "e4m3" else E5M2
    v = _all_bf16(finite=False, device=device)
    v = torch.where(torch.isnan(v), v, v.clamp(-elem.max, elem.max))     # NaN stays NaN in both
    assert_bits_equal(round_to_grid(v, elem), v.to(FP8[name]).float(), name)


def test_round_to_grid_saturates_infinities():
    """(Callers turn Inf into NaN for E4M3/E2M1, or back into Inf for E5M2.)"""
    inf = torch.tensor([math.inf, -math.inf])
    assert round_to_grid(inf, E4M3).tolist() == [448.0, -448.0]
    assert round_to_grid(inf, E5M2).tolist() == [57344.0, -57344.0]


def test_e5m2_cast_differs_only_by_saturation():
    v = _all_bf16()
    ours = round_to_grid(v, E5M2)
    theirs = v.to(torch.float8_e5m2).float()
    differ = _bits(ours) != _bits(theirs)
    # exactly the values torch rounds past the largest finite E5M2 number ...
    assert torch.equal(differ, torch.isinf(theirs))
    assert torch.equal(differ, v.abs() >= 61440.0)
    # ... which lowprec saturates
    assert torch.equal(ours[differ], torch.copysign(torch.full_like(ours[differ], E5M2.max), v[differ]))


def test_round_to_grid_on_dense_fp32_range():
    """Every FP32 value with 7 random low mantissa bits cleared, over the whole fp8 range."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0x00000001, 0x47800000, (1 << 20,), generator=g, dtype=torch.int32)
    v = bits.view(torch.float32)                      # FP32 subnormals up to 65536
    v = torch.cat([v, -v])
    for name, elem in (("e4m3", E4M3), ("e5m2", E5M2)):
        w = v.clamp(-elem.max, elem.max)
        assert_bits_equal(round_to_grid(w, elem), w.to(FP8[name]).float(), name)


# ----------------------------------------------------------------------------- fake_quantize


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_tensorwise_equals_naive_route_on_every_bf16(name, device):
    spec = SPECS[name]
    x = _all_bf16(device=device)
    assert_bits_equal(fake_quantize(x, spec), naive_fake_quant(x, name), f"{name} fp32")
    # BF16 in, BF16 out: the same values rounded once more to BF16
    xb = x.bfloat16()
    out = fake_quantize(xb, spec)
    assert out.dtype == torch.bfloat16
    assert_bits_equal(out.float(), naive_fake_quant(x, name).bfloat16().float(), f"{name} bf16")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_tensorwise_equals_naive_route_under_many_scales(name, device):
    """Every BF16 value under 40 scales: for each amax A, the BF16 values with |v| <= A
    (their own amax), and all of them with an explicit amax A (larger values saturate)."""
    spec = SPECS[name]
    x = _all_bf16(device=device)
    g = torch.Generator().manual_seed(1)
    log2a = torch.empty(40).uniform_(-130.0, 127.0, generator=g)
    log2a[:4] = torch.tensor([-149.0, -40.0, 0.0, 8.0])           # below eps, around 1 and the max
    for A in torch.exp2(log2a).tolist():
        sub = x[x.abs() <= A]
        if sub.numel():
            assert_bits_equal(fake_quantize(sub, spec), naive_fake_quant(sub, name), f"{name} amax<={A:g}")
        amax = torch.tensor(A, device=device)
        assert_bits_equal(fake_quantize(x, spec, amax=amax), naive_fake_quant(x, name, amax),
                          f"{name} amax={A:g}")


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_rowwise_equals_naive_route_per_row(name):
    """fp8_rowwise: every row has its own scale; rows are the BF16 values shuffled and cut
    into 255 rows of 256, each row multiplied by its own power of ten."""
    spec = getattr(get_format("fp8_rowwise"), "input" if name == "e4m3" else "grad_output")
    g = torch.Generator().manual_seed(2)
    x = _all_bf16()
    x = x[torch.randperm(x.numel(), generator=g)].reshape(255, 256)
    x = x.clamp(-1e30, 1e30) * torch.logspace(-8, 8, 255)[:, None]
    expected = torch.stack([naive_fake_quant(row, name) for row in x])
    assert_bits_equal(fake_quantize(x, spec), expected, f"{name} rowwise")


def _large(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed({"normal": 3, "heavy": 4, "tiny": 5}[kind])
    x = torch.randn(2048, 2048, generator=g)
    if kind == "heavy":          # lognormal magnitudes: a few values 1e6 times the median
        x = x.sign() * torch.exp(2.5 * torch.randn(2048, 2048, generator=g))
    elif kind == "tiny":         # magnitudes spread over 2**-40 .. 2**8, plus FP32 subnormals
        x = x * torch.exp2(torch.empty(2048, 2048).uniform_(-40.0, 8.0, generator=g))
        x[::7, ::5] *= 1e-35
    return x


@pytest.mark.parametrize("kind", ["normal", "heavy", "tiny"])
def test_tensorwise_equals_naive_route_on_large_random(kind):
    x = _large(kind)
    for name, spec in SPECS.items():
        assert_bits_equal(fake_quantize(x, spec), naive_fake_quant(x, name), f"{name} {kind}")


def test_quantized_values_are_the_torch_float8_values():
    """quantize().values are the float8 numbers themselves: to_storage() is lossless and
    equals casting x * scale, and scale is the naive s."""
    x = _large("heavy")[:256]
    for name, spec in SPECS.items():
        q = quantize(x, spec)
        fmax = torch.finfo(FP8[name]).max
        s = torch.tensor(fmax) / x.abs().amax()
        assert_bits_equal(q.scale.reshape(()), s, f"{name} scale")
        storage = q.to_storage()
        assert storage.dtype == FP8[name]
        assert_bits_equal(storage.float(), q.values, f"{name} storage")
        assert_bits_equal(q.values, (x * s).clamp(-fmax, fmax).to(FP8[name]).float(), f"{name} values")


# ----------------------------------------------------------------------------- fused (torch.compile)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_equals_naive_route(device):
    """fused=True (torch.compile, compiled once per spec on first use: slow) gives the same
    bits as the casts, on every BF16 value and on a heavy-tailed random tensor of the same
    shape (one compilation per spec)."""
    x_all = _all_bf16(device=device).reshape(255, 256)
    x_heavy = _large("heavy")[:255, :256].to(device) * 1e-20
    for name, spec in SPECS.items():
        for x in (x_all, x_heavy):
            fused = fake_quantize(x, spec, fused=True)
            assert_bits_equal(fused, naive_fake_quant(x, name), f"{name} fused")
            assert_bits_equal(fused, fake_quantize(x, spec), f"{name} fused vs eager")


@pytest.mark.parametrize("fmt", ["fp8_tensorwise", "fp8_delayed"])
def test_fused_takes_a_transposed_view_with_statistics(fmt):
    """A backward that quantizes again hands the quantizer transposed views (weight^T,
    grad_output^T), and a GPT-2 Conv1D's weight is one in the forward. The compiled core
    writes its statistics through `out=` tensors, which Dynamo refuses when they are not
    contiguous: it must take such a view all the same, with the eager route's bits."""
    x = _large("heavy")[:256, :128]
    view = x.t()
    assert not view.is_contiguous()
    spec = get_format(fmt).weight
    kw = {"scale": torch.tensor(448.0) / x.abs().amax()} if fmt == "fp8_delayed" else {}
    fused, eager = (quantize(view, spec, fused=f, stats=True, **kw) for f in (True, False))
    assert_bits_equal(fused.values, eager.values, f"{fmt} values")
    assert_bits_equal(fused.scale, eager.scale, f"{fmt} scale")
    got, want = fused.stats.to_dict(), eager.stats.to_dict()
    for k in ("amax", "saturated", "underflow", "nonfinite", "numel"):
        assert got[k] == want[k], k
    for k in ("sq_error", "signal_power", "underflow_energy"):   # sums: compiled in another order
        assert got[k] == pytest.approx(want[k], rel=1e-6), k
