"""lowprec.tracking.energy with the real libraries: codecarbon on this CPU, NVML where a GPU is."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from lowprec.tracking.energy import (EnergySource, EnergyUnavailableError, emissions_grams,
                                     open_meter)

codecarbon = pytest.importorskip("codecarbon")


def _busy(seconds: float) -> None:
    a = torch.randn(384, 384)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


@pytest.fixture(scope="module")
def cpu_meter():
    meter, reason = open_meter("codecarbon", "cpu")
    yield meter, reason
    meter.close()


def test_codecarbon_readings_grow_with_work_and_parts_add_up(cpu_meter, tmp_path, monkeypatch):
    meter, reason = cpu_meter
    assert "codecarbon" in reason
    readings = [meter.read()]
    for _ in range(4):
        _busy(0.5)
        readings.append(meter.read())
    joules = [r.joules for r in readings]
    assert joules == sorted(joules), joules
    assert joules[-1] > joules[0]
    for r in readings:
        assert set(r.parts) >= {"cpu", "ram"}
        assert sum(r.parts.values()) == pytest.approx(r.joules, rel=1e-12)
    assert readings[-1].parts["cpu"] > readings[0].parts["cpu"]
    # watts implied by the last 2 s: an estimate of a real machine, not zero and not absurd
    assert 0.1 < (joules[-1] - joules[0]) / 2.0 < 5000


def test_codecarbon_here_is_an_estimate(cpu_meter):
    meter, _ = cpu_meter
    reading = meter.read()
    if meter.measured:  # a machine with RAPL readable: the source names the counter
        assert "counter" in reading.source or "RAPL" in reading.source
    else:
        assert reading.measured is False
        assert f"codecarbon {codecarbon.__version__} estimate" in reading.source
        assert "TDP" in reading.source


def test_codecarbon_writes_no_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    meter, _ = open_meter(EnergySource.CODECARBON)
    meter.read()
    meter.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="AUTO picks NVML on a CUDA device")
def test_auto_on_cpu_is_codecarbon():
    meter, reason = open_meter("auto", "cpu")
    try:
        assert meter is not None and meter.source.startswith("codecarbon")
        assert "not NVML" in reason and "cpu" in reason
    finally:
        meter.close()


def test_nvml_on_cpu_raises_naming_what_is_missing():
    with pytest.raises(EnergyUnavailableError, match="NVML measures NVIDIA GPUs but the training device is cpu"):
        open_meter("nvml", "cpu")
    with pytest.raises(ValueError, match="unknown energy source 'rapl'; allowed: auto, nvml, codecarbon, off"):
        open_meter("rapl")


def test_off():
    assert open_meter(EnergySource.OFF, "cpu") == (None, "telemetry.energy is off")
    assert open_meter("off") == (None, "telemetry.energy is off")


def test_emissions_grams_by_hand():
    assert emissions_grams(3.6e6, 400.0) == pytest.approx(400.0)  # 1 kWh at 400 g/kWh
    assert emissions_grams(1800.0, 250.0) == pytest.approx(0.125)  # 0.5 Wh -> 0.0005 kWh * 250
    assert emissions_grams(0.0, 500.0) == 0.0
    with pytest.raises(ValueError, match="non-negative"):
        emissions_grams(-1.0, 100.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for NVML")
def test_nvml_meter_on_the_gpu():
    pytest.importorskip("pynvml")
    meter, reason = open_meter("nvml", "cuda:0")
    try:
        assert meter.measured and "NVML energy counter" in meter.source
        first = meter.read()
        a = torch.randn(4096, 4096, device="cuda")
        end = time.perf_counter() + 1.5
        while time.perf_counter() < end:
            a = torch.tanh(a @ a)
        torch.cuda.synchronize()
        time.sleep(0.2)  # the counter updates every few tens of ms
        second = meter.read()
        assert second.joules > first.joules >= 0
        assert second.parts == {"gpu": second.joules} and second.measured
    finally:
        meter.close()


def test_import_loads_neither_library():
    # torch itself imports pynvml when it is installed (torch.cuda's memory queries), so the
    # check is what importing our module adds on top of torch and lowprec
    code = ("import sys, torch, lowprec; before = set(sys.modules); import lowprec.tracking.energy; "
            "libs = lambda names: sorted(m for m in names if m.split('.')[0] in ('codecarbon', 'pynvml')); "
            "print(libs(set(sys.modules) - before), libs(m for m in sys.modules if m.startswith('codecarbon')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] []", out.stdout
