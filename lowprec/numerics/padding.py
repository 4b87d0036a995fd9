"""Zero padding of FP8 GEMM operands to the multiples of 16 that cuBLASLt's `_scaled_mm` needs.

Zero rows and columns change no product and no scale (FP8 zero is all bits 0; row-wise scales
are padded with ones), so the caller slices the padding off the result. Used by the `torch`
backend's GEMM (lowprec.sites.backends.scaled_mm) and the FP8 fast path (lowprec.sites.fp8_linear).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["pad16"]


def pad16(qa: torch.Tensor, qb: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor):
    """Zero-pad a (M, K) and b (N, K) to multiples of 16; row-wise scales padded with ones."""
    pm, pn, pk = (-qa.shape[0]) % 16, (-qb.shape[0]) % 16, (-qa.shape[1]) % 16
    qa = F.pad(qa.view(torch.uint8), (0, pk, 0, pm)).view(qa.dtype)  # FP8 zero is all bits 0
    qb = F.pad(qb.view(torch.uint8), (0, pk, 0, pn)).view(qb.dtype)
    if sa.dim() == 2 and pm:
        sa = F.pad(sa, (0, 0, 0, pm), value=1.0)
    if sb.dim() == 2 and pn:
        sb = F.pad(sb, (0, pn), value=1.0)
    return qa, qb, sa, sb
