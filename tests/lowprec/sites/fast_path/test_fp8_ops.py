"""The fast path's custom ops (`torch.ops.lowprec.fp8_cast`, `fp8_cast_delayed`) equal
`lowprec.numerics.quantize.quantize`: FP8 bytes (NaN and Inf encodings included), `scale_inv`, the
delayed history's update and the statistics (amax and counts exactly; the error sums, which
the kernels accumulate in FP64 in another order, to 1e-6 relative), and the two layouts of a
cast+transpose equal a cast and a transpose (row-wise: the row-wise cast of x^T).

Every test runs twice: here, where the ops on CPU take the reference quantizer, and in
`test_fast_path_files_under_interpreter`'s subprocess (TRITON_INTERPRET=1), where they run the Triton
kernels of `lowprec.numerics.kernels.cast_transpose` on CPU tensors.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fast_path_checks import HAVE_TRITON, INTERPRETED, INTERPRETED_FILES, assert_same_stats, run_interpreted
from lowprec.numerics import fp8_ops
from lowprec.numerics.delayed import AmaxHistory
from lowprec.numerics.grid import saturates
from lowprec.numerics.formats import E4M3, E5M2, DelayedScalingConfig, QuantSpec, Scaling
from lowprec.numerics.quantize import quantize

ELEMS = [E4M3, E5M2]
ALL_BF16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _same_stats(got, ref) -> None:
    assert_same_stats(got, ref.packed)


def check_cast(x: torch.Tensor, elem, rowwise: bool, plain: bool = True) -> None:
    """The op against `quantize`, with both layouts and the statistics, then (`plain`) without."""
    scaling = Scaling.ROW if rowwise else Scaling.TENSOR
    ref = quantize(x, QuantSpec(elem, scaling), stats=True)
    q, si, qt, sit, stats = torch.ops.lowprec.fp8_cast(x, fp8_ops.element_code(elem), rowwise, True, True)
    rb = _bytes(ref.to_storage())
    assert q.dtype == elem.torch_dtype and torch.equal(_bytes(q), rb)
    assert torch.equal(si, ref.scale_inv.reshape(-1, 1) if rowwise else ref.scale_inv.reshape(()))
    _same_stats(stats, ref.stats)
    if rowwise:   # the second layout: the row-wise cast of x^T, one scale per column of x
        ref_t = quantize(x.t(), QuantSpec(elem, Scaling.ROW))
        assert torch.equal(_bytes(qt), _bytes(ref_t.to_storage()))
        assert torch.equal(sit, ref_t.scale_inv.reshape(-1, 1))
    else:         # a cast and a transpose
        assert torch.equal(_bytes(qt), rb.t()) and sit.numel() == 0
    assert qt.is_contiguous() and q.is_contiguous()
    if not plain:
        return
    q2, si2, qt2, _, st2 = torch.ops.lowprec.fp8_cast(x, fp8_ops.element_code(elem), rowwise, False, False)
    assert torch.equal(_bytes(q2), rb) and torch.equal(si2, si) and qt2.numel() == 0 and st2.numel() == 0


def check_delayed(xs: list[torch.Tensor], elem, config: DelayedScalingConfig) -> None:
    """A sequence of delayed casts: the op's history and count follow AmaxHistory's."""
    ref_hist = AmaxHistory(config, elem)
    hist = AmaxHistory(config, elem)
    ref_over = torch.zeros(3, dtype=torch.float64)
    over = torch.zeros(3, dtype=torch.float64)
    for i, x in enumerate(xs):
        scale = ref_hist.scale()
        ref = quantize(x, QuantSpec(elem, Scaling.DELAYED), scale=scale, stats=True)
        if i % 2 == 1:   # counted only when asked: past twice the max
            ref_over[2] += saturates(ref.amax * scale * 0.5, elem).double()
        ref_hist.record(ref.amax)
        q, si, qt, stats = torch.ops.lowprec.fp8_cast_delayed(
            x, fp8_ops.element_code(elem), hist.history, hist.count, hist.scratch, hist.ticket, over, 2,
            config.margin, config.algo == "most_recent", True, True, i % 2 == 1)
        rb = _bytes(ref.to_storage())
        assert torch.equal(_bytes(q), rb) and torch.equal(_bytes(qt), rb.t()), i
        assert torch.equal(si, ref.scale_inv.reshape(())), i
        _same_stats(stats, ref.stats)
        assert torch.equal(hist.history, ref_hist.history) and torch.equal(hist.count, ref_hist.count), i
        assert float(hist.scratch) == 0.0 and int(hist.ticket) == 0     # ready for the next call
    assert torch.equal(over, ref_over)


pytestmark = pytest.mark.skipif(INTERPRETED and not HAVE_TRITON, reason="needs Triton")


# ----------------------------------------------------------------------------- every BF16 value


@pytest.mark.parametrize("elem", ELEMS, ids=lambda e: e.name)
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_every_bf16_value(elem, rowwise):
    """Every BF16 bit pattern (NaNs, infinities, subnormals, zeros) in 256 rows: sorted (each
    row an exponent band, so row-wise and column-wise scales differ widely), shuffled (the
    reference ops only) and the values up to 1024 in 4 bands of mixed magnitudes: 4 rows
    (the reference ops only) and the same bands as 64 rows (each band's every 16th value a
    row: every row spans its band's magnitudes, every column all 4 bands)."""
    # interpreted, the cast without transpose and statistics (the same encoding) on the 64 rows below
    check_cast(ALL_BF16.reshape(256, 256), elem, rowwise, plain=not INTERPRETED)
    small = ALL_BF16[~(ALL_BF16.float().abs() > 1024.0)]      # most of them on the grid's range; each row mixed
    bands = small.reshape(4, -1)
    if not INTERPRETED:   # interpreted: mixed rows and columns in the 64 rows below, in 9 tiles, not 4 rows' 138
        shuffled = ALL_BF16[torch.randperm(65536, generator=torch.Generator().manual_seed(0))]
        check_cast(shuffled.reshape(512, 128), elem, rowwise)
        check_cast(bands, elem, rowwise)
    check_cast(bands.reshape(4, -1, 16).transpose(1, 2).reshape(64, -1), elem, rowwise)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
@pytest.mark.parametrize("elem", ELEMS, ids=lambda e: e.name)
def test_delayed_every_bf16_value(elem):
    """Every BF16 value under a history that moves: empty (scale 1), then the amaxes of
    earlier calls (max and most-recent), a margin, and a value that saturates in between.

    Interpreted, every value is cast at each of the four scales the sequences apply to x (1,
    from amax(x), and the two scaled operands' amaxes with the margin); the scaled operands and
    the two steps whose scale an earlier step already applied to every value (the second
    sequence's first, the first sequence's last) cast 64 of x's rows, which hold its amax
    (the largest finite, Inf and NaN rows of both signs, zeros and subnormals, two exponents
    of every eight): the same amaxes, so the same histories, scales and overflow counts."""
    x = ALL_BF16.reshape(256, 256)
    finite = x.float().nan_to_num(0.0, 0.0, 0.0)
    t1, t2 = (finite * 1e-30).to(torch.bfloat16), (finite * 2.0 ** -100).to(torch.bfloat16)
    rows = list(range(0, 256, 4))   # 64 rows (4 tiles, not 16): 0 and 128 zeros and subnormals,
    rows[31], rows[63] = 127, 255     # 127 and 255 the largest finite, Inf and NaN

    def sub(t):
        return t[rows] if INTERPRETED else t
    for t in (x, t1, t2):
        assert torch.equal(_finite_amax(sub(t)), _finite_amax(t))
    check_delayed([x, sub(t1), x, sub(t2), sub(x)], elem, DelayedScalingConfig(history_len=3))
    check_delayed([sub(x), sub(t1), x, sub(t2), x], elem,
                  DelayedScalingConfig(history_len=2, algo="most_recent", margin=1))


def _finite_amax(t: torch.Tensor) -> torch.Tensor:
    f = t.float()
    return f.abs().where(f.isfinite(), 0.0).amax()


# ----------------------------------------------------------------------------- shapes


@settings(max_examples=12, deadline=None, derandomize=True)
@given(rows=st.integers(1, 90), k=st.integers(1, 90), elem=st.sampled_from(ELEMS),
       mode=st.sampled_from(["tensor", "row", "delayed"]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float16]),
       log_mag=st.integers(-20, 20), zero_row=st.booleans(), specials=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_random_shapes(rows, k, elem, mode, dtype, log_mag, zero_row, specials, seed):
    """Odd sizes (tiles only partly inside), all-zero rows, NaN and +-Inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * 2.0 ** (log_mag if dtype != torch.float16 else log_mag // 3)
    if zero_row:
        x[rows // 2] = 0.0
    if specials:
        flat = x.view(-1)
        flat[torch.randint(0, flat.numel(), (3,), generator=g)] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    x = x.to(dtype)
    if mode == "delayed":
        check_delayed([x, x * 3, x], elem, DelayedScalingConfig(history_len=2))
    else:
        check_cast(x, elem, mode == "row")


def _same_cast(got, want, b_scales=()):
    """A pair's `Cast` against a separate cast's (q, scale_inv, q_t, scale_inv_t, stats): the
    same bytes, scales and (both or neither) statistics, bit for bit. The fields named in
    `b_scales` (row-wise scales the pair gives in a GEMM's B layout) are the separate cast's
    (rows, 1) values as (1, rows)."""
    assert len(got) == len(want) == 5
    assert (got.stats is None) == (want[4] is None)
    for name, g, w in zip(got._fields, got, want):
        if name in b_scales and w.numel():
            assert w.shape == (w.numel(), 1) and g.shape == (1, w.numel())
            w = w.reshape(1, -1)
        if g is not None:
            assert torch.equal(_bytes(g) if g.element_size() == 1 else g, _bytes(w) if w.element_size() == 1 else w)


# ALL_BF16 as (512, 128): row r holds exponent r % 256 (sign r // 256), its 128 mantissas. Every 8th
# exponent of both signs and the largest finite and Inf/NaN rows: zeros, subnormals, normals over the
# range, the largest finite, +-Inf and NaNs, each row one exponent, in 68 rows: 4 tiles, not 16 (every
# BF16 value meets the tile code these kernels share, `_ct_tile` / `_ct_row_tile`, in the tests above)
EVERY_8TH_EXPONENT = ALL_BF16.reshape(512, 128)[sorted({*range(0, 512, 8), 254, 255, 510, 511})]


def _pair_cases():
    g = torch.Generator().manual_seed(1)
    return [(EVERY_8TH_EXPONENT, torch.randn(70, 128, generator=g) * 1e3, True),
            (torch.randn(37, 90, generator=g).to(torch.bfloat16), torch.randn(3, 90, generator=g) * 1e-3, False),
            (torch.randn(1, 16, generator=g), torch.randn(130, 16, generator=g).to(torch.bfloat16), True)]


@pytest.mark.skipif(not INTERPRETED, reason="the paired kernels: in the interpreter subprocess")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("stats", [False, True], ids=["plain", "check"])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_input_and_weight_in_one_launch_equal_their_separate_casts(scaling, stats):
    """`cast_pair.pair` (the layer's input and weight together) against two separate casts
    (`cast_transpose.tensorwise` / `rowwise`): the same bytes in both layouts, scales and, on a
    check step, each operand's own statistics, bit for bit, over every 8th BF16 exponent (its
    zeros, subnormals, largest finite, +-Inf and NaNs: `EVERY_8TH_EXPONENT`) beside an FP32
    weight, ragged shapes, x without its transpose. Check steps in E4M3 only (the
    statistics' code does not depend on the element format; interpreted time is scarce)."""
    from lowprec.numerics.kernels import cast_pair
    from lowprec.numerics.kernels import cast_transpose as ct
    rowwise = scaling == "rowwise"
    for elem in ELEMS[:1] if stats else ELEMS:
        for a, b, tr in _pair_cases():
            got = cast_pair.pair(a, b, elem, tr, stats=stats, rowwise=rowwise)
            if rowwise:
                _same_cast(got[0], ct.rowwise(a, elem, tr, stats), b_scales=("scale_inv_t",))
                _same_cast(got[1], ct.rowwise(b, elem, True, stats), b_scales=("scale_inv", "scale_inv_t"))
            else:
                q, si, qt, st_ = ct.tensorwise(a, elem, tr, stats)
                _same_cast(got[0], (q, si, qt, si, st_))
                q, si, qt, st_ = ct.tensorwise(b, elem, True, stats)
                _same_cast(got[1], (q, si, qt, si, st_))


@pytest.mark.skipif(not INTERPRETED, reason="the paired kernels: in the interpreter subprocess")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("stats", [False, True], ids=["plain", "check"])
def test_delayed_pair_equals_the_separate_casts(stats):
    """The delayed pair against two `cast_transpose.delayed` casts over moving histories: the
    same bytes, scales, histories, counts, overflow counters (plain steps) and statistics
    (check steps, where the layer counts no overflow; E4M3 only, two calls, as above)."""
    from lowprec.numerics.kernels import cast_pair
    from lowprec.numerics.kernels import cast_transpose as ct
    for elem in ELEMS[:1] if stats else ELEMS:
        for a, b, tr in _pair_cases():
            states = [(torch.tensor([0.0, 4.0, 0.0]), torch.tensor(1), torch.zeros(()),
                       torch.zeros((), dtype=torch.int32)) for _ in range(4)]
            over = [None, None] if stats else [torch.zeros(3, dtype=torch.float64) for _ in range(2)]
            for _ in range(2 if stats else 3):   # the histories move: later scales come from earlier amaxes
                got = cast_pair.pair(a, b, elem, tr, delayed=(states[0], states[1], 1, False, over[0]), stats=stats)
                q, si, qt, st_ = ct.delayed(a, elem, states[2], 1, False, over[1], 0, tr, stats)
                _same_cast(got[0], (q, si, qt, si, st_))
                q, si, qt, st_ = ct.delayed(b, elem, states[3], 1, False, over[1], 1, True, stats)
                _same_cast(got[1], (q, si, qt, si, st_))
                for s1, s2 in zip(states[0] + states[1], states[2] + states[3]):
                    assert torch.equal(s1, s2)
                if not stats:
                    assert torch.equal(over[0], over[1])


def test_fake_shapes_match():
    """The fake (meta) implementations give the shapes, dtypes and strides of the real ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    x = torch.randn(24, 40)
    h = AmaxHistory(DelayedScalingConfig(history_len=4), E4M3)
    over = torch.zeros(3, dtype=torch.float64)
    for rowwise in (False, True):
        for transpose in (False, True):
            for stats in (False, True):
                real = torch.ops.lowprec.fp8_cast(x, 1, rowwise, transpose, stats)
                with FakeTensorMode() as mode:
                    fake = torch.ops.lowprec.fp8_cast(mode.from_tensor(x), 1, rowwise, transpose, stats)
                for r, f in zip(real, fake):
                    assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())
    real = torch.ops.lowprec.fp8_cast_delayed(x, 0, h.history, h.count, h.scratch, h.ticket, over, 0, 0,
                                              False, True, True, False)
    with FakeTensorMode() as mode:
        fake = torch.ops.lowprec.fp8_cast_delayed(
            *(mode.from_tensor(t) for t in (x,)), 0,
            *(mode.from_tensor(t) for t in (h.history, h.count, h.scratch, h.ticket, over)),
            0, 0, False, True, True, False)
    for r, f in zip(real, fake):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())


def test_opcheck():
    """torch.library.opcheck: schema, fake implementation and (no) autograd registration."""
    x = torch.randn(16, 32)
    for rowwise in (False, True):
        torch.library.opcheck(torch.ops.lowprec.fp8_cast.default, (x, 0, rowwise, True, True),
                              test_utils=("test_schema", "test_faketensor"))


@pytest.mark.skipif(INTERPRETED or not HAVE_TRITON, reason="the outer process's test (needs Triton)")
@pytest.mark.slow
def test_fast_path_files_under_interpreter():
    """This file, test_fp8_linear.py and test_fast_path_traffic.py again, in one process, with the
    Triton kernels behind the ops (TRITON_INTERPRET=1)."""
    out = run_interpreted(INTERPRETED_FILES)
    assert "uses_kernels=True" not in out    # (the inner run asserts it itself, below)


@pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreter subprocess")
def test_inner_run_uses_the_kernels():
    assert fp8_ops.uses_kernels(torch.ones(1))
