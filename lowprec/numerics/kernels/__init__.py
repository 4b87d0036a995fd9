"""Fused Triton kernels for the FP8 fast path (BF16/FP32 in, FP8 storage out).

`lowprec.numerics.kernels` needs Triton and is never imported by `import lowprec`: importing it
without Triton raises an ImportError that says what to install. The kernels reproduce
`lowprec.numerics.quantize.quantize` bit for bit (grid values as FP8 storage bytes, `scale_inv`,
and the statistics they compute); see `lowprec.numerics.kernels.fp8_cast` and the section
"Fused FP8 cast kernels (Triton)" in docs/performance.md.

They run on CUDA tensors, or on CPU tensors when Triton's interpreter is on
(`TRITON_INTERPRET=1` in the environment before Triton is first imported), which is
how the CPU tests check them.
"""

from __future__ import annotations

try:
    import triton  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        "lowprec.numerics.kernels needs Triton (the fused FP8 cast kernels are written in it): "
        "`pip install triton` (it comes with CUDA builds of PyTorch on Linux). "
        "Without it, use lowprec.numerics.quantize.quantize, which runs on any device."
    ) from e

from lowprec.numerics.kernels.fp8_cast import (  # noqa: E402
    CastStats,
    cast_delayed,
    cast_rowwise,
    cast_tensorwise,
    kernels_available,
)

__all__ = ["CastStats", "cast_rowwise", "cast_tensorwise", "cast_delayed", "kernels_available"]
