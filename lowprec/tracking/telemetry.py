"""Run telemetry: where the time and the energy went, goodput, MFU, and what a token cost.

    telemetry = Telemetry(TelemetryConfig(), device="cpu", model=model, state=state)
    telemetry.begin()                                  # start-up ends, the first pass starts
    ... clock.lap(Phase.X) inside the loop, then per pass:
    telemetry.end_pass(step, PassOutcome.APPLIED, tokens)
    metrics = telemetry.window(step)                   # at log steps: time/*, throughput/*, energy/*
    summary = telemetry.finish()                       # telemetry/* (the gateable run numbers)

The loop (`lowprec.runtime.trainer.loop`) and the `Session` lap the clock at phase boundaries
(`lowprec.tracking.phases`); this object books each pass into the goodput ledger when the
clock is flushed (at log steps: on GPUs that is when CUDA events are read), counts the GEMM
FLOPs of applied steps per format (`lowprec.tracking.peaks`) for MFU, and reads the energy
meter (`lowprec.tracking.energy`: NVML on NVIDIA GPUs, codecarbon elsewhere, labelled an
estimate when it is one) once per window.

The run's numbers (`summary()`), logged at the last step so that a gate file can name them
beside the evals: `telemetry/tokens_per_s` (tokens of the steps that survived, per second of
the whole run), `telemetry/goodput` (productive seconds / wall seconds),
`telemetry/energy_per_token_j`, each with a `_stderr`: the relative standard error of the
step's speed over the log windows (the spread within one run; a gate's tolerance has to
absorb the spread between runs, docs/gates.md), and `telemetry/mfu`,
`telemetry/step_tokens_per_s`, `telemetry/energy_j`, `telemetry/emissions_g`, the buckets
`telemetry/bucket/<bucket>_s` and the phases `telemetry/phase/<phase>_s`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from lowprec.tracking.energy import EnergySource, emissions_grams, open_meter
from lowprec.tracking.phases import (ALWAYS_WASTED, NULL_CLOCK, Bucket, GoodputLedger, LapClock, PassOutcome, Phase,
                                     lap_clock)

__all__ = ["TelemetryConfig", "Telemetry", "EnergySource"]


@dataclass(frozen=True)
class TelemetryConfig:
    """`telemetry:` what a run measures about its own cost."""

    enabled: bool = True
    energy: EnergySource = EnergySource.AUTO
    grid_g_per_kwh: float | None = None      # grid carbon intensity for `telemetry/emissions_g`
    mfu: bool = True                         # FLOPs against the device's peak (CPU: a measured GEMM peak)
    system_metrics_s: float | None = 10.0   # MLflow's system metrics every N seconds (null: none)

    def __post_init__(self) -> None:
        from lowprec.base.parse import ConfigError
        if self.system_metrics_s is not None and not self.system_metrics_s > 0:
            raise ConfigError("system_metrics_s", f"expected seconds between samples (> 0, e.g. 10) or null (no "
                                                  f"system metrics), found {self.system_metrics_s!r}")
        if not isinstance(self.energy, EnergySource):
            try:
                object.__setattr__(self, "energy", EnergySource(self.energy))
            except ValueError:
                raise ConfigError("energy", f"expected one of {', '.join(e.value for e in EnergySource)}, "
                                            f"found {self.energy!r}") from None
        g = self.grid_g_per_kwh
        if g is not None and not (isinstance(g, (int, float)) and math.isfinite(g) and g >= 0):
            raise ConfigError("grid_g_per_kwh", f"expected grams of CO2e per kWh (a number >= 0, e.g. 400) or "
                                                f"null (no emissions figure), found {g!r}")


@dataclass
class _Window:
    """One log window: seconds by phase, tokens and productive seconds of its applied passes."""
    phases: dict[Phase, float] = field(default_factory=dict)
    tokens: int = 0
    productive: float = 0.0

    @property
    def seconds(self) -> float:
        return sum(self.phases.values())


@dataclass
class _Pending:
    step: int
    outcome: PassOutcome
    tokens: int
    rewound_to: int | None
    flops: dict[str, float] | None


def _stderr(values: list[float]) -> float | None:
    n = len(values)
    if n < 2:
        return None
    m = sum(values) / n
    return math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1) / n)


class Telemetry:
    """Phase clock + goodput ledger + FLOPs + energy for one run (see the module docstring)."""

    def __init__(self, config: TelemetryConfig, *, device="cpu", model=None, state=None,
                 started: float | None = None, clock: LapClock | None = None):
        """started: `time.perf_counter()` when the run started (default: now); the time until
        `begin()` is start-up. clock: the run's phase clock, when the engine was built with it
        before this (default `clock_for(config, device)`); it counts from `begin()`."""
        import torch
        self.config = config
        self.device = torch.device(device)
        self.model, self.state = model, state
        self.started = time.perf_counter() if started is None else started
        # handed to the session and the engine when they are built; it counts from `begin()`
        self.clock: LapClock = clock if clock is not None else self.clock_for(config, self.device)
        self.ledger = GoodputLedger()
        self.phase_totals: dict[Phase, float] = {p: 0.0 for p in Phase}
        self.windows: list[_Window] = []
        self._pending: list[_Pending] = []
        self._win = _Window()
        self._flops_per_token: dict[str, float] | None = None
        self.meter, self.energy_note = None, "telemetry is off"
        self.peaks = {}
        self._joules_at_window = 0.0
        self._last_reading = None

    @staticmethod
    def clock_for(config: TelemetryConfig, device) -> LapClock:
        """The phase clock a run with `config` laps on (none when telemetry is off)."""
        return lap_clock(device) if config.enabled else NULL_CLOCK

    # ------------------------------------------------------------------ lifecycle
    def begin(self) -> None:
        """Start-up ends here: open the energy meter, measure the peaks, start the clock."""
        if not self.config.enabled:
            return
        self.meter, self.energy_note = open_meter(self.config.energy, self.device)   # OFF: (None, why)
        if self.config.mfu:
            from lowprec.tracking.peaks import device_peaks
            self.peaks = device_peaks(self.device)
        self.formats_changed()
        self.clock.restart()
        self.ledger.add_outside(Bucket.STARTUP, time.perf_counter() - self.started)

    def formats_changed(self) -> None:
        """The precision map changed: GEMM FLOPs per token are counted again."""
        if self.config.enabled and self.config.mfu and self.model is not None and self.state is not None:
            from lowprec.tracking.peaks import gemm_flops_per_token
            self._flops_per_token = gemm_flops_per_token(self.model, self.state)

    def end_pass(self, step: int, outcome: PassOutcome, tokens: int, rewound_to: int | None = None) -> None:
        """One loop pass of `step` ended as `outcome` (booked at the next flush)."""
        if not self.config.enabled:
            return
        self.clock.end_pass()
        flops = None
        if self._flops_per_token is not None and outcome is PassOutcome.APPLIED:
            flops = {f: v * tokens for f, v in self._flops_per_token.items()}
        self._pending.append(_Pending(step, outcome, tokens, rewound_to, flops))

    def _book(self, include_open: bool = False) -> None:
        passes = self.clock.flush(include_open)
        for i, phases in enumerate(passes):
            for p, s in phases.items():
                self.phase_totals[p] += s
                self._win.phases[p] = self._win.phases.get(p, 0.0) + s
            if i < len(self._pending):
                pend = self._pending[i]
                wasted = self.ledger.add_pass(pend.step, phases, pend.outcome, pend.tokens, pend.rewound_to,
                                              pend.flops)
                if pend.outcome is PassOutcome.APPLIED:
                    self._win.tokens += pend.tokens
                    self._win.productive += sum(phases.values()) - wasted
            else:   # the open tail (final eval, tracking): not a step of its own
                for p, s in phases.items():
                    self.ledger.add_outside(ALWAYS_WASTED.get(p, Bucket.OTHER), s)
        self._pending = self._pending[len(passes):]

    def window(self, step: int) -> dict[str, float]:
        """Flush the clock and return the window's metrics (since the previous window)."""
        if not self.config.enabled:
            return {}
        self._book()
        w, self._win = self._win, _Window()
        metrics = {f"time/{p.value}_s": s for p, s in w.phases.items() if s > 0}
        metrics["time/window_s"] = w.seconds
        metrics["time/wasted_s"] = max(w.seconds - w.productive, 0.0)
        if w.seconds > 0:
            metrics["throughput/tokens_per_s"] = w.tokens / w.seconds
        if self.meter is not None:
            r = self._read_energy()
            if r is not None:
                joules, self._joules_at_window = r.joules - self._joules_at_window, r.joules
                metrics["energy/joules"] = joules
                if w.seconds > 0:
                    metrics["energy/watts"] = joules / w.seconds
        if w.seconds > 0:
            self.windows.append(w)
        return metrics

    def _read_energy(self):
        try:
            self._last_reading = self.meter.read()
        except Exception as e:  # noqa: BLE001 - a meter that stops answering ends energy, not the run
            self.energy_note = f"the energy meter failed ({type(e).__name__}: {e}); energy stopped there"
            self.meter = None
        return self._last_reading

    def finish(self) -> dict[str, float]:
        """Book everything still open (the final evaluation) and return the run's numbers."""
        if not self.config.enabled:
            return {}
        self._book(include_open=True)
        if self.peaks:   # a CPU's timed peak again, now that start-up is not competing for it
            from lowprec.tracking.peaks import best_peaks
            self.peaks = best_peaks(self.peaks, self.device)
        if self.meter is not None:
            self._read_energy()
            try:
                self.meter.close()
            except Exception:  # noqa: BLE001
                pass
            self.meter = None
        return self.summary()

    # ------------------------------------------------------------------ results
    def summary(self) -> dict[str, float]:
        led = self.ledger
        wall = led.wall
        tokens = led.trained_tokens
        out: dict[str, float] = {"telemetry/wall_s": wall, "telemetry/goodput": led.goodput,
                                 "telemetry/trained_tokens": float(tokens)}
        if wall > 0:
            out["telemetry/tokens_per_s"] = tokens / wall
        productive = led.buckets[Bucket.PRODUCTIVE]
        if productive > 0:
            out["telemetry/step_tokens_per_s"] = tokens / productive
        # the uncertainty of the run's speed: the spread of the step's own speed over the log
        # windows (evals, checkpoints and rewinds are not noise, they are in the number), as a
        # relative standard error applied to each run number below
        speeds = [w.tokens / w.productive for w in self.windows if w.productive > 0 and w.tokens > 0]
        se = _stderr(speeds)
        rel_se = se / (sum(speeds) / len(speeds)) if se is not None else None
        if rel_se is not None:
            out["telemetry/step_tokens_per_s_stderr"] = out.get("telemetry/step_tokens_per_s", 0.0) * rel_se
            out["telemetry/tokens_per_s_stderr"] = out.get("telemetry/tokens_per_s", 0.0) * rel_se
            out["telemetry/goodput_stderr"] = led.goodput * rel_se
        for b in Bucket:
            out[f"telemetry/bucket/{b.value}_s"] = led.buckets[b]
        for p in Phase:
            out[f"telemetry/phase/{p.value}_s"] = self.phase_totals[p]
        if self._last_reading is not None and tokens > 0:
            j = self._last_reading.joules
            out["telemetry/energy_j"] = j
            out["telemetry/energy_per_token_j"] = j / tokens
            out["telemetry/energy_measured"] = 1.0 if self._last_reading.measured else 0.0
            if rel_se is not None:
                out["telemetry/energy_per_token_j_stderr"] = j / tokens * rel_se
            if self.config.grid_g_per_kwh is not None:
                out["telemetry/emissions_g"] = emissions_grams(j, self.config.grid_g_per_kwh)
        m = self.mfu()
        if m is not None:
            out["telemetry/mfu"] = m
        return out

    def mfu(self) -> float | None:
        """GEMM FLOPs of the surviving steps at each format's peak, over their productive seconds."""
        flops = self.ledger.flops_by_format()
        if not flops or not self.peaks or self.state is None:
            return None
        from lowprec.tracking.peaks import mfu
        productive = self.ledger.buckets[Bucket.PRODUCTIVE]
        return mfu(flops, productive, self.peaks, self.state.backend.name, self.device.type) if productive else None

    def sources(self) -> dict[str, str]:
        """Where the energy and the peaks came from, in words (tags of the run)."""
        out = {"telemetry.energy": (self._last_reading.source if self._last_reading is not None
                                    else self.energy_note)}
        if self._last_reading is not None:
            out["telemetry.energy_kind"] = "measured" if self._last_reading.measured else "estimate"
        if self.peaks:
            same: dict[tuple[float, str], list[str]] = {}
            for k, v in self.peaks.items():
                same.setdefault((v.flops_per_s, v.source), []).append(k.value)
            out["telemetry.peaks"] = "; ".join(f"{'/'.join(ks)}: {f / 1e12:.3g} TFLOP/s ({src})"
                                               for (f, src), ks in same.items())
        return out


