"""Where a training step's time goes: phases, lap clocks, and the goodput ledger.

A step is cut into phases by laps: `clock.lap(Phase.DATA)` gives the time since the
previous lap to the data wait, `clock.lap(Phase.FORWARD)` the time since then to the
forward, and so on. The laps of a step therefore add up to its wall time exactly, and a
lap costs one clock read (`time.perf_counter` on CPUs, a recorded CUDA event on GPUs,
resolved later: `CudaLapClock.flush` synchronises on the newest event only when it is
asked, at log steps, which already read the loss on the host).

    clock = lap_clock(device)
    clock.lap(Phase.DATA) ... clock.lap(Phase.OPTIMIZER); clock.end_pass()
    passes = clock.flush()         # [{Phase: seconds}] of each pass ended since the last flush

The `GoodputLedger` sorts the seconds of each loop pass into buckets by what became of the
pass: productive (the step was applied and stayed), skipped (the optimizer never saw it),
redone (a rewind undid it later, or it rewound), plus time that is wasted whatever the
outcome (recovery: replays and restores; evaluations, the pre-promotion gate's included;
checkpoints, the LR probe, tracking) and start-up. Goodput is productive time over wall
time; the phases of all passes and the start-up add up to the wall time.

Older runs logged `replay` and `restore` as phases of their own (`LEGACY_PHASES`: the report
draws them as they were) and booked restores as `redone`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from enum import Enum
from typing import Protocol

__all__ = ["Phase", "Bucket", "LapClock", "CpuLapClock", "CudaLapClock", "NullClock", "NULL_CLOCK", "lap_clock", "counted_as",
           "GoodputLedger", "PassOutcome", "ALWAYS_WASTED", "LEGACY_PHASES"]


class Phase(str, Enum):
    """What a slice of a step's wall time was spent on (MLflow: `time/<value>_s`)."""

    DATA = "data"                  # waiting for the next batch
    FORWARD = "forward"
    BACKWARD = "backward"          # with the gradient all-reduce that overlaps it under DDP
    OPTIMIZER = "optimizer"        # clipping, optimizer and scheduler step, zeroing gradients
    COLLECTIVE = "collective"      # lowprec's own collectives outside backward (loss, grad norm)
    MONITOR = "monitor"            # quantizer statistics and the rules on check steps
    RECOVERY = "recovery"          # replays (forward+backward again: is precision to blame?) and
                                   # going back to a snapshot (a rewind)
    LR_PROBE = "lr_probe"
    CHECKPOINT = "checkpoint"      # checkpoint writes and in-memory rewind snapshots
    EVAL = "eval"                  # every evaluation: periodic, the gate's before a promotion, final
    TRACKING = "tracking"
    OTHER = "other"


class Bucket(str, Enum):
    """What the run's wall time bought (MLflow: `telemetry/bucket/<value>_s`)."""

    PRODUCTIVE = "productive"      # passes whose step was applied and survived
    STARTUP = "startup"            # before the first step
    REDONE = "redone"              # passes a rewind undid, the rewinding pass
    SKIPPED = "skipped"            # passes whose optimizer step was skipped
    RECOVERY = "recovery"          # replays and restores (the RECOVERY phase)
    EVAL = "eval"
    CHECKPOINT = "checkpoint"
    LR_PROBE = "lr_probe"
    TRACKING = "tracking"
    OTHER = "other"


# phases that are wasted whatever became of the pass they fell in, and where they go
ALWAYS_WASTED: dict[Phase, Bucket] = {Phase.RECOVERY: Bucket.RECOVERY, Phase.EVAL: Bucket.EVAL, Phase.CHECKPOINT: Bucket.CHECKPOINT,
                                      Phase.LR_PROBE: Bucket.LR_PROBE, Phase.TRACKING: Bucket.TRACKING}


# phases older runs logged (`time/<phase>_s`), now booked as RECOVERY
LEGACY_PHASES = ("replay", "restore")


class LapClock(Protocol):
    def lap(self, phase: Phase) -> None: ...

    def end_pass(self) -> None: ...

    def flush(self, include_open: bool = False) -> list[dict[Phase, float]]: ...

    def restart(self) -> None: ...


class NullClock:
    """A clock that measures nothing (telemetry off): laps cost one method call. Stateless
    (setting `override` does nothing), so one instance, NULL_CLOCK, serves everywhere."""

    @property
    def override(self) -> Phase | None:
        return None

    @override.setter
    def override(self, phase: Phase | None) -> None:
        pass

    def lap(self, phase: Phase) -> None:
        pass

    def end_pass(self) -> None:
        pass

    def flush(self, include_open: bool = False) -> list[dict[Phase, float]]:
        return []

    def restart(self) -> None:
        pass


class CpuLapClock:
    """Laps on the host's monotonic clock, grouped by loop pass (`end_pass`). While
    `override` is set every lap counts as that phase (a replay's forward and backward are
    recovery time, not forward and backward)."""

    def __init__(self) -> None:
        self.override: Phase | None = None
        self.restart()

    def restart(self) -> None:
        """Forget every lap so far: time is counted from now (the run's set-up is over)."""
        self._last = time.perf_counter()
        self._open: dict[Phase, float] = {}
        self._closed: list[dict[Phase, float]] = []

    def lap(self, phase: Phase) -> None:
        now = time.perf_counter()
        phase = self.override or phase
        self._open[phase] = self._open.get(phase, 0.0) + (now - self._last)
        self._last = now

    def end_pass(self) -> None:
        self._closed.append(self._open)
        self._open = {}

    def flush(self, include_open: bool = False) -> list[dict[Phase, float]]:
        """The phases of every pass ended since the last flush (and the open one's so far)."""
        if include_open:
            self.end_pass()
        out, self._closed = self._closed, []
        return out


class CudaLapClock:
    """Laps as CUDA events on the current stream: the GPU timeline between two laps is what
    the phase cost the device (a host-side wait shows as GPU idle time; work the host only
    queued is charged where the GPU ran it). Events are read only in `flush`."""

    def __init__(self, device) -> None:
        import torch
        self._torch = torch
        self.device = torch.device(device)
        self.override: Phase | None = None
        self.restart()

    def restart(self) -> None:
        """Forget every lap so far: time is counted from now (the run's set-up is over)."""
        self._last = self._event()
        self._open: list[tuple[Phase, object]] = []
        self._closed: list[list[tuple[Phase, object]]] = []

    def _event(self):
        e = self._torch.cuda.Event(enable_timing=True)
        e.record(self._torch.cuda.current_stream(self.device))
        return e

    def lap(self, phase: Phase) -> None:
        self._open.append((self.override or phase, self._event()))

    def end_pass(self) -> None:
        self._closed.append(self._open)
        self._open = []

    def flush(self, include_open: bool = False) -> list[dict[Phase, float]]:
        if include_open:
            self.end_pass()
        passes, self._closed = self._closed, []
        newest = next((p[-1][1] for p in reversed(passes) if p), None)
        if newest is None:
            return [{} for _ in passes]
        newest.synchronize()   # at a log step, right after the host read the loss: little to wait for
        out = []
        prev = self._last
        for laps in passes:
            d: dict[Phase, float] = {}
            for phase, ev in laps:
                d[phase] = d.get(phase, 0.0) + prev.elapsed_time(ev) / 1e3
                prev = ev
            out.append(d)
        self._last = prev
        return out


def lap_clock(device) -> LapClock:
    """CUDA events for a CUDA device, the monotonic clock otherwise."""
    import torch
    dev = torch.device(device)
    return CudaLapClock(dev) if dev.type == "cuda" else CpuLapClock()


NULL_CLOCK = NullClock()   # stateless: one instance serves every untimed loop


@contextmanager
def counted_as(clock: LapClock, phase: Phase):
    """Everything inside is `phase` time, laps included (a replay's forward and backward are
    recovery time); the block ends with a lap of `phase`. Lap what came before the block first:
    the time since the previous lap is counted as `phase` too."""
    clock.override = phase
    try:
        yield
    finally:
        clock.override = None
    clock.lap(phase)


class PassOutcome(str, Enum):
    APPLIED = "applied"
    SKIPPED = "skipped"
    REWOUND = "rewound"   # this pass decided a rewind


class GoodputLedger:
    """Buckets of wall time by what became of each loop pass (see the module docstring), and
    the work (tokens, GEMM FLOPs per format) of the steps that survived."""

    def __init__(self) -> None:
        self.buckets: dict[Bucket, float] = {b: 0.0 for b in Bucket}
        self._kept: dict[int, tuple[float, int, dict[str, float]]] = {}   # step -> (seconds, tokens, flops)

    def add_outside(self, bucket: Bucket, seconds: float) -> None:
        """Time outside any step's pass (start-up, the final evaluation)."""
        self.buckets[bucket] += seconds

    def add_pass(self, step: int, phases: dict[Phase, float], outcome: PassOutcome, tokens: int = 0,
                 rewound_to: int | None = None, flops: dict[str, float] | None = None) -> float:
        """Book one pass of `step`; returns its wasted seconds. A rewind to `rewound_to`
        moves the work of the surviving passes of steps rewound_to..step-1 to REDONE."""
        wasted = rest = 0.0
        for phase, s in phases.items():
            if phase in ALWAYS_WASTED:
                self.buckets[ALWAYS_WASTED[phase]] += s
                wasted += s
            else:
                rest += s
        if outcome is PassOutcome.APPLIED:
            self.buckets[Bucket.PRODUCTIVE] += rest
            self._kept[step] = (rest, tokens, dict(flops or {}))
        else:
            self.buckets[Bucket.SKIPPED if outcome is PassOutcome.SKIPPED else Bucket.REDONE] += rest
            wasted += rest
        if outcome is PassOutcome.REWOUND and rewound_to is not None:
            wasted += self.undo(rewound_to, step)
        return wasted

    def undo(self, first: int, stop: int) -> float:
        """Steps first..stop-1 were undone: their productive seconds become REDONE."""
        moved = sum(self._kept.pop(s)[0] for s in [s for s in self._kept if first <= s < stop])
        self.buckets[Bucket.PRODUCTIVE] -= moved
        self.buckets[Bucket.REDONE] += moved
        return moved

    @property
    def trained_tokens(self) -> int:
        return sum(t for _, t, _ in self._kept.values())

    def flops_by_format(self) -> dict[str, float]:
        """GEMM FLOPs of the surviving steps, by the format each ran in."""
        out: dict[str, float] = {}
        for _, _, flops in self._kept.values():
            for f, v in flops.items():
                out[f] = out.get(f, 0.0) + v
        return out

    @property
    def wall(self) -> float:
        return sum(self.buckets.values())

    @property
    def goodput(self) -> float:
        w = self.wall
        return self.buckets[Bucket.PRODUCTIVE] / w if w > 0 else 0.0
