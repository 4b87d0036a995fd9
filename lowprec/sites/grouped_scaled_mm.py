"""The `torch` backend's fast path for grouped experts: each format group's FP8 GEMMs as one
`torch._scaled_grouped_mm` call on the GPU's FP8 tensor cores.

`GroupedQuantizedFn` (lowprec.sites.grouped_gemms) quantizes every operand exactly as on the
emulated backend; where a GEMM's two operands are E4M3 with one scale per row of the GEMM's
reduction (FP8 row-wise) or one per expert (tensor-wise, delayed), this module hands their FP8
bytes and scales to the grouped kernel instead of multiplying the dequantized FP32 operands:

    fprop  y  (R, N)    = x  (R, K) grouped by expert  @  w[e]^T           2-D x 3-D, offsets over R
    dgrad  dx (R, K)    = dy (R, N) grouped by expert  @  (w[e]^T)^T       2-D x 3-D, offsets over R
    wgrad  dw (E, N, K) = dy^T (N, T)  @  x^T (K, T)^T, each expert a span of T   2-D x 2-D

The operator's contract, as torch's meta kernel states it (`_meta_grouped_mm_common` in
torch/_meta_registrations.py): E4M3 operands, the first row major and the second column major,
16-byte strides, FP32 scales (2-D x 3-D: one per row of the first, (G, N) for the second;
2-D x 2-D: one per row per group, group-major), int32 end offsets, a BF16 output. A tensor-wise
or delayed scale is the same scale repeated on every row of its expert. The kernel's offsets must
keep each group's bytes 16-byte aligned: wgrad's token spans are zero-padded to multiples of 16
(zeros change no product and no scale, which are already computed). `on_kernel` (through
`grouped_scaled_ok`) is the one place that decides whether a GEMM can take this path; what it refuses runs the emulated
grouped GEMM, the same quantized operands.

Numerics: the same quantized operands as the emulated backend, so each expert's result is the
exact product up to the FP32 accumulation order (`backends.emulated.gemm_bound`) and the BF16
rounding of the kernel's output. tests/lowprec/sites/test_grouped_scaled_mm.py holds the operand
assembly to the operator's meta contract and, through a reference of the operator built from
`torch._scaled_mm` per group, to the emulated path on the CPU; tests/gpu runs the real kernel.
The GPU kernel is CUTLASS's grouped FP8 GEMM (torch's aten/src/ATen/native/cuda/ScaledGroupMM.cu;
its checks in GroupedBlas.cpp: at most 1024 groups, which no supported model's experts exceed).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from lowprec.numerics.formats import Format, QuantSpec, Scaling
from lowprec.numerics.quantize import Quantized

__all__ = ["ALIGN", "grouped_scaled_ok", "on_kernel", "scaled_grouped_rows", "scaled_grouped_tokens", "kernel_for",
           "group_ends"]

ALIGN = 16   # bytes, and so FP8 elements: every stride, every group's start
_ROW_SCALED = (Scaling.ROW, Scaling.TENSOR, Scaling.DELAYED)

GroupedKernel = Callable[..., torch.Tensor]


def kernel_for(backend, device: torch.device) -> GroupedKernel | None:
    """`torch._scaled_grouped_mm` where the `torch` backend runs on a GPU that has it (its CUDA
    kernel runs on compute capability 9.x and 10.x: Hopper, data-centre Blackwell), else None
    (the emulated grouped GEMM)."""
    if not getattr(backend, "fast_path", False) or device.type != "cuda":
        return None
    if not hasattr(torch, "_scaled_grouped_mm") or torch.cuda.get_device_capability(device)[0] not in (9, 10):
        return None
    return torch._scaled_grouped_mm


def _spec_ok(spec: QuantSpec | None) -> bool:
    return (spec is not None and spec.element.torch_dtype is torch.float8_e4m3fn and spec.scaling in _ROW_SCALED
            and not spec.hadamard)


def grouped_scaled_ok(spec_a: QuantSpec | None, spec_b: QuantSpec | None, reduction: int, out_cols: int) -> bool:
    """Whether a GEMM whose operands are quantized with `spec_a` and `spec_b` along `reduction`
    (K of fprop, N of dgrad; for wgrad the token spans are padded, pass ALIGN) into `out_cols`
    output columns runs on the grouped FP8 kernel: both E4M3, one scale per row or per expert,
    no Hadamard transform (the kernel has none), the reduction and the output's width multiples
    of 16 (the kernel's strides)."""
    return _spec_ok(spec_a) and _spec_ok(spec_b) and reduction % ALIGN == 0 and out_cols % ALIGN == 0


def on_kernel(kernel: GroupedKernel | None, fmt: Format, gemm: str, w_shape: Sequence[int]) -> bool:
    """Whether `gemm` ("fprop", "dgrad" or "wgrad") of a format group of experts whose weight
    is `w_shape` (E, N, K) runs on `kernel` (None: no kernel here, `kernel_for`): its two
    operands' specs and its reduction and output widths to `grouped_scaled_ok`."""
    if kernel is None:
        return False
    _, n, k = w_shape
    if gemm == "fprop":     # y = x @ w^T: along K into N columns
        return grouped_scaled_ok(fmt.input, fmt.weight, k, n)
    if gemm == "dgrad":     # dx = dy @ w: along N into K columns
        return grouped_scaled_ok(fmt.grad_output, fmt.weight, n, k)
    if gemm == "wgrad":     # dw = dy^T @ x: along the tokens (padded to ALIGN) into K columns
        return grouped_scaled_ok(fmt.grad_output_wgrad, fmt.input_wgrad, ALIGN, k)
    raise ValueError(f"gemm is one of fprop, dgrad, wgrad; got {gemm!r}")


def row_scales(q: Quantized) -> torch.Tensor:
    """One FP32 scale_inv per row of a quantization scaled per row or per tensor (its blocks one
    column wide: quantized along its rows' length), (rows,)."""
    sr, _, sc, _ = q.scale_inv.shape
    if sc != 1:
        raise ValueError(f"the grouped FP8 kernel takes one scale per row; this operand has {sc} column blocks "
                         f"({q.spec.scaling.value} scaling, shape {tuple(q.values.shape)})")
    rows = q.values.shape[0]
    s = q.scale_inv.reshape(sr).float()
    return s if sr == rows else s.repeat_interleave(rows // sr)


def _bytes(q: Quantized) -> torch.Tensor:
    """The operand's FP8 bytes, row major."""
    return q.to_storage().contiguous()


def scaled_grouped_rows(kernel: GroupedKernel, a: list[Quantized], b: list[Quantized], lengths: list[int],
                        fast_accum: bool) -> torch.Tensor:
    """fprop / dgrad of a format group: expert g's rows `a[g]` (lengths[g], D) times `b[g]` (Out,
    D)^T, both quantized along D, as one 2-D x 3-D call. Returns (sum(lengths), Out), BF16."""
    qa = torch.cat([_bytes(q) for q in a]) if len(a) > 1 else _bytes(a[0])
    sa = torch.cat([row_scales(q) for q in a]) if len(a) > 1 else row_scales(a[0])
    qb = torch.stack([_bytes(q) for q in b])                   # (G, Out, D) row major
    sb = torch.stack([row_scales(q) for q in b])               # (G, Out)
    offs = torch.tensor(group_ends(lengths), dtype=torch.int32, device=qa.device)
    return kernel(qa, qb.transpose(-2, -1), sa.contiguous(), sb.contiguous(), offs=offs, out_dtype=torch.bfloat16,
                  use_fast_accum=fast_accum)


def scaled_grouped_tokens(kernel: GroupedKernel, gt: list[Quantized], xt: list[Quantized],
                          fast_accum: bool) -> torch.Tensor:
    """wgrad of a format group: expert g's `gt[g]` (N, T_g) times `xt[g]` (K, T_g)^T, both quantized
    along their tokens, as one 2-D x 2-D call, each expert's tokens zero-padded to a multiple of
    16. Returns (G, N, K), BF16."""
    spans = [q.values.shape[1] + (-q.values.shape[1]) % ALIGN for q in gt]
    qa = torch.cat([_padded(q, n) for q, n in zip(gt, spans)], dim=1)   # (N, T) row major
    qb = torch.cat([_padded(q, n) for q, n in zip(xt, spans)], dim=1)   # (K, T) row major
    sa = torch.cat([row_scales(q) for q in gt])                         # (G * N,) group-major
    sb = torch.cat([row_scales(q) for q in xt])                         # (G * K,)
    offs = torch.tensor(group_ends(spans), dtype=torch.int32, device=qa.device)
    return kernel(qa, qb.t(), sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)


def _padded(q: Quantized, width: int) -> torch.Tensor:
    """The FP8 bytes of `q` (rows, T) with zero columns up to `width` (grid values are exact in
    FP8, so padding the values before the cast is the same as padding the bytes)."""
    t = q.values.shape[1]
    if t == width:
        return _bytes(q)
    return F.pad(q.values.float(), (0, width - t)).to(q.spec.element.torch_dtype)


def group_ends(sizes: list[int]) -> list[int]:
    """The end offset of each group of `sizes` (the grouped GEMMs' `offs`), host ints."""
    out, s = [], 0
    for n in sizes:
        s += n
        out.append(s)
    return out
