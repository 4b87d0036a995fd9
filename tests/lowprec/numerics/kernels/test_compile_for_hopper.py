"""The fast path's Triton kernels compile for an H100 (sm_90) here, with no GPU.

Triton compiles ahead of time for a named target with the ptxas its wheel ships, so a kernel
that the interpreter runs but the CUDA backend refuses (a type it cannot lower, a constexpr
branch that leaves a name unbound) fails here instead of in a GPU session's few minutes. Each
cast+transpose kernel, every scaling, with and without statistics, is compiled to a cubin.
"""

from __future__ import annotations

import inspect
import os

import pytest

triton = pytest.importorskip("triton")
compiler = pytest.importorskip("triton.compiler")
GPUTarget = pytest.importorskip("triton.backends.compiler").GPUTarget
pytest.importorskip("triton.backends.nvidia")

from lowprec.numerics.formats import E4M3, E5M2  # noqa: E402
from lowprec.numerics.kernels import cast_transpose as ct  # noqa: E402
from lowprec.numerics.kernels import cast_pair_kernels as cpk  # noqa: E402
from lowprec.numerics.kernels.fp8_cast import _EPS, _odd_max, overflow_threshold  # noqa: E402

# these tests compile the kernels' source for sm_90; under TRITON_INTERPRET=1 `triton.jit` gives
# interpreted functions, which have no compiler path (the interpreter tests run the kernels instead)
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="TRITON_INTERPRET=1: the kernels are interpreted, not compiled")

HOPPER = GPUTarget("cuda", 90, 32)
POINTERS = dict(x_ptr="*bf16", q_ptr="*u8", qt_ptr="*u8", partial_ptr="*fp32", hist_ptr="*fp32",
                count_ptr="*i64", scratch_ptr="*fp32", ticket_ptr="*i32", overflow_ptr="*fp64",
                scale_inv_ptr="*fp32", stats_ptr="*fp64", stats_out_ptr="*fp64", maxima_ptr="*fp32",
                si_ptr="*fp32", sit_ptr="*fp32")
INTS = dict(numel="i64")


def _consts(elem) -> dict:
    """The element's constexprs, as `fp8_cast._prepare` gives them for a BF16 operand."""
    return dict(BM=64, BN=64, MAX=elem.max, MB=elem.mantissa_bits, BIAS=1 - elem.min_normal_exp,
                HAS_INF=elem.has_inf, THR=overflow_threshold(elem), ODD=_odd_max(elem), EPS=_EPS, BF16=True,
                BLOCK_T=ct._BLOCK_T)


def _compile(kernel, const: dict, pointers: dict | None = None):
    names = list(inspect.signature(kernel.fn).parameters)
    sig, constexprs = {}, {}
    pointers = dict(POINTERS, **(pointers or {}))
    for i, name in enumerate(names):
        if name in const:
            sig[name], constexprs[(i,)] = "constexpr", const[name]
        else:
            sig[name] = pointers.get(name) or INTS.get(name, "i32")
    return triton.compile(compiler.ASTSource(fn=kernel, signature=sig, constexprs=constexprs), target=HOPPER)


@pytest.mark.parametrize("elem", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("stats", [False, True], ids=["plain", "stats"])
@pytest.mark.parametrize("delayed", [False, True], ids=["tensorwise", "delayed"])
def test_cast_transpose_compiles_for_sm90(elem, stats, delayed):
    const = dict(_consts(elem), BLOCK_P=1 if delayed else 64, BLOCK_L=16 if delayed else 1, DELAYED=delayed,
                 MOST_RECENT=False, MARGIN_DIV=1.0, OVERFLOW=delayed, TRANSPOSE=True, STATS=stats)
    # the FP8 outputs as the host allocates them (the kernel stores its codes bitcast to them)
    fp8 = "*fp8e4nv" if elem is E4M3 else "*fp8e5"
    k = _compile(ct._ct_kernel, const, dict(q_ptr=fp8, qt_ptr=fp8))
    assert k.asm["cubin"] and "sm_90" in k.asm["ptx"]
    a = _compile(ct._amax_partial_kernel, dict(BLOCK=2048, BF16=True, TICKET=stats), dict(partial_ptr="*fp32"))
    assert a.asm["cubin"]


@pytest.mark.parametrize("stats", [False, True], ids=["plain", "stats"])
def test_rowwise_kernels_compile_for_sm90(stats):
    c = _consts(E4M3)
    k = _compile(ct._ct_row_kernel, dict(c, TRANSPOSE=True, STATS=stats), dict(q_ptr="*fp8e4nv", qt_ptr="*fp8e4nv"))
    assert k.asm["cubin"]
    m = _compile(ct._amax_rows_cols_kernel, dict(BM=64, BN=64, BF16=True))
    assert m.asm["cubin"]


PAIR_POINTERS = dict(qa_ptr="*fp8e4nv", qta_ptr="*fp8e4nv", qb_ptr="*fp8e4nv", qtb_ptr="*fp8e4nv", xa_ptr="*bf16",
                     xb_ptr="*fp32", sia_ptr="*fp32", sib_ptr="*fp32", sita_ptr="*fp32", sitb_ptr="*fp32",
                     hista_ptr="*fp32", histb_ptr="*fp32", counta_ptr="*i64", countb_ptr="*i64",
                     scratcha_ptr="*fp32", scratchb_ptr="*fp32", ticketa_ptr="*i32", ticketb_ptr="*i32",
                     part_ptr="*fp64", sta_ptr="*fp64", stb_ptr="*fp64")


@pytest.mark.parametrize("delayed,stats", [(False, True), (True, False)], ids=["tensorwise-stats", "delayed"])
def test_pair_kernels_compile_for_sm90(delayed, stats):
    """The input+weight pair (`cast_pair`): an FP32 weight beside a BF16 input, with and without
    each operand's statistics; tensor-wise also the amax pass (delayed scaling has none), with
    the statistics' tickets, and without them with A's program count specialised to the
    constant 1 (an operand of at most one block). A paired kernel with statistics holds the
    statistics' code twice and takes ptxas 10-40 s here: one is compiled; the delayed and
    row-wise tiles' statistics code is compiled in the separate kernels above."""
    c = {k: v for k, v in _consts(E4M3).items() if k != "BF16"}
    const = dict(c, BLOCK_P=1 if delayed else 64, BLOCK_L=16 if delayed else 1, DELAYED=delayed, MOST_RECENT=False,
                 MARGIN_DIV=1.0, OVERFLOW=delayed and not stats, TRANSPOSE_A=True, STATS=stats, BF16_A=True,
                 BF16_B=False)
    assert _compile(cpk._ct_pair_kernel, const, PAIR_POINTERS).asm["cubin"]
    for amax_const in ([] if delayed else [{"TICKET": True}, {"TICKET": False, "PA": 1}]):
        amax = _compile(cpk._amax_pair_kernel, dict(BLOCK=2048, BF16_A=True, BF16_B=False, **amax_const),
                        PAIR_POINTERS)
        assert amax.asm["cubin"]


def test_rowwise_pair_kernels_compile_for_sm90():
    """The row-wise pair without statistics (with them: as in the docstring above)."""
    c = {k: v for k, v in _consts(E4M3).items() if k != "BF16"}
    const = dict(c, TRANSPOSE_A=True, STATS=False, BF16_A=True, BF16_B=False)
    assert _compile(cpk._ct_row_pair_kernel, const, PAIR_POINTERS).asm["cubin"]
    assert _compile(cpk._amax_rows_cols_pair_kernel, dict(BM=64, BN=64, BF16_A=True, BF16_B=False),
                    PAIR_POINTERS).asm["cubin"]
