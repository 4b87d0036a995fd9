"""The grouped experts' GPU fast path (lowprec.sites.grouped_scaled_mm) on the CPU: the FP8 bytes,
scales and offsets it hands `torch._scaled_grouped_mm` obey the operator's contract (torch's own
meta kernel checks every call) and, multiplied by an independent definition of the operator,
give what the emulated grouped GEMM gives, within FP32 reordering and the kernel's BF16 output.
The real kernel runs in tests/gpu/test_grouped_scaled_mm_gpu.py."""

import pytest
import torch
from torch import nn

from lowprec.numerics.formats import get_format
from lowprec.sites.backends import get_backend
from lowprec.sites.backends.emulated import gemm_bound
from lowprec.sites.experts import ExpertSite
from lowprec.sites.grouped_gemms import GroupedQuantizedFn
from lowprec.sites.grouped_scaled_mm import grouped_scaled_ok, kernel_for, on_kernel


class ReferenceKernel:
    """`torch._scaled_grouped_mm`'s contract on the meta device, then its definition in FP64:
    per group, (a * scale_a per row) @ (b * scale_b per column), rounded once to BF16. Counts
    its calls by layout."""

    def __init__(self):
        self.calls = {"2d3d": 0, "2d2d": 0}

    def __call__(self, a, b, scale_a, scale_b, *, offs, out_dtype, use_fast_accum):
        meta = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                for t in (a, b, scale_a, scale_b, offs)]
        torch._scaled_grouped_mm(*meta[:4], offs=meta[4], out_dtype=out_dtype, use_fast_accum=use_fast_accum)
        ends = offs.tolist()
        starts = [0, *ends[:-1]]
        if b.dim() == 3:     # rows of a by group, b[g]
            self.calls["2d3d"] += 1
            out = torch.cat([(a[s:e].double() * scale_a[s:e, None]) @ (b[g].double() * scale_b[g][None, :])
                             for g, (s, e) in enumerate(zip(starts, ends))])
        else:                # columns of a / rows of b by group along the reduction
            self.calls["2d2d"] += 1
            m, n = a.shape[0], b.shape[1]
            out = torch.stack([(a[:, s:e].double() * scale_a[g * m:(g + 1) * m, None])
                               @ (b[s:e].double() * scale_b[g * n:(g + 1) * n][None, :])
                               for g, (s, e) in enumerate(zip(starts, ends))])
        return out.to(out_dtype)


def _run(fmts, counts, x, w, gy, kernel):
    backend = get_backend("torch")
    sites = [ExpertSite(e, {"p": tuple(w.shape[1:])}, fmts[e], backend, fqn=f"experts.{e}", seed=e)
             for e in range(len(counts))]
    xg, wg = x.clone().requires_grad_(True), nn.Parameter(w.clone())
    y = GroupedQuantizedFn.apply(xg, wg, counts, tuple(fmts), tuple(s.operand_quantizer("p") for s in sites),
                                 True, kernel)
    y.backward(gy)
    return y.detach(), xg.grad, wg.grad


@pytest.mark.parametrize("names, fast", [
    (("fp8_rowwise_e4m3_pow2",) * 4, {"2d3d": 2, "2d2d": 1}),                # E4M3 everywhere: all three GEMMs
    (("fp8_tensorwise", "bf16", "fp8_rowwise_e4m3_pow2", "fp8_tensorwise"),    # hybrid: fprop only (E5M2 grads)
     {"2d3d": 3, "2d2d": 1}),
    (("fp8_delayed", "mxfp8", "fp8_rowwise", "fp8_delayed"), {"2d3d": 2, "2d2d": 0}),
], ids=["e4m3_rowwise", "tensorwise_and_rowwise", "delayed_mx_hybrid"])
def test_fast_path_equals_the_emulated_grouped_gemm(names, fast):
    """Uneven token counts (one expert without tokens, counts that are no multiple of 16), several
    formats in one layer: each GEMM the fast path takes is one operator call, and y, dx and dw
    equal the emulated grouped GEMM's within the FP32 bound of the two summation orders plus the
    kernel's one BF16 rounding."""
    torch.manual_seed(0)
    counts = (37, 0, 21, 64)
    n_out, k_in = 48, 32
    x = torch.randn(sum(counts), k_in) * 3
    w = torch.randn(len(counts), n_out, k_in) * 0.05
    gy = torch.randn(sum(counts), n_out)
    fmts = [get_format(n) for n in names]
    kernel = ReferenceKernel()
    got = _run(fmts, counts, x, w, gy, kernel)
    want = _run(fmts, counts, x, w, gy, None)
    assert kernel.calls == fast
    starts = [sum(counts[:e]) for e in range(len(counts))]
    for name, g, r in zip(("y", "dx", "dw"), got, want):
        assert torch.isfinite(g).all()
        if name == "dw":
            pairs = [(g[e], r[e], gy[starts[e]:starts[e] + c].t(), x[starts[e]:starts[e] + c].t())
                     for e, c in enumerate(counts) if c]
        elif name == "y":
            pairs = [(g[starts[e]:starts[e] + c], r[starts[e]:starts[e] + c], x[starts[e]:starts[e] + c], w[e])
                     for e, c in enumerate(counts) if c]
        else:
            pairs = [(g[starts[e]:starts[e] + c], r[starts[e]:starts[e] + c], gy[starts[e]:starts[e] + c], w[e].t())
                     for e, c in enumerate(counts) if c]
        for ge, re, a, b in pairs:
            # the operands' magnitudes after quantization are within 2x of the inputs' (|q| <= 2|t| for FP8's grids)
            bound = 4 * gemm_bound(a, b).float() + re.abs() * 2.0 ** -8
            assert ((ge - re).abs() <= bound).all(), name


def test_the_refused_gemms():
    """What the grouped FP8 kernel cannot take: E5M2, block or MX scales, a Hadamard transform,
    a reduction or output width that is no multiple of 16."""
    row, e5m2 = get_format("fp8_rowwise_e4m3_pow2").input, get_format("fp8_rowwise").grad_output
    assert grouped_scaled_ok(row, row, 32, 48)
    assert not grouped_scaled_ok(row, e5m2, 32, 48)
    assert not grouped_scaled_ok(get_format("mxfp8").input, get_format("mxfp8").weight, 32, 48)
    assert not grouped_scaled_ok(get_format("fp8_blockwise").input, row, 128, 128)
    assert not grouped_scaled_ok(get_format("nvfp4").input, get_format("nvfp4").weight, 32, 48)
    assert not grouped_scaled_ok(row, row, 40, 48) and not grouped_scaled_ok(row, row, 32, 40)
    assert not grouped_scaled_ok(None, row, 32, 48)
    # each GEMM's operands and widths from the weight's (E, N, K): K 40 keeps all three off the kernel
    # (fprop's reduction, dgrad's and wgrad's output); N 40 keeps fprop (output) and dgrad (reduction) off
    e4m3, hybrid = get_format("fp8_rowwise_e4m3_pow2"), get_format("fp8_rowwise")
    assert [on_kernel(object(), e4m3, g, (4, 48, 32)) for g in ("fprop", "dgrad", "wgrad")] == [True] * 3
    assert [on_kernel(object(), hybrid, g, (4, 48, 32)) for g in ("fprop", "dgrad", "wgrad")] == [True, False, False]
    assert [on_kernel(object(), e4m3, g, (4, 48, 40)) for g in ("fprop", "dgrad", "wgrad")] == [False, False, False]
    assert [on_kernel(object(), e4m3, g, (4, 40, 32)) for g in ("fprop", "dgrad", "wgrad")] == [False, False, True]
    assert not on_kernel(None, e4m3, "fprop", (4, 48, 32))


def test_no_kernel_off_the_gpu():
    """On the CPU, and for the emulated backend anywhere, the experts run the emulated grouped GEMM."""
    assert kernel_for(get_backend("torch"), torch.device("cpu")) is None
    assert kernel_for(get_backend("emulated"), torch.device("cuda")) is None
