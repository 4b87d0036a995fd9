"""The Triton FP8 cast kernels (`lowprec.numerics.kernels`) equal `lowprec.numerics.quantize.quantize` bit for bit.

Triton decides whether a kernel is interpreted when the kernel is defined, from
`TRITON_INTERPRET`; another test in the same pytest process may have imported Triton
or `lowprec.numerics.kernels` without it. So, in a normal run, `test_kernels_under_interpreter`
runs this file again in a fresh pytest process with `TRITON_INTERPRET=1`, where the
kernel checks run on CPU tensors (they are skipped in the outer process). Compared:
FP8 storage bytes (`view(torch.uint8)`, NaN and Inf encodings included), `scale_inv`,
the delayed amax, and the statistics the kernels compute (amax, saturated, underflow,
nonfinite, numel), on every BF16 bit pattern and on random ragged shapes.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowprec.numerics.formats import E2M1, E4M3, E5M2, QuantSpec, Scaling
from lowprec.numerics.quantize import quantize

HAVE_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ROOT = Path(__file__).resolve().parents[4]

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="Triton is not installed: the FP8 cast kernels are "
                                "written in Triton (pip install triton)")
inner = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess of "
                           "test_kernels_under_interpreter")
outer = pytest.mark.skipif(INTERPRETED, reason="the outer process's test")

if HAVE_TRITON and INTERPRETED:
    from lowprec.numerics.kernels import cast_delayed, cast_rowwise, cast_tensorwise
    from lowprec.numerics.kernels import fp8_cast

ELEMS = [E4M3, E5M2]
ALL_BF16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def _run(scaling: Scaling, x: torch.Tensor, elem, scale=None, **kw):
    """(fp8 bytes, scale_inv, amax or None, stats dict) from the kernel for `scaling`."""
    if scaling is Scaling.ROW:
        q, si, stats = cast_rowwise(x, elem, stats=True, **kw)
        amax = None
    elif scaling is Scaling.TENSOR:
        q, si, stats = cast_tensorwise(x, elem, stats=True, **kw)
        amax = None
    else:
        q, si, amax, stats = cast_delayed(x, elem, scale, stats=True, **kw)
    assert q.dtype == elem.torch_dtype
    return q.view(torch.uint8), si, amax, stats.to_dict()


def check_equal(scaling: Scaling, x: torch.Tensor, elem, scale=None, **kw) -> None:
    """Kernel vs quantize(..., stats=True): bytes, scale_inv, amax, statistics, all exact."""
    ref = quantize(x, QuantSpec(elem, scaling), scale=scale, stats=True)
    q, si, amax, stats = _run(scaling, x, elem, scale, **kw)
    rb = ref.to_storage().view(torch.uint8)
    assert q.shape == rb.shape
    bad = (q != rb).nonzero()
    assert bad.numel() == 0, (
        f"{len(bad)} bytes differ, first at {bad[0].tolist()}: x={x.reshape(rb.shape)[tuple(bad[0])].item()!r} "
        f"kernel {q[tuple(bad[0])].item():#04x} quantize {rb[tuple(bad[0])].item():#04x}")
    want_si = ref.scale_inv.reshape(-1, 1) if scaling is Scaling.ROW else ref.scale_inv.reshape(())
    assert si.shape == want_si.shape and si.dtype == torch.float32
    assert torch.equal(si, want_si)
    if amax is not None:
        assert amax.item() == ref.amax.item()
    for f in ("amax", "saturated", "underflow", "nonfinite", "numel"):   # not to_dict(): see below
        assert stats[f] == getattr(ref.stats, f).item(), (f, stats[f], getattr(ref.stats, f).item())


# ----------------------------------------------------------------------------- every BF16 value


@inner
@pytest.mark.parametrize("elem", ELEMS, ids=lambda e: e.name)
@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_rowwise_every_bf16(elem, order):
    """256 rows of 256 patterns: sorted, each row one exponent band (row 0x7F8: +Inf and
    NaNs only, an amax of 0; rows 0x00 / 0x80: zeros and subnormals); shuffled, mixed."""
    x = ALL_BF16 if order == "sorted" else ALL_BF16[torch.randperm(65536, generator=torch.Generator().manual_seed(0))]
    check_equal(Scaling.ROW, x.reshape(256, 256), elem)


@inner
@pytest.mark.parametrize("elem", ELEMS, ids=lambda e: e.name)
def test_tensorwise_every_bf16(elem):
    check_equal(Scaling.TENSOR, ALL_BF16.reshape(512, 128), elem)
    # the amax of every value is 3.4e38 and flushes most of them: also every value of
    # magnitude up to 2**10 with the non-finite ones, most of them on the grid's range
    small = ALL_BF16[~(ALL_BF16.float().abs() > 1024.0)]
    check_equal(Scaling.TENSOR, small.reshape(-1, small.numel() // 2), elem)


@inner
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, for x * 2**100: clamped
@pytest.mark.parametrize("elem", ELEMS, ids=lambda e: e.name)
@pytest.mark.parametrize("scale", [1.0, 2.0**100, 3.7e-3, 2.0**-120])
def test_delayed_every_bf16(elem, scale):
    """scale 1 rounds every BF16 value to the grid directly (saturation, the E5M2 tie at
    61440, subnormals); 2**100 lifts BF16 subnormals into range; 3.7e-3 is no power of two.
    (With 2**-120, quantize's own sq_error is inf, its dequantized maxima overflow FP32, and
    QuantStats.to_dict() raises on it; the fields compared here are exact.)"""
    check_equal(Scaling.DELAYED, ALL_BF16.reshape(256, 256), elem, torch.tensor(scale))


# ----------------------------------------------------------------------------- shapes, dtypes


@inner
@settings(max_examples=30, deadline=None, derandomize=True)
@given(rows=st.integers(1, 9), k=st.integers(1, 70), elem=st.sampled_from(ELEMS),
       scaling=st.sampled_from([Scaling.ROW, Scaling.TENSOR, Scaling.DELAYED]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float16]),
       log_mag=st.integers(-30, 30), zero_row=st.booleans(), specials=st.booleans(),
       small_blocks=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_random_shapes(rows, k, elem, scaling, dtype, log_mag, zero_row, specials, small_blocks, seed):
    """Ragged shapes (K not a multiple of 16 or of the block; rows not a multiple of anything),
    small blocks so that loops over K and grid-stride loops run several times."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=g) * 2.0 ** (log_mag if dtype != torch.float16 else log_mag // 3))
    if zero_row:
        x[rows // 2] = 0.0
    if specials:
        flat = x.view(-1)
        idx = torch.randint(0, flat.numel(), (3,), generator=g)
        flat[idx] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    x = x.to(dtype)
    kw = {}
    if small_blocks:
        kw = {"block_k": 16} if scaling is Scaling.ROW else {"block": 16}
    scale = torch.tensor(2.0 ** -log_mag * 100.0) if scaling is Scaling.DELAYED else None
    check_equal(scaling, x, elem, scale, **kw)


@inner
def test_more_programs_than_partials(monkeypatch):
    """Tensor-wise and delayed grids are capped (1024 programs on a GPU); past the cap each
    program loops over several blocks. A cap of 3 shows it with few interpreted programs."""
    monkeypatch.setattr(fp8_cast, "_MAX_PARTIALS", 3)
    x = torch.randn(7, 37, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x[3, 5] = 300.0
    for elem in ELEMS:
        check_equal(Scaling.TENSOR, x, elem, block=16)
        check_equal(Scaling.DELAYED, x, elem, torch.tensor(0.7), block=16)


@inner
def test_all_zero_and_empty():
    z = torch.zeros(3, 32, dtype=torch.bfloat16)
    for s in (Scaling.ROW, Scaling.TENSOR):
        check_equal(s, z, E4M3)
    check_equal(Scaling.DELAYED, z, E5M2, torch.tensor(2.0))
    q, si = cast_rowwise(torch.zeros(0, 16, dtype=torch.bfloat16), E4M3)
    assert q.shape == (0, 16) and si.shape == (0, 1)


@inner
def test_views_and_stats_off():
    """3-D and non-contiguous inputs are viewed as (rows, K) like quantize; stats=False
    returns no statistics and the same bytes and scales."""
    x = torch.randn(2, 3, 48, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    check_equal(Scaling.ROW, x, E4M3)
    xt = torch.randn(40, 24, generator=torch.Generator().manual_seed(3)).t()   # K = 40, stride 1 on rows
    check_equal(Scaling.TENSOR, xt, E5M2)
    check_equal(Scaling.ROW, xt, E5M2)
    q, si = cast_rowwise(x, "e4m3")
    q2, si2, _ = cast_rowwise(x, E4M3, stats=True)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(si, si2)
    q, si = cast_tensorwise(x, "e5m2")
    assert q.dtype == torch.float8_e5m2 and si.shape == ()
    q, si, amax = cast_delayed(x, E4M3, torch.tensor(10.0))
    assert amax.item() == x.float().abs().max().item()


@inner
def test_dequantized_matches_scaled_mm_operands():
    """What the torch backend multiplies: fp8 * scale_inv is quantize's dequantized operand."""
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    q, si = cast_rowwise(x, E4M3)
    ref = quantize(x, QuantSpec(E4M3, Scaling.ROW))
    assert torch.equal(q.float() * si, ref.values * ref.scale_inv.reshape(-1, 1))


@inner
def test_bad_arguments():
    x = torch.ones(2, 16)
    with pytest.raises(ValueError, match="E4M3 and E5M2"):
        cast_rowwise(x, E2M1)
    with pytest.raises(TypeError, match="BF16, FP16 or FP32"):
        cast_tensorwise(torch.ones(2, 16, dtype=torch.int32), E4M3)


# ----------------------------------------------------------------------------- outer process


def _python(code: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env_extra
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


@outer
@pytest.mark.slow
def test_kernels_under_interpreter():
    """Runs this file's kernel checks in a fresh pytest process with TRITON_INTERPRET=1."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                          str(Path(__file__))], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    passed = int(re.search(r"(\d+) passed", out).group(1))
    assert passed >= 18, out[-3000:]
    assert "failed" not in out.splitlines()[-1], out[-3000:]


@outer
def test_import_without_triton_is_clear():
    res = _python("""
        import sys
        sys.modules["triton"] = None          # as if Triton were not installed
        import lowprec, lowprec.numerics.quantize      # the package itself does not need it
        try:
            import lowprec.numerics.kernels
        except ImportError as e:
            print("ImportError:", e)
    """, {})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "ImportError: lowprec.numerics.kernels needs Triton" in res.stdout
    assert "pip install triton" in res.stdout


@outer
def test_cpu_tensor_without_interpreter_is_refused():
    res = _python("""
        import torch
        from lowprec.numerics.kernels import cast_rowwise
        try:
            cast_rowwise(torch.ones(2, 16), "e4m3")
        except RuntimeError as e:
            print("RuntimeError:", e)
    """, {})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "RuntimeError: cast_rowwise runs Triton kernels" in res.stdout
    assert "TRITON_INTERPRET=1" in res.stdout


@outer
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the compiled (not interpreted) kernels")
@pytest.mark.parametrize("elem", ELEMS, ids=lambda e: e.name)
def test_compiled_kernels_on_cuda_equal_quantize_on_cpu(elem):
    """On a GPU: the compiled kernels on CUDA tensors equal quantize on the CPU, bit for bit."""
    import lowprec.numerics.kernels as kernels
    x = ALL_BF16.reshape(256, 256).cuda()
    for scaling, scale in ((Scaling.ROW, None), (Scaling.TENSOR, None), (Scaling.DELAYED, 1.0),
                           (Scaling.DELAYED, 2.0**100), (Scaling.DELAYED, 3.7e-3)):
        s = None if scale is None else torch.tensor(scale)
        ref = quantize(x.cpu(), QuantSpec(elem, scaling), scale=s, stats=True)
        if scaling is Scaling.ROW:
            q, si, st = kernels.cast_rowwise(x, elem, stats=True)
        elif scaling is Scaling.TENSOR:
            q, si, st = kernels.cast_tensorwise(x, elem, stats=True)
        else:
            q, si, amax, st = kernels.cast_delayed(x, elem, s.cuda(), stats=True)
            assert amax.item() == ref.amax.item()
        assert torch.equal(q.view(torch.uint8).cpu(), ref.to_storage().view(torch.uint8)), scaling
        assert torch.equal(si.cpu().reshape(-1), ref.scale_inv.reshape(-1)), scaling
        for f in ("amax", "saturated", "underflow", "nonfinite"):
            assert getattr(st, f).item() == getattr(ref.stats, f).item(), (scaling, f)
