"""What `lowprec run` and `lowprec plan` say when the chosen backend has no fast path on this device.

The `torch` backend's point is speed: real FP8 GEMMs through `torch._scaled_mm` on GPUs with
FP8 tensor cores (compute capability 8.9 and up: Ada, Hopper, Blackwell). On any other device
PyTorch still runs `_scaled_mm`, but in software: the CPU kernel has no FP8 units to use, so a
`backend: torch` run there gains nothing over `backend: emulated` (which computes the same
numbers, `lowprec.sites.backends.emulated`) and is often slower (measured on a 2-core CPU,
one square GEMM: 2.2x the upcast-and-FP32-matmul at 512, 1.1x at 2048). A slow run with no
word of why looks hung; `fast_path_note` is that word,
and `plan` shows it beside the plan. The backend is not switched behind the user's back:
the note names `emulated` as the choice for this device and the config key that sets it.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["FP8_CAPABILITY", "scaled_mm_in_hardware", "model_device", "fast_path_note"]

FP8_CAPABILITY = (8, 9)   # the first CUDA compute capability with FP8 tensor cores (Ada)


def scaled_mm_in_hardware(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` runs on FP8 tensor cores on `device` (not in software)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= FP8_CAPABILITY


def model_device(model: nn.Module) -> torch.device:
    """Where the model's parameters are (the CPU for a model without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def fast_path_note(backend: str, device: torch.device) -> str | None:
    """One line when `backend` is `torch` and `device` runs `_scaled_mm` in software; else None."""
    if backend != "torch" or scaled_mm_in_hardware(device):
        return None
    what = "the CPU" if device.type == "cpu" else f"this {device} device"
    return (f"precision.backend is 'torch', and on {what} torch._scaled_mm is emulated in software (no FP8 "
            f"tensor cores): it gains nothing over backend 'emulated', which computes the same numbers, and is "
            f"often slower. The fast choice here is `precision.backend: emulated`; 'torch' pays off on GPUs with "
            f"FP8 (compute capability 8.9+)")
