"""Judging a slow signal by its window: the session's half of `lowprec.policy.attribution.judge_window`.

A loss gap to the baseline, or an eval checkpoint's regression, has no single anomalous
step to replay. `WindowReplayer` keeps, for every step since the oldest in-memory snapshot,
what it takes to run that step again: the caller's closure (the step's forward and backward
on its batch), the forward alone when the caller gives one, the learning rates the step
used, its loss as measured and whether the optimizer applied it. When the controller asks
(`judge`), the window is the steps since the newest snapshot at least `min_length` steps
old, and its tail (the second half) is where losses are compared with the baseline:

* the first look: the current weights' loss on the tail's batches as configured and with
  sites in high precision (a forward each, no gradient when the caller gave a forward);
* a window replay: the snapshot is loaded, and every step of the window is trained again
  on the same batches with the same learning rates (an LR error is replayed too), skipped
  steps skipped again, with sites in high precision; the tail's losses come back.

Afterwards everything is put back as it was (model, optimizer, scheduler, RNG, the
delayed-scaling histories and generators, the pending gradients of the check step), so a
judged step goes on exactly as an unjudged one. Quantizer statistics are off meanwhile, so
the replays never mix into the monitor's window. Only in-memory snapshots can start a
window (`rewind.source: memory`, the default); with disk checkpoints nothing is judged and
the controller falls back to rolling the newest stage back.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from lowprec.policy.attribution import WindowAttribution, WindowDeferred, judge_window

__all__ = ["WindowReplayer"]


@dataclass
class _Entry:
    closure: Callable[[], torch.Tensor] | None
    forward: Callable[[], torch.Tensor] | None
    lrs: list[float]
    loss: float
    applied: bool = False


class WindowReplayer:
    """The steps since the oldest snapshot, and the judge of a window of them (module docstring)."""

    def __init__(self, model, optimizer, state, controller, snapshots, *, clip: Callable[[], torch.Tensor],
                 measure: Callable[[torch.Tensor, torch.Tensor], tuple[float, float]], close: float,
                 max_windows: int, max_looks: int, min_length: int):
        """The parts it replays with, all the session's: `controller` (its loss gap and when the
        formats last changed), `snapshots` (where a window starts), `clip` (the global grad norm
        after clipping) and `measure(loss, grad_norm)` (both on the host, combined over ranks)."""
        self.model, self.optimizer, self.state = model, optimizer, state
        self.controller, self.snapshots, self.clip, self.measure = controller, snapshots, clip, measure
        self.close = close
        self.max_windows, self.max_looks, self.min_length = max_windows, max(1, max_looks), max(2, min_length)
        self.entries: dict[int, _Entry] = {}
        self.judged: list[WindowAttribution] = []   # every judgment so far (its cost is in it)

    # ------------------------------------------------------------------ the record
    def record(self, step: int, closure, forward, loss: float) -> None:
        lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        self.entries[step] = _Entry(closure, forward, lrs, float(loss))

    def concluded(self, step: int, applied: bool) -> None:
        if step in self.entries:
            self.entries[step].applied = applied
        kept = getattr(self.snapshots, "steps", None)
        if kept:
            self.entries = {k: e for k, e in self.entries.items() if k >= kept[0]}

    def rewound(self, back: int) -> None:
        """The steps from `back` on were undone."""
        self.entries = {k: e for k, e in self.entries.items() if k < back}

    def clear(self) -> None:
        self.entries = {}

    # ------------------------------------------------------------------ the judge
    def judge(self, step: int, candidates: list[str], groups: list[list[str]]
              ) -> WindowAttribution | WindowDeferred | None:
        """The controller's judge (`RolloutController.judge`); None when no window can be replayed,
        WindowDeferred when none can be yet (no snapshot since the formats last changed)."""
        s = self
        ctl, snaps = self.controller, self.snapshots
        if ctl is None or ctl.loss_gap is None or not hasattr(snaps, "latest"):
            return None
        last = max((k for k in self.entries if k <= step), default=None)
        if last is None:
            return None
        start = snaps.latest(last + 1 - self.min_length)
        if start is None:
            return None
        if start.step <= ctl.formats_changed_at:   # the window would replay other formats' steps
            return WindowDeferred(start.step, ctl.formats_changed_at)
        steps = list(range(start.step, last + 1))
        if any(k not in self.entries or self.entries[k].closure is None for k in steps):
            return None
        tail = steps[len(steps) // 2:]
        baseline = [ctl.loss_gap._baseline_at(k) for k in tail]
        if any(b is None for b in baseline):
            return None
        now = snaps.capture(last)
        scaling = s.state.scaling_state()
        params = [p for p in s.model.parameters()]
        grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
        was_training = s.model.training
        with s.state.collecting_stats(False):
            try:
                att = judge_window(candidates, groups, configured=[self.entries[k].loss for k in tail],
                                   baseline=baseline, look=lambda sites: self._look(tail, sites),
                                   retrain=lambda sites: self._retrain(start, steps, last, tail, sites),
                                   close=self.close, max_looks=self.max_looks, max_windows=self.max_windows,
                                   steps=(steps[0], last), tail=tail)
            finally:
                snaps.load(now)
                s.state.load_scaling_state(scaling)
                for p, g in zip(params, grads):
                    p.grad = g
                s.model.train(was_training)
        self.judged.append(att)
        return att

    def _high(self, sites: tuple[str, ...]):
        local = [x for x in sites if x in self.state.sites]
        return self.state.high_precision(local) if local else contextlib.nullcontext()

    def _loss(self, loss: torch.Tensor) -> float:
        """The loss on the host, averaged over data-parallel ranks as the session measures it."""
        return self.measure(loss, torch.zeros((), device=loss.device))[0]

    def _look(self, tail: list[int], sites: tuple[str, ...]) -> list[float]:
        out = []
        opt = self.optimizer
        with self._high(sites):
            for k in tail:
                e = self.entries[k]
                if e.forward is not None:
                    with torch.no_grad():
                        out.append(self._loss(e.forward()))
                else:
                    out.append(self._loss(e.closure()))
                    opt.zero_grad(set_to_none=True)
        return out

    def _retrain(self, start, steps: list[int], last: int, tail: list[int], sites: tuple[str, ...]) -> list[float]:
        s = self
        s.snapshots.load(start)
        out = []
        with self._high(sites):
            for k in steps:
                e = self.entries[k]
                for g, lr in zip(s.optimizer.param_groups, e.lrs):
                    g["lr"] = lr
                s.optimizer.zero_grad(set_to_none=True)
                loss = e.closure()
                norm = s.clip()
                if k in tail:
                    out.append(s.measure(loss, norm)[0])
                if e.applied and k < last:
                    s.optimizer.step()
        s.optimizer.zero_grad(set_to_none=True)
        return out
