"""`torchrun ... titan_launch.py --module M --config F`: the package's torchtitan launcher
(`lowprec.integrations.torchtitan_launch`: torchtitan's own `main()` after the pipeline-schedule
adapter, the timeout change and, without an accelerator, the CPU device), started as a script
from this folder so that the job modules the tests write beside it are importable.

One more CPU change, the tests' own: `torch._scaled_mm` on CPU tensors (the `torch` backend's
FP8 GEMM) runs torch's reference kernel (4.6 s for one 128x256x768 GEMM on the test machine,
against milliseconds for the same product in FP32), too slow for torchtitan's debug model.
Here it computes the product as lowprec's `emulated` backend does: the FP8 operands
dequantized by their scales, multiplied in FP32 (row-wise scales: the CPU kernel's result bit
for bit; tensor-wise: up to FP32 summation order), rounded to `out_dtype`. The FP8 bytes,
scales and gathers are the real ones; only the multiplication of those bytes runs in another kernel."""

import sys

import torch

from lowprec.integrations.torchtitan_launch import main

_scaled_mm = torch._scaled_mm


def _scaled_mm_fp32(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    """`torch._scaled_mm` with the CPU's product computed in FP32 (see the module docstring)."""
    if a.device.type != "cpu" or scale_result is not None:
        return _scaled_mm(a, b, scale_a, scale_b, bias=bias, scale_result=scale_result, out_dtype=out_dtype,
                          use_fast_accum=use_fast_accum)
    out = (a.float() * scale_a.float()) @ (b.float() * scale_b.float())
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or a.dtype)


if __name__ == "__main__":
    torch._scaled_mm = _scaled_mm_fp32
    sys.exit(main())
