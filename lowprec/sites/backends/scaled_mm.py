"""The `torch` backend: real FP8 GEMMs through `torch._scaled_mm`, tensor-wise and row-wise.

Operands are cast to PyTorch's float8 dtypes (`float8_e4m3fn`, `float8_e5m2`) and
multiplied by `torch._scaled_mm(a, b.t(), scale_a=a.scale_inv, scale_b=b.scale_inv)`
with an FP32 output. `_scaled_mm` has no autograd; `lowprec.sites.layers` provides the
backward as three GEMMs of its own. On CPU (PyTorch 2.6+) the same call runs and
computes `(a * scale_a) @ (b * scale_b)` in FP32, in a summation order and scale placement
of its own: within `lowprec.sites.backends.emulated.gemm_bound` of the `emulated` backend
(an FP32 error bound; not bit for bit, at any row count); on Hopper/Blackwell GPUs it runs
on FP8 tensor cores.

Limits, checked in `supports` and in `gemm`: only tensor-wise / row-wise FP8 formats
(`fp8_tensorwise`, `fp8_delayed`, `fp8_rowwise`); E5M2 x E5M2 is refused by cuBLAS
(no recipe here needs it); on CUDA both GEMM dimensions and K must be multiples of 16,
and row-wise scaling needs E4M3 operands and a BF16 output on current cuBLAS, so
row-wise GEMMs on CUDA return BF16 upcast to FP32 (documented in docs/performance.md).

BF16 output: `gemm(a, b, out_dtype=torch.bfloat16)` on CUDA asks `_scaled_mm` for a BF16
result directly (the epilogue rounds the FP32 accumulator once; no FP32 tensor and no
separate cast pass), which is what `PrecisionLinear` asks for when its input is BF16. On
CPU the result stays FP32 and the layer casts it, as the `emulated` backend does.
"""

from __future__ import annotations

import torch

from lowprec.numerics.formats import Format, Scaling
from lowprec.numerics.padding import pad16
from lowprec.numerics.quantize import Quantized
from lowprec.sites.backends.linear_sites import PrecisionLinearSites

__all__ = ["ScaledMMBackend"]

_SUPPORTED = (Scaling.TENSOR, Scaling.DELAYED, Scaling.ROW)


class ScaledMMBackend(PrecisionLinearSites):
    name = "torch"
    native_out_dtype = True   # gemm takes out_dtype (BF16 on CUDA)
    fp8_storage = True        # cached weights keep their FP8 storage form (lowprec.sites.weight_cache)
    fast_path = True          # PrecisionLinear runs its FP8 formats on lowprec.sites.fp8_linear

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

    def gemm(self, a, b, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """a @ b^T: in BF16 when `out_dtype` is BF16 on CUDA, else in FP32."""
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
        m = qa.shape[0]
        if qa.is_cuda and (m % 16 or qb.shape[0] % 16 or qa.shape[1] % 16):
            # cuBLASLt needs every dimension a multiple of 16 (an eval window of odd length):
            # zero rows/columns change no product and no scale; the padding is sliced off
            qa, qb, sa, sb = pad16(qa, qb, sa, sb)
        native_bf16 = a.values.is_cuda and out_dtype == torch.bfloat16
        cuda_rowwise = a.values.is_cuda and sa.dim() == 2
        mm_dtype = torch.bfloat16 if (cuda_rowwise or native_bf16) else torch.float32
        out = torch._scaled_mm(qa, qb.t(), scale_a=sa.float(), scale_b=sb.float(), out_dtype=mm_dtype)
        out = out[:m, :b.values.shape[0]]
        return out if native_bf16 else out.float()

    def __repr__(self) -> str:
        return "ScaledMMBackend()"

