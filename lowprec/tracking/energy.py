"""Energy of a run, read through maintained meters: NVML's GPU energy counter or codecarbon.

`open_meter(source, device)` returns an `EnergyMeter` whose `read()` gives the joules used
since the meter opened (cumulative, cheap enough to call every few seconds) and whether
they were *measured* by a hardware counter or *estimated*. `emissions_grams` turns joules
into grams of CO2e for a grid intensity given by the caller (lowprec never looks one up).

Neither library is imported at module import time: `import lowprec.tracking.energy` loads
neither codecarbon nor pynvml; both come with `pip install 'lowprec[telemetry]'`.

- NVML (`pynvml` from the PyPI package nvidia-ml-py): `nvmlDeviceGetTotalEnergyConsumption`,
  millijoules since the driver loaded (Volta and later); the value at open is the zero
  point. The torch CUDA device is matched to its NVML handle by UUID, so
  CUDA_VISIBLE_DEVICES and device reordering are respected.
- codecarbon (3.x): an `OfflineEmissionsTracker` with no outputs but our own handler.
  Its public `flush()` measures now and hands the cumulative totals (kWh per component)
  to the tracker's output handlers, which is how `read()` gets them without private
  attributes. Offline tracker plus a forced carbon intensity (we compute emissions
  ourselves): it never looks up a location, a cloud region or Electricity Maps, so it
  never waits on the network; no output methods: it writes no CSV file.
  `tracking_mode="process"`: when codecarbon estimates from the CPU's TDP it scales by
  this process's (and its children's) CPU time, so other jobs on a shared machine and
  the other DDP ranks of the same node are not counted in this run (in "machine" mode
  each rank would count the whole node). A RAPL counter is read package-wide in both
  modes; codecarbon always estimates RAM power from its size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

__all__ = ["EnergySource", "EnergyReading", "EnergyMeter", "EnergyUnavailableError",
           "open_meter", "emissions_grams", "JOULES_PER_KWH"]

JOULES_PER_KWH = 3.6e6
INSTALL_HINT = "pip install 'lowprec[telemetry]'"
_CODECARBON_INTERVAL_S = 10.0  # its background sampling; every read() measures as well
# codecarbon CPU modes that read an energy counter; the others ("cpu_load", "constant") estimate from TDP
_COUNTER_CPU_MODES = {"intel_rapl": "RAPL counter", "windows_emi": "Windows energy meter",
                      "intel_power_gadget": "Intel Power Gadget", "apple_powermetrics": "powermetrics"}


class EnergySource(str, Enum):
    AUTO = "auto"
    NVML = "nvml"
    CODECARBON = "codecarbon"
    OFF = "off"


class EnergyUnavailableError(ValueError):
    """An energy source asked for explicitly cannot work here; the message says why and the fix."""


@dataclass(frozen=True)
class EnergyReading:
    joules: float            # cumulative since the meter started
    measured: bool           # True: a hardware counter (NVML, RAPL); False: an estimate
    source: str              # human-readable: the library, the method and the device
    parts: dict[str, float] = field(default_factory=dict)  # joules by component


class EnergyMeter(Protocol):
    measured: bool
    source: str

    def read(self) -> EnergyReading: ...

    def close(self) -> None: ...


def emissions_grams(joules: float, grid_g_per_kwh: float) -> float:
    """Grams of CO2e of `joules` on a grid emitting `grid_g_per_kwh` (1 kWh = 3.6e6 J)."""
    if joules < 0 or grid_g_per_kwh < 0:
        raise ValueError(f"emissions_grams needs non-negative energy and grid intensity, got "
                         f"{joules} J and {grid_g_per_kwh} g/kWh; pass the cumulative joules of a "
                         f"reading and the grid's intensity in gCO2e per kWh")
    return joules / JOULES_PER_KWH * grid_g_per_kwh


# ---------------------------------------------------------------------------------------- NVML
class _NvmlMeter:
    measured = True

    def __init__(self, pynvml, handle, source: str):
        self._nvml, self._handle, self.source = pynvml, handle, source
        self._start_mj = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        self._closed = False

    def read(self) -> EnergyReading:
        joules = (self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) - self._start_mj) / 1000.0
        return EnergyReading(joules, True, self.source, {"gpu": joules})

    def close(self) -> None:
        if not self._closed:  # nvmlInit/nvmlShutdown are reference-counted by NVML
            self._closed = True
            self._nvml.nvmlShutdown()


def _open_nvml(device) -> tuple[_NvmlMeter | None, str]:
    if device is None or device.type != "cuda":
        return None, (f"NVML measures NVIDIA GPUs but the training device is {device or 'not given'}; "
                      f"pass the CUDA device the model trains on (e.g. 'cuda:0')")
    try:
        import pynvml
    except ImportError:
        return None, f"pynvml is not importable (PyPI package nvidia-ml-py); install it with {INSTALL_HINT}"
    import torch
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return None, f"NVML did not initialise ({e}): is the NVIDIA driver loaded on this machine?"
    try:
        handle, errors = None, []
        for prefix in ("GPU-", "MIG-"):  # torch gives the bare UUID, NVML wants it prefixed
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(f"{prefix}{props.uuid}")
                break
            except pynvml.NVMLError as e:
                errors.append(f"{prefix}{props.uuid}: {e}")
        if handle is None:
            raise LookupError(f"NVML has no device with the UUID of cuda:{index} ({'; '.join(errors)})")
        meter = _NvmlMeter(pynvml, handle, f"NVML energy counter, {props.name} (GPU {index})")
    except (LookupError, pynvml.NVMLError) as e:
        pynvml.nvmlShutdown()
        return None, (f"cuda:{index} ({props.name}) has no NVML energy counter: {e} (the counter needs a "
                      f"Volta or newer GPU and is absent on MIG slices); use source 'codecarbon' or 'off'")
    return meter, f"NVML energy counter of cuda:{index}"


# ---------------------------------------------------------------------------------- codecarbon
class _CodecarbonMeter:
    def __init__(self, tracker, totals: list, measured: bool, source: str):
        self._tracker, self._totals = tracker, totals
        self.measured, self.source = measured, source
        self._closed = False

    def read(self) -> EnergyReading:
        if not self._closed:
            self._tracker.flush()  # measures now and hands the totals to our handler
        if not self._totals:
            raise RuntimeError(f"{self.source}: codecarbon returned no measurement (it logs why at "
                               f"error level); open the meter again or use source 'off'")
        d = self._totals[-1]  # EmissionsData: energies in kWh, cumulative since start()
        parts = {"cpu": d.cpu_energy * JOULES_PER_KWH, "ram": d.ram_energy * JOULES_PER_KWH}
        if d.gpu_count:
            parts["gpu"] = d.gpu_energy * JOULES_PER_KWH
        # codecarbon's energy_consumed is the sum of these components; summing them here keeps
        # the identity exact instead of within float rounding
        return EnergyReading(sum(parts.values()), self.measured, self.source, parts)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._tracker.stop()  # takes a last measurement into the totals


def _codecarbon_methods(tracker) -> tuple[bool, str]:
    """(measured, how) for the hardware codecarbon chose. codecarbon has no public API saying
    whether it reads counters or estimates: its private hardware list holds one object per
    component, and a CPU's private `_mode` names the method. Both are read only here."""
    from codecarbon.external.hardware import CPU, GPU, AppleSiliconChip
    counters, estimates = [], ["RAM"]  # codecarbon always estimates RAM power from its size
    for hw in getattr(tracker, "_hardware", []):
        if isinstance(hw, CPU):
            mode = getattr(hw, "_mode", "unknown")
            if mode in _COUNTER_CPU_MODES:
                counters.append(f"CPU {_COUNTER_CPU_MODES[mode]}")
            else:
                estimates.insert(0, "CPU TDP x load" if mode == "cpu_load" else f"CPU TDP ({mode})")
        elif isinstance(hw, GPU):
            counters.append("GPU NVML counter")
        elif isinstance(hw, AppleSiliconChip):
            counters.append(f"{hw.chip_part} powermetrics")
    measured = any(c.startswith(("CPU", "GPU")) for c in counters) and not any(e.startswith("CPU") for e in estimates)
    if measured:
        return True, f"{' + '.join(counters)}, {' + '.join(estimates)} estimate"
    return False, f"estimate: {' + '.join(estimates)}" + (f", {' + '.join(counters)}" if counters else "")


def _open_codecarbon(device) -> tuple[_CodecarbonMeter | None, str]:
    try:
        import codecarbon
        from codecarbon import OfflineEmissionsTracker
        from codecarbon.output_methods.base_output import BaseOutput
    except ImportError as e:
        return None, f"codecarbon is not importable ({e}); install it with {INSTALL_HINT}"

    totals: list = []

    class _Totals(BaseOutput):  # flush() and stop() call out(total, delta)
        def out(self, total, delta):
            totals[:] = [total]

    gpu_ids = None
    if device is not None and device.type == "cuda":  # codecarbon matches ids by UUID prefix too
        import torch
        gpu_ids = [f"GPU-{torch.cuda.get_device_properties(device.index or 0).uuid}"]
    # codecarbon logs at INFO while its tracker is built, before log_level applies
    logging.getLogger("codecarbon").setLevel(logging.ERROR)
    tracker = OfflineEmissionsTracker(
        project_name="lowprec", measure_power_secs=_CODECARBON_INTERVAL_S, tracking_mode="process",
        log_level="error", output_methods=[], output_handlers=[_Totals()], api_call_interval=-1,
        allow_multiple_runs=True,  # no lock file in the temp folder
        force_carbon_intensity_g_co2e_kwh=0.0,  # no grid lookup: emissions_grams does that part
        gpu_ids=gpu_ids)
    tracker.start()  # codecarbon swallows exceptions here and logs them
    measured, how = _codecarbon_methods(tracker)
    meter = _CodecarbonMeter(tracker, totals, measured, f"codecarbon {codecarbon.__version__} {how}")
    try:
        meter.read()
    except RuntimeError as e:
        meter.close()
        return None, str(e)
    return meter, f"codecarbon {codecarbon.__version__} ({'measured' if measured else 'estimated'})"


# ------------------------------------------------------------------------------------ choosing
def open_meter(source: EnergySource | str, device=None) -> tuple[EnergyMeter | None, str]:
    """(meter, reason): the meter for `source` on `device` (the training device; cuda:N means
    that GPU), or (None, why not).

    AUTO: NVML when the device is CUDA, nvidia-ml-py imports and the GPU has an energy counter;
    else codecarbon when installed; else (None, a reason naming the install command).
    NVML or CODECARBON asked for explicitly and unable to work raises EnergyUnavailableError
    with the reason and the fix. OFF gives (None, "telemetry.energy is off"). CUDA is never
    initialised unless `device` is a CUDA device.
    """
    try:
        source = EnergySource(source)
    except ValueError:
        raise ValueError(f"unknown energy source {source!r}; allowed: "
                         f"{', '.join(s.value for s in EnergySource)} (telemetry.energy)") from None
    if source is EnergySource.OFF:
        return None, "telemetry.energy is off"
    if device is not None:
        import torch
        device = torch.device(device)
    if source is EnergySource.NVML:
        meter, reason = _open_nvml(device)
        if meter is None:
            raise EnergyUnavailableError(f"telemetry.energy is 'nvml' but {reason}")
        return meter, reason
    if source is EnergySource.CODECARBON:
        meter, reason = _open_codecarbon(device)
        if meter is None:
            raise EnergyUnavailableError(f"telemetry.energy is 'codecarbon' but {reason}")
        return meter, reason
    nvml, why_not_nvml = _open_nvml(device)
    if nvml is not None:
        return nvml, f"auto: {why_not_nvml}"
    meter, why_not_cc = _open_codecarbon(device)
    if meter is not None:
        return meter, f"auto: {why_not_cc} (not NVML: {why_not_nvml})"
    return None, (f"no energy meter: NVML: {why_not_nvml}; codecarbon: {why_not_cc}. "
                  f"Install both with {INSTALL_HINT}, or set telemetry.energy to 'off'")
