"""GEMM FLOPs of a prepared model by format, the device's peak per GEMM class, and MFU.

`gemm_flops_per_token(model, state)` counts the training FLOPs per token of every linear
layer under the format it runs in now; `device_peaks(device)` gives the peak FLOP/s of
each hardware GEMM class (datasheet numbers for known NVIDIA GPUs, a timed matmul on a
CPU); `ideal_seconds` and `mfu` combine them. Which class a format's GEMMs run on
depends on the backend and the device: `gemm_class`.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from enum import Enum

from torch import nn

from lowprec.sites.backends import BACKEND_NAMES, BackendName
from lowprec.numerics.formats import get_format

__all__ = ["GemmClass", "Peak", "gemm_class", "peaks_for_gpu_name", "device_peaks", "best_peaks",
           "measure_cpu_fp32_peak", "gemm_flops_per_token", "ideal_seconds", "mfu"]


class GemmClass(str, Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP8 = "fp8"
    FP4 = "fp4"


_BY_RANK = {16: GemmClass.BF16, 8: GemmClass.FP8, 4: GemmClass.FP4}


@dataclass(frozen=True)
class Peak:
    flops_per_s: float
    source: str        # where the number comes from: a datasheet line or a measurement
    measured: bool


def gemm_class(backend: str, fmt: str, device_type: str) -> GemmClass:
    """The hardware GEMM a site of format `fmt` runs on with `backend` on `device_type`.

    On a CPU everything is FP32. The `emulated` backend multiplies dequantized FP32
    operands with `@` (lowprec/sites/backends/emulated.py: `Quantized.values` are float32 grid
    points times float32 scales), so its quantized sites are FP32 GEMMs on a GPU too
    (CUDA cores; TF32 tensor cores only if the user enables `allow_tf32`); its `bf16` sites
    run `F.linear` on BF16 tensors (lowprec/sites/layers.py), i.e. BF16 tensor cores. On the
    `torch`, `te` and `torchao` backends a format runs on the tensor cores of its width: FP8
    formats (fp8_*, mxfp8) on FP8, FP4 formats (nvfp4, mxfp4, fp4_tensorwise) on FP4, bf16 on
    BF16 (`torchao` on CUDA runs real FP8 GEMMs unless a site was built with emulate=True).
    """
    rank = get_format(fmt).bits
    if backend not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {backend!r}; allowed: {', '.join(BACKEND_NAMES)} (plan.backend)")
    if device_type != "cuda":
        return GemmClass.FP32
    if BackendName(backend) is BackendName.EMULATED:
        return GemmClass.BF16 if rank == 16 else GemmClass.FP32
    return _BY_RANK[rank]


# Dense (no 2:4 sparsity) peaks in TFLOP/s from NVIDIA's datasheets: "NVIDIA H100 Tensor Core GPU"
# datasheet (SXM5, PCIe, NVL columns), "NVIDIA H200 Tensor Core GPU" datasheet (SXM, NVL) and
# "NVIDIA HGX B200" / DGX B200 datasheet (per GPU = the 8-GPU figure / 8). The datasheets print
# tensor-core numbers with sparsity; the dense numbers here are half of them. FP32 is the
# non-tensor FP32 figure. FP8 exists from Hopper on and FP4 only on Blackwell: a class a GPU
# lacks is absent. Patterns are tried in order against torch.cuda.get_device_name().
_GPU_PEAKS_TFLOPS: tuple[tuple[str, str, dict[GemmClass, float]], ...] = (
    (r"\bH100\b.*\bPCIe\b", "NVIDIA H100 PCIe datasheet",
     {GemmClass.FP32: 51.0, GemmClass.BF16: 756.5, GemmClass.FP8: 1513.0}),
    (r"\bH100 NVL\b", "NVIDIA H100 NVL datasheet",
     {GemmClass.FP32: 60.0, GemmClass.BF16: 835.5, GemmClass.FP8: 1670.5}),
    (r"\bH100\b", "NVIDIA H100 SXM5 datasheet",
     {GemmClass.FP32: 67.0, GemmClass.BF16: 989.5, GemmClass.FP8: 1979.0}),
    (r"\bH200 NVL\b", "NVIDIA H200 NVL datasheet",
     {GemmClass.FP32: 60.0, GemmClass.BF16: 835.5, GemmClass.FP8: 1670.5}),
    (r"\bH200\b", "NVIDIA H200 SXM datasheet",
     {GemmClass.FP32: 67.0, GemmClass.BF16: 989.5, GemmClass.FP8: 1979.0}),
    (r"\bB200\b", "NVIDIA HGX B200 datasheet (per GPU)",
     {GemmClass.FP32: 75.0, GemmClass.BF16: 2250.0, GemmClass.FP8: 4500.0, GemmClass.FP4: 9000.0}),
)


def peaks_for_gpu_name(name: str) -> dict[GemmClass, Peak]:
    """The datasheet peaks of the GPU called `name` (as torch.cuda.get_device_name gives it);
    {} for a GPU not in the table (GH200 included: it is not an H200)."""
    for pattern, sheet, table in _GPU_PEAKS_TFLOPS:
        if re.search(pattern, name):
            return {c: Peak(tf * 1e12, f"{sheet}, dense {c.value.upper()}", False) for c, tf in table.items()}
    return {}


def measure_cpu_fp32_peak(n: int = 1024, reps: int = 5, budget_s: float = 0.4) -> Peak:
    """FP32 GEMM peak of this CPU with torch's current thread count: an n x n x n matmul,
    best of up to `reps` timings after one warm-up, stopping early past `budget_s`."""
    import torch
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm-up: allocation and BLAS initialisation
    best, done, start = float("inf"), 0, time.perf_counter()
    while done < reps and (done == 0 or time.perf_counter() - start < budget_s):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
        done += 1
    return Peak(2.0 * n ** 3 / best, f"measured: fp32 matmul {n}^3 on this CPU "
                f"(torch threads: {torch.get_num_threads()}), best of {done}", True)


def device_peaks(device, *, measure_cpu: bool = True) -> dict:
    """GemmClass -> Peak for `device`. CUDA: the datasheet table by device name ({} for a GPU
    not in it; nothing raised). CPU: the measured FP32 GEMM peak for every class, since the
    CPU runs every format's GEMM in FP32 (gemm_class); {} when `measure_cpu` is False.
    Other device types: {}."""
    import torch
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return peaks_for_gpu_name(torch.cuda.get_device_name(index))
    if device.type == "cpu" and measure_cpu:
        peak = measure_cpu_fp32_peak()
        return {c: peak for c in GemmClass}
    return {}


def best_peaks(before: dict, device) -> dict:
    """`before` with each measured peak (a CPU's) replaced by the better of it and a new
    measurement now; datasheet peaks unchanged. A timed matmul reads low when something else
    held a core during it (at a run's start: the tracker opening its store, data loading),
    which made MFU on the same CPU differ twofold between two runs; the best of the start's
    and the end's measurement is the peak."""
    if not any(p.measured for p in before.values()):
        return before
    now = device_peaks(device)
    out = {}
    for cls, old in before.items():
        new = now.get(cls)
        if not old.measured or new is None:
            out[cls] = old
            continue
        best = new if new.flops_per_s > old.flops_per_s else old
        out[cls] = Peak(best.flops_per_s, f"{best.source}; the better of two measurements, at start-up "
                        f"({old.flops_per_s / 1e12:.3g} TFLOP/s) and at the end ({new.flops_per_s / 1e12:.3g})",
                        True)
    return out


def gemm_flops_per_token(model: nn.Module, state) -> dict[str, float]:
    """Training FLOPs per token of the model's linear layers, keyed by the format each runs in.

    Each layer costs 6 * in * out per token: the forward GEMM and the two backward GEMMs
    (input gradient, weight gradient), 2 * in * out each. A lowprec site (`state.sites`)
    counts under its current format; every other nn.Linear (kept in high precision, e.g.
    lm_head) under "bf16". Not counted: the attention score and value matmuls (activation
    x activation, no weights, their cost grows with the sequence length), embeddings,
    norms and element-wise work, so MFU from this count is of the weight GEMMs only.
    """
    out: dict[str, float] = {}
    site_modules = set()
    for site in state.sites.values():
        site_modules.add(id(site.module))
        name = site.format.name
        out[name] = out.get(name, 0.0) + float(site.flops_per_token)
    for module in model.modules():
        if isinstance(module, nn.Linear) and id(module) not in site_modules:
            out["bf16"] = out.get("bf16", 0.0) + 6.0 * module.in_features * module.out_features
    return out


def ideal_seconds(flops_by_format: dict[str, float], peaks: dict, backend: str,
                  device_type: str) -> float | None:
    """Seconds the FLOPs would take at peak: sum over formats of flops / peak of the format's
    GEMM class (per token if the FLOPs are per token). None if a needed class has no peak."""
    total = 0.0
    for fmt, flops in flops_by_format.items():
        if flops == 0:
            continue
        peak = peaks.get(gemm_class(backend, fmt, device_type))
        if peak is None:
            return None
        total += flops / peak.flops_per_s
    return total


def mfu(flops_by_format: dict[str, float], seconds: float, peaks: dict, backend: str,
        device_type: str) -> float | None:
    """Model FLOPs utilisation: ideal_seconds / seconds (the same FLOPs took `seconds`);
    None when a needed class has no peak."""
    if not seconds > 0:
        raise ValueError(f"mfu needs the positive seconds the FLOPs took, got {seconds!r}; pass the "
                         f"measured step time (per token if the FLOPs are per token)")
    ideal = ideal_seconds(flops_by_format, peaks, backend, device_type)
    return None if ideal is None else ideal / seconds
