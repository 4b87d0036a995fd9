"""The `torch` backend: real FP8 GEMMs through `torch._scaled_mm`, tensor-wise and row-wise.

Operands are cast to PyTorch's float8 dtypes (`float8_e4m3fn`, `float8_e5m2`) and
multiplied by `torch._scaled_mm(a, b.t(), scale_a=a.scale_inv, scale_b=b.scale_inv)`
with an FP32 output. `_scaled_mm` has no autograd; `lowprec.layers` provides the
backward as three GEMMs of its own. On CPU (PyTorch 2.6+) the same call runs and
computes `(a * scale_a) @ (b * scale_b)` in FP32, which the `emulated` backend matches
bit for bit; on Hopper/Blackwell GPUs it runs on FP8 tensor cores.

Limits, checked in `supports` and in `gemm`: only tensor-wise / row-wise FP8 formats
(`fp8_tensorwise`, `fp8_delayed`, `fp8_rowwise`); E5M2 x E5M2 is refused by cuBLAS
(no recipe here needs it); on CUDA both GEMM dimensions and K must be multiples of 16,
and row-wise scaling needs E4M3 operands and a BF16 output on current cuBLAS, so
row-wise GEMMs on CUDA return BF16 upcast to FP32 (documented in docs/performance.md).
"""

from __future__ import annotations

import torch

from lowprec.formats import Format, Scaling
from lowprec.quantize import Quantized

__all__ = ["ScaledMMBackend"]

_SUPPORTED = (Scaling.TENSOR, Scaling.DELAYED, Scaling.ROW)


class ScaledMMBackend:
    name = "torch"

    def supports(self, fmt: Format) -> tuple[bool, str]:
        if fmt.is_high_precision:
            return True, ""
        if not hasattr(torch, "_scaled_mm"):
            return False, f"torch {torch.__version__} has no torch._scaled_mm; use backend 'emulated'"
        for role, spec in fmt.specs().items():
            if spec.element.torch_dtype is None or spec.scaling not in _SUPPORTED:
                return False, (
                    f"backend 'torch' runs tensor-wise and row-wise FP8 through torch._scaled_mm; "
                    f"format {fmt.name!r} quantizes {role} as {spec.element.name}/"
                    f"{spec.scaling.value}. Use fp8_tensorwise, fp8_delayed or fp8_rowwise, or "
                    f"backend 'emulated' (every format) or 'te' (MXFP8/NVFP4 on Blackwell)")
        return True, ""

    def gemm(self, a, b) -> torch.Tensor:
        if not (isinstance(a, Quantized) and isinstance(b, Quantized)):
            raise TypeError("backend 'torch' multiplies two quantized operands; got "
                            f"{type(a).__name__} and {type(b).__name__}")
        row_a = a.spec.scaling is Scaling.ROW
        sa = a.scale_inv.reshape(-1, 1) if row_a else a.scale_inv.reshape(())
        sb = b.scale_inv.reshape(1, -1) if b.spec.scaling is Scaling.ROW else b.scale_inv.reshape(())
        if row_a != (b.spec.scaling is Scaling.ROW):  # mixed: expand the tensor-wise one
            sa = sa.expand(a.values.shape[0], 1).contiguous() if not row_a else sa
            sb = sb.reshape(1, 1).expand(1, b.values.shape[0]).contiguous() if row_a else sb
        qa = a.to_storage().contiguous()   # cuBLASLt: row-major a, column-major b
        qb = b.to_storage().contiguous()
        cuda_rowwise = a.values.is_cuda and sa.dim() == 2
        out_dtype = torch.bfloat16 if cuda_rowwise else torch.float32
        out = torch._scaled_mm(qa, qb.t(), scale_a=sa.float(), scale_b=sb.float(), out_dtype=out_dtype)
        return out.float()

    def __repr__(self) -> str:
        return "ScaledMMBackend()"
