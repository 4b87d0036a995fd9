"""Where a rewind goes back to: bounded in-memory snapshots, or the run's disk checkpoints.

A rewind restores the model, the optimizer, the learning-rate scheduler, the RNG states
and the data position of an earlier step, and leaves the precision map and the
controller's memory of what went wrong as they are now (so the run does not walk into
the same fault again). Two sources share one small interface (`Snapshots`):

* `MemorySnapshots`: every `every` steps a copy of this rank's state is kept in memory
  (at most `keep` of them, oldest dropped first), on the parameters' device or on the
  CPU. Under tensor or pipeline parallelism each rank keeps its own shards and stage, so
  nothing is gathered and no checkpoint folder is needed.
* `DiskSnapshots`: the run's checkpoints (`lowprec.state.checkpoint`), written at the
  loop's checkpoint cadence; a rewind loads the newest one old enough that matches its
  checksums (a corrupt one is skipped with a warning naming it).

`restore(step, skip_batches, before)` picks the newest snapshot at least `margin` steps
before `step` (a fault a check noticed began up to two checks earlier), or at most at
`before` (a fault detected per step, whose first anomalous step is known), restores it, skips the
batches the decision asks for past the current data position, and returns the step to
continue from; None when there is no such snapshot.
"""

from __future__ import annotations

import copy
import warnings
from collections import deque
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from lowprec.state.checkpoint import CorruptCheckpointError, list_checkpoints, load_checkpoint
from lowprec.state.rng import restore_rng_state, rng_state

__all__ = ["Snapshots", "MemorySnapshots", "DiskSnapshots"]


class Snapshots(Protocol):
    def after_step(self, step: int) -> None:
        """Called with the number of completed steps; keeps a snapshot when one is due."""

    def restore(self, step: int, skip_batches: int, before: int | None = None) -> int | None:
        """Go back to the newest snapshot old enough for a fault seen at `step` (at most
        `step - margin`, or at most `before` when the decision knows where the fault began)."""


def _copy_tensors(obj, device: torch.device | None):
    """A deep copy in which every tensor is a fresh clone (optionally moved to `device`)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if device is not None and not hasattr(t, "to_local"):
            return t.to(device, copy=True)
        return t.clone()
    if isinstance(obj, dict):
        return type(obj)((k, _copy_tensors(v, device)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copy_tensors(v, device) for v in obj)
    return copy.deepcopy(obj)


class _Snapshot:
    __slots__ = ("step", "model", "optimizer", "scheduler", "data", "rng")

    def __init__(self, step, model, optimizer, scheduler, data, rng):
        self.step, self.model, self.optimizer = step, model, optimizer
        self.scheduler, self.data, self.rng = scheduler, data, rng


class MemorySnapshots:
    """Every `every` steps a copy of model, optimizer, scheduler, data position and RNG."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, every: int, keep: int = 2,
                 margin: int = 0, scheduler=None, data=None, to_cpu: bool = False):
        if every < 1 or keep < 1:
            raise ValueError(f"snapshots need every >= 1 and keep >= 1, got every={every}, keep={keep}")
        self.model, self.optimizer, self.scheduler, self.data = model, optimizer, scheduler, data
        self.every, self.keep, self.margin = every, keep, margin
        self.device = torch.device("cpu") if to_cpu else None
        self.kept: deque[_Snapshot] = deque(maxlen=keep)

    @property
    def steps(self) -> list[int]:
        return [s.step for s in self.kept]

    def nbytes(self) -> int:
        """Memory the kept snapshots hold in tensors (model and optimizer state)."""
        def size(o) -> int:
            if isinstance(o, torch.Tensor):
                t = o.to_local() if hasattr(o, "to_local") else o
                return t.numel() * t.element_size()
            if isinstance(o, dict):
                return sum(size(v) for v in o.values())
            if isinstance(o, (list, tuple)):
                return sum(size(v) for v in o)
            return 0
        return sum(size(s.model) + size(s.optimizer) for s in self.kept)

    def capture(self, step: int, device: torch.device | None = None) -> _Snapshot:
        """A copy of the state now (after `step` completed steps), kept by the caller."""
        return _Snapshot(
            step, _copy_tensors(self.model.state_dict(), device),
            _copy_tensors(self.optimizer.state_dict(), device),
            copy.deepcopy(self.scheduler.state_dict()) if self.scheduler is not None else None,
            copy.deepcopy(self.data.state_dict()) if self.data is not None else None,
            rng_state())

    def load(self, snap: _Snapshot) -> None:
        """Put model, optimizer, scheduler and RNG back as `snap` has them (the data stays:
        it never goes back); the snapshots kept are not touched."""
        self.model.load_state_dict(snap.model)   # copies into the live parameters
        self.optimizer.load_state_dict(_copy_tensors(snap.optimizer, None))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(copy.deepcopy(snap.scheduler))
        restore_rng_state(snap.rng)

    def latest(self, at_most: int) -> _Snapshot | None:
        """The newest kept snapshot of at most `at_most` completed steps (a window replay's start)."""
        good = [s for s in self.kept if s.step <= at_most]
        return good[-1] if good else None

    def take(self, step: int) -> None:
        """Keep a snapshot of the state after `step` completed steps (replaces one at that step)."""
        while self.kept and self.kept[-1].step >= step:
            self.kept.pop()   # a rewind went back before it: the newer ones are abandoned
        self.kept.append(self.capture(step, self.device))

    def after_step(self, step: int) -> None:
        if step % self.every == 0:
            self.take(step)

    def restore(self, step: int, skip_batches: int, before: int | None = None) -> int | None:
        limit = step - self.margin if before is None else before
        good = [s for s in self.kept if s.step <= limit]
        if not good:
            return None
        snap = good[-1]
        while self.kept[-1] is not snap:
            self.kept.pop()
        self.load(snap)
        if self.data is not None:
            # the data does not go back: the batches between the snapshot and now are
            # skipped, and `skip_batches` more after them
            if hasattr(self.data, "skip"):
                self.data.skip(skip_batches)
        return snap.step


class DiskSnapshots:
    """Rewinds through the run's checkpoint folder (written by the loop at its cadence)."""

    def __init__(self, directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 margin: int = 0, scheduler=None, data=None):
        self.directory = Path(directory)
        self.model, self.optimizer, self.scheduler, self.data = model, optimizer, scheduler, data
        self.margin = margin

    def after_step(self, step: int) -> None:
        """The loop writes the checkpoints (they are also what --resume reads)."""

    def restore(self, step: int, skip_batches: int, before: int | None = None) -> int | None:
        limit = step - self.margin if before is None else before
        for back, path in reversed([(s, p) for s, p in list_checkpoints(self.directory) if s <= limit]):
            try:   # verified before anything changes: a corrupt one is skipped for the next older
                info = load_checkpoint(path, model=self.model, optimizer=self.optimizer, restore_rng=True,
                                       keep_current=("precision", "controller"))
                break
            except CorruptCheckpointError as e:
                warnings.warn(f"rewind: skipping checkpoint {path}: {e}", stacklevel=2)
        else:
            return None
        extra = info.get("extra") or {}
        if self.scheduler is not None and extra.get("scheduler") is not None:
            self.scheduler.load_state_dict(extra["scheduler"])
        if self.data is not None and hasattr(self.data, "skip"):
            self.data.skip(skip_batches)   # as MemorySnapshots: the data goes on, it does not go back
        return back
