"""lowprec.tracking.peaks: GEMM FLOPs of a prepared small GPT, peak tables, MFU arithmetic."""

from __future__ import annotations

import pytest
import torch

from experiments.model import build_gpt
from lowprec import prepare
from lowprec.sites.plan import PrecisionPlan
from lowprec.tracking.peaks import (GemmClass, Peak, device_peaks, gemm_class, gemm_flops_per_token,
                                    ideal_seconds, mfu, peaks_for_gpu_name)
from small_gpt import MODEL

PLAN = {
    "backend": "emulated",
    "keep_high_precision": [{"fqns": ["lm_head"]}],
    "rules": [{"name": "all", "select": {"glob": "blocks.*"}, "format": "fp8_tensorwise",
               "ladder": ["fp8_tensorwise", "bf16"]}],
}


def test_flops_per_token_by_hand_and_after_a_switch():
    torch.manual_seed(0)
    model = build_gpt(**MODEL)
    state = prepare(model, PrecisionPlan.from_dict(PLAN))
    d, v, layers = MODEL["d_model"], MODEL["vocab_size"], MODEL["n_layer"]
    # per block: qkv d->3d, attn.proj d->d, mlp.fc d->4d, mlp.proj 4d->d; 6 FLOPs per weight per token
    block = 6 * (d * 3 * d + d * d + d * 4 * d + 4 * d * d)
    lm_head = 6 * d * v
    assert gemm_flops_per_token(model, state) == {"fp8_tensorwise": layers * block, "bf16": lm_head}

    state.set_format("blocks.0.mlp.fc", "bf16")
    moved = 6 * d * 4 * d
    assert gemm_flops_per_token(model, state) == {"fp8_tensorwise": layers * block - moved,
                                                  "bf16": lm_head + moved}
    state.set_format(list(state.sites), "bf16")
    assert gemm_flops_per_token(model, state) == {"bf16": layers * block + lm_head}


def test_cpu_peak_is_measured_and_sane():
    peaks = device_peaks("cpu")
    assert set(peaks) == set(GemmClass)
    peak = peaks[GemmClass.FP32]
    assert all(p is peak for p in peaks.values())  # the CPU runs every class in FP32
    assert peak.measured and peak.source.startswith("measured: fp32 matmul 1024^3")
    # one to a few cores of a current CPU: between 0.5 GFLOP/s and 20 TFLOP/s
    assert 5e8 < peak.flops_per_s < 2e13, peak
    assert device_peaks("cpu", measure_cpu=False) == {}


def test_gpu_table_by_name():
    sxm = peaks_for_gpu_name("NVIDIA H100 80GB HBM3")
    assert set(sxm) == {GemmClass.FP32, GemmClass.BF16, GemmClass.FP8}
    assert sxm[GemmClass.FP8].flops_per_s == 1979e12 and sxm[GemmClass.BF16].flops_per_s == 989.5e12
    assert sxm[GemmClass.FP8].source == "NVIDIA H100 SXM5 datasheet, dense FP8"
    assert not sxm[GemmClass.FP8].measured
    pcie = peaks_for_gpu_name("NVIDIA H100 PCIe")
    assert pcie[GemmClass.FP8].flops_per_s == 1513e12 and "PCIe" in pcie[GemmClass.FP8].source
    assert peaks_for_gpu_name("NVIDIA H100 NVL")[GemmClass.BF16].flops_per_s == 835.5e12
    h200 = peaks_for_gpu_name("NVIDIA H200")
    assert h200[GemmClass.FP8].flops_per_s == 1979e12 and GemmClass.FP4 not in h200
    b200 = peaks_for_gpu_name("NVIDIA B200")
    assert b200[GemmClass.FP4].flops_per_s == 9000e12 and b200[GemmClass.FP8].flops_per_s == 4500e12
    assert peaks_for_gpu_name("NVIDIA A100-SXM4-80GB") == {}
    assert peaks_for_gpu_name("NVIDIA GH200 480GB") == {}  # not an H200


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_peaks_on_this_gpu():
    name = torch.cuda.get_device_name(0)
    assert device_peaks("cuda:0") == peaks_for_gpu_name(name)


@pytest.mark.parametrize("backend,fmt,device,expected", [
    ("emulated", "fp8_tensorwise", "cpu", GemmClass.FP32),
    ("emulated", "nvfp4", "cpu", GemmClass.FP32),
    ("emulated", "bf16", "cpu", GemmClass.FP32),
    ("emulated", "fp8_tensorwise", "cuda", GemmClass.FP32),  # dequantized FP32 operands
    ("emulated", "mxfp4", "cuda", GemmClass.FP32),
    ("emulated", "bf16", "cuda", GemmClass.BF16),
    ("torch", "fp8_tensorwise", "cuda", GemmClass.FP8),
    ("torch", "fp8_rowwise", "cuda", GemmClass.FP8),
    ("torch", "bf16", "cuda", GemmClass.BF16),
    ("torch", "fp8_rowwise", "cpu", GemmClass.FP32),
    ("te", "mxfp8", "cuda", GemmClass.FP8),
    ("te", "fp8_delayed", "cuda", GemmClass.FP8),
    ("te", "fp8_blockwise", "cuda", GemmClass.FP8),
    ("te", "nvfp4", "cuda", GemmClass.FP4),
    ("te", "mxfp4", "cuda", GemmClass.FP4),
    ("te", "bf16", "cuda", GemmClass.BF16),
    ("te", "nvfp4", "cpu", GemmClass.FP32),
])
def test_gemm_class(backend, fmt, device, expected):
    assert gemm_class(backend, fmt, device) is expected


def test_gemm_class_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown backend 'cublas'; allowed: emulated, torch, te"):
        gemm_class("cublas", "bf16", "cuda")
    with pytest.raises(ValueError, match="unknown precision format 'fp6'"):
        gemm_class("te", "fp6", "cuda")


def test_ideal_seconds_and_mfu_by_hand():
    peaks = {GemmClass.BF16: Peak(1e12, "hand", False), GemmClass.FP8: Peak(2e12, "hand", False)}
    flops = {"fp8_tensorwise": 4e12, "bf16": 1e12, "mxfp4": 0.0}  # a zero entry needs no peak
    # 4e12 / 2e12 + 1e12 / 1e12 = 3 s
    assert ideal_seconds(flops, peaks, "te", "cuda") == pytest.approx(3.0)
    assert mfu(flops, 6.0, peaks, "te", "cuda") == pytest.approx(0.5)
    assert ideal_seconds({"nvfp4": 1e12}, peaks, "te", "cuda") is None  # no FP4 peak
    assert mfu({"nvfp4": 1e12}, 1.0, peaks, "te", "cuda") is None
    cpu = {c: Peak(5e10, "hand", True) for c in GemmClass}
    assert ideal_seconds(flops, cpu, "emulated", "cpu") == pytest.approx(5e12 / 5e10)
    with pytest.raises(ValueError, match="positive seconds"):
        mfu(flops, 0.0, peaks, "te", "cuda")


def test_best_peaks_keeps_the_better_cpu_measurement_and_every_datasheet_peak():
    """A CPU peak timed while another thread held a core reads low: the end-of-run measurement
    replaces it when higher, and says both figures; a peak no lower than a new measurement, and
    datasheet peaks, stay."""
    from lowprec.tracking.peaks import best_peaks
    low = Peak(1e6, "measured: fp32 matmul 1024^3 on this CPU", True)      # far below any CPU's
    got = best_peaks({c: low for c in GemmClass}, "cpu")
    assert set(got) == set(GemmClass)
    assert all(p.measured and p.flops_per_s > 5e8 for p in got.values())
    assert "the better of two measurements" in got[GemmClass.FP32].source
    assert "at start-up (1e-06 TFLOP/s)" in got[GemmClass.FP32].source
    high = Peak(1e16, "measured: fp32 matmul 1024^3 on this CPU", True)    # beyond any CPU's
    assert best_peaks({GemmClass.FP32: high}, "cpu")[GemmClass.FP32].flops_per_s == 1e16
    sheet = {GemmClass.BF16: Peak(989e12, "datasheet: H100 SXM", False)}
    assert best_peaks(sheet, "cpu") is sheet
