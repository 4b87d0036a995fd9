"""Attribution by replay: is precision to blame for an anomalous step, and which sites?

When a step is anomalous (`lowprec.policy.anomaly`), the session replays the same batch from
the same weights, RNG and scaling state with a set of sites in high precision, before
the step is applied. `attribute` decides which sets to replay:

1. every low-precision site in high precision. If the anomaly persists, precision is not
   to blame: nothing is demoted (the step is skipped, or the run rewinds). A replay counts
   as clean only when it clears the as-trained step by the detectors' noise margin (the
   blame rule of `lowprec.policy.anomaly`: under the limit by `blame_margin` standard
   deviations of the detector's window in high precision, or over it by as much as trained);
   a replay under the limit but inside the margin makes the attribution `inconclusive`: the
   suspicion is recorded and nothing is demoted;
2. otherwise precision is to blame: narrow it down, first by stage (newest first: the
   sites a stage promoted together, and the sites that started in low precision), then by
   halving the remaining set in forward order. A half whose replay is clean holds the
   cause; when the first half's replay is not clean, the cause is taken to be in the
   second half, and that inference is confirmed by a replay of its own before anything is
   blamed on it;
3. the sites blamed are the smallest set whose replay was clean (`verified`): a fault that
   needs two sites in high precision at once is blamed on the set that cleared it.

The number of replays per anomaly is bounded (`max_replays`); when the budget runs out
the last verified set is blamed. Every replay is recorded with its evidence (the sites in
high precision, the loss and grad norm it gave, whether it was still anomalous) and
becomes an event. `Megatron-LM`'s rerun state machine re-runs a step to tell transient
from persistent faults; here the replay also finds which sites' precision caused it.

A slow signal (the loss gap to the baseline, an eval checkpoint's regression) has no
anomalous step to replay: `judge_window` asks the same question of a window of steps (see
its docstring). The window's losses as trained are compared with the same steps' losses
with sites in high precision, first on the current weights (a forward per batch: the
cheap first look), then, when that does not decide, by training the window again from
the last snapshot, in high precision and as configured (the control: a fault tied to the
window's steps does not recur in a retrain, whatever its precision; precision is blamed only
for what high precision closes beyond the control, by a margin).

This module is pure logic: `replay(sites) -> Replay` (and the window's `look` and
`retrain`) are the caller's (a `Session` runs the model), so its tests need no model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Sequence

__all__ = ["Replay", "Attribution", "attribute", "WindowLook", "WindowDecision", "WindowDeferred", "WindowAttribution",
           "judge_window"]


@dataclass(frozen=True)
class Replay:
    """One replay of the anomalous step: `high_precision` sites in high precision."""

    high_precision: tuple[str, ...]
    loss: float
    grad_norm: float
    anomalous: bool
    clears: bool = True        # not anomalous, and by the noise margin (lowprec.policy.anomaly's blame rule)
    margins: dict | None = None

    @property
    def clean(self) -> bool:
        return not self.anomalous and self.clears

    def to_evidence(self) -> dict:
        ev = {"high_precision": list(self.high_precision), "loss": self.loss, "grad_norm": self.grad_norm,
              "anomalous": self.anomalous}
        if not self.anomalous:
            ev["clears_margin"] = self.clears
        if self.margins:
            ev["margins"] = self.margins
        return ev


@dataclass(frozen=True)
class Attribution:
    """The outcome: whether precision is to blame, the sites blamed, and every replay."""

    precision_to_blame: bool
    blamed: tuple[str, ...]
    replays: tuple[Replay, ...]
    exhausted: bool = False          # the replay budget ran out before the search ended
    inconclusive: bool = False       # high precision was under the limit, but inside the noise margin

    @property
    def evidence(self) -> dict:
        return {"replays": len(self.replays), "precision_to_blame": self.precision_to_blame,
                "budget_exhausted": self.exhausted, "inconclusive": self.inconclusive,
                "clean_with": [list(r.high_precision) for r in self.replays if r.clean]}


def attribute(candidates: Sequence[str], groups: Sequence[Sequence[str]],
              replay: Callable[[tuple[str, ...]], Replay], max_replays: int) -> Attribution:
    """Search which of `candidates` (the low-precision sites, in forward order) to blame.

    groups: sets of candidates to try before halving (the stages, newest first); sites
    missing from `candidates` are ignored. replay: runs the step with the given sites in
    high precision. max_replays >= 1."""
    if max_replays < 1:
        raise ValueError(f"max_replays must be >= 1, got {max_replays}")
    order = list(dict.fromkeys(candidates))
    done: list[Replay] = []

    def budget() -> bool:
        return len(done) < max_replays

    def clean(sites: Sequence[str]) -> bool:
        r = replay(tuple(sites))
        done.append(r)
        return r.clean

    if not order:
        return Attribution(False, (), ())
    if not clean(order):
        return Attribution(False, (), tuple(done), inconclusive=not done[0].anomalous)
    verified = order
    current = order
    position = {s: i for i, s in enumerate(order)}
    for group in groups:
        g = sorted({s for s in group if s in position}, key=position.__getitem__)
        if not g or len(g) >= len(current) or not budget():
            continue
        if clean(g):
            verified = current = g
            break
    while len(current) > 1 and budget():
        half = len(current) // 2
        first, second = current[:half], current[half:]
        if clean(first):
            verified = current = first
        else:
            current = second          # inferred: confirmed below before it is blamed
    if current is not verified and budget() and clean(current):
        verified = current
    exhausted = len(current) > 1 or current is not verified
    return Attribution(True, tuple(verified), tuple(done), exhausted and not budget())


# ---------------------------------------------------------------------------- slow signals
NARROW = 0.5   # a narrowed-down set must close this fraction of what every candidate closed
class WindowDecision(str, Enum):
    """What decided a window's judgment."""

    FIRST_LOOK = "first_look"        # the current weights, as configured against high precision
    CONTROL = "control_window"       # the window trained again as configured closed the gap too
    WINDOW_REPLAY = "window_replay"  # the window trained again with sites in high precision

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class WindowLook:
    """The window's tail losses with `high_precision` sites in high precision: on the current
    weights (`retrained` False: the first look) or after training the window again."""

    high_precision: tuple[str, ...]
    losses: tuple[float, ...]
    closed: float          # the fraction of the window's loss gap to the baseline it closes
    retrained: bool

    def to_evidence(self) -> dict:
        return {"high_precision": list(self.high_precision), "losses": list(self.losses), "closed": self.closed,
                "retrained": self.retrained}


@dataclass(frozen=True)
class WindowDeferred:
    """No window can be judged yet: every snapshot it could start from is older than the
    check at `changed_at` that last changed a format, so a window from it would replay steps
    that trained in other formats (after a demotion: before the fault and the fix alike, where
    any set of sites in high precision seems to close the gap). The signal is judged at a
    later check, once a snapshot after the change exists."""

    snapshot: int          # the newest snapshot the window could start from
    changed_at: int


@dataclass(frozen=True)
class WindowAttribution:
    """Whether precision is to blame for a slow signal over the window `steps` (first, last),
    the sites blamed, the window's losses as trained and the baseline's over its tail, every
    look, and what it cost (`seconds`, steps trained again, forwards of the first looks)."""

    precision_to_blame: bool
    blamed: tuple[str, ...]
    steps: tuple[int, int]
    tail: tuple[int, ...]                  # the steps whose losses are compared
    configured: tuple[float, ...]          # the tail's losses as trained
    baseline: tuple[float, ...]            # the baseline's at those steps
    looks: tuple[WindowLook, ...]
    decided_by: "WindowDecision"
    seconds: float = 0.0
    retrained_steps: int = 0
    forwards: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "decided_by", WindowDecision(self.decided_by))

    @property
    def windows(self) -> int:
        return sum(1 for x in self.looks if x.retrained)

    @property
    def evidence(self) -> dict:
        return {"precision_to_blame": self.precision_to_blame, "decided_by": self.decided_by.value,
                "window": list(self.steps), "tail_steps": list(self.tail), "losses_as_trained": list(self.configured),
                "losses_baseline": list(self.baseline), "looks": [x.to_evidence() for x in self.looks],
                "window_replays": self.windows, "retrained_steps": self.retrained_steps,
                "first_look_forwards": self.forwards, "seconds": round(self.seconds, 3)}


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def judge_window(candidates: Sequence[str], groups: Sequence[Sequence[str]], *,
                 configured: Sequence[float], baseline: Sequence[float],
                 look: Callable[[tuple[str, ...]], Sequence[float]],
                 retrain: Callable[[tuple[str, ...]], Sequence[float]],
                 close: float, max_looks: int, max_windows: int,
                 steps: tuple[int, int] = (0, 0), tail: Sequence[int] = ()) -> WindowAttribution:
    """Is precision to blame for a loss gap over a window of steps, and which sites?

    configured / baseline: the window tail's losses as trained and the baseline's at the
    same steps; their mean difference is the gap G (G <= 0: the losses show no gap, and
    nothing can close it: precision is not blamed).
    look(sites): the tail's losses on the current weights with `sites` in high precision
    (`()`: as configured); retrain(sites): the tail's losses after training the window
    again from its start with `sites` in high precision.

    A set of sites *closes the gap* when putting it in high precision lowers the tail's mean
    loss by at least `close` x G. The first look compares the current weights as configured
    with every candidate in high precision: when that closes the gap, the fault is in the
    numerics of the forward now (a scale, a saturation) and the first look alone decides,
    narrowed down (by `attribute`, at most `max_looks` looks) on the current weights. When
    it does not, the weights may have been damaged during the window (gradients flushed to
    zero look the same both ways on the weights they left), so the window is trained again
    with every candidate in high precision. When that does not close the gap, precision is
    not to blame. When it does, the same window is trained again as configured (the
    control): a fault tied to the window's steps (a bad batch, a corrupted input) does not
    recur in a retrain, so a retrain closes the gap whatever its precision, and a fault the
    retrain meets earlier than the run did (the optimizer partly makes up for it) is partly
    closed by the control too. Precision is to blame only for what high precision closes
    beyond the control: every candidate in high precision must close at least `close` x G
    measured from the control's losses, whatever the control closed (the margin); the groups
    (stages, newest first), then halving, narrow it down, at most `max_windows` windows in
    high precision (the control is one more). While narrowing down (first look or window), a set is clean only when it also
    closes at least NARROW (half) of what every candidate closed: with a gap of 1-2%,
    retraining noise and the share of the gap another stage's coarser format causes (NVFP4
    against the BF16 baseline) close 30% on their own."""
    j = _Judgment(configured, baseline, steps, tail)
    cands = list(dict.fromkeys(candidates))
    looks = j.looks
    if not cands:
        return j.done(False, (), WindowDecision.FIRST_LOOK)
    as_is = list(look(()))
    j.forwards += len(as_is)
    reference = _mean(as_is)
    looks.append(WindowLook((), tuple(as_is), 0.0, False))

    def needed(done: list[WindowLook]) -> float:
        """What a set must close to be clean: `close` for every candidate at once; to narrow
        down, also half of what every candidate closed (the set that holds the cause closes
        about as much; any other closes retraining noise and its own format's small share)."""
        return close if not done else max(close, NARROW * done[0].closed)

    def first(sites: tuple[str, ...]) -> Replay:
        losses = list(look(sites))
        j.forwards += len(losses)
        c = j.closed_by(losses, reference)
        need = needed(looks[1:])
        looks.append(WindowLook(sites, tuple(losses), c, False))
        return Replay(sites, _mean(losses), c, c < need)

    found = attribute(cands, groups, first, max_looks)
    if found.precision_to_blame:
        return j.done(True, found.blamed, WindowDecision.FIRST_LOOK)
    return _judge_by_retraining(j, cands, groups, retrain, close, max_windows)


class _Judgment:
    """One `judge_window` call's running record: the gap, every look so far, what they cost."""

    def __init__(self, configured: Sequence[float], baseline: Sequence[float], steps: tuple[int, int],
                 tail: Sequence[int]):
        import time
        self.clock, self.t0 = time.perf_counter, time.perf_counter()
        self.configured, self.baseline, self.steps, self.tail = configured, baseline, steps, tail
        self.gap = _mean(configured) - _mean(baseline)
        self.looks: list[WindowLook] = []
        self.retrained = 0
        self.forwards = 0

    def closed_by(self, losses: Sequence[float], reference: float) -> float:
        if not self.gap > 0 or not losses:
            return 0.0
        v = (reference - _mean(losses)) / self.gap
        return v if math.isfinite(v) else 0.0

    def done(self, blame: bool, blamed: Sequence[str], by: WindowDecision) -> WindowAttribution:
        steps = self.steps
        return WindowAttribution(blame, tuple(blamed), steps, tuple(self.tail), tuple(self.configured),
                                 tuple(self.baseline), tuple(self.looks), by, self.clock() - self.t0,
                                 self.retrained * (steps[1] - steps[0] + 1), self.forwards)


def _judge_by_retraining(j: _Judgment, cands: list[str], groups: Sequence[Sequence[str]],
                         retrain: Callable[[tuple[str, ...]], Sequence[float]], close: float,
                         max_windows: int) -> WindowAttribution:
    """`judge_window` after a first look that did not close the gap: the window trained again
    with every candidate in high precision, the control, then narrowing down by windows."""
    configured, closed_by, done = j.configured, j.closed_by, j.done

    def retrained(sites: tuple[str, ...], reference: float) -> WindowLook:
        losses = list(retrain(sites))
        j.retrained += 1
        j.looks.append(WindowLook(sites, tuple(losses), closed_by(losses, reference), True))
        return j.looks[-1]

    every = retrained(tuple(cands), _mean(configured))
    if every.closed < close:
        return done(False, (), WindowDecision.WINDOW_REPLAY)
    # the control: the same window trained again as configured. Whatever of the gap it closes
    # did not recur in a retrain (a bad batch, a step-tied fault, or a fault the retrain met
    # earlier than the run did, so the optimizer partly made up for it): precision is blamed
    # only for what high precision closes beyond it, by `close` x G at least
    control = retrained((), _mean(configured))
    reference = _mean(control.losses)
    every_closed = closed_by(every.losses, reference)
    if every_closed < close:
        return done(False, (), WindowDecision.CONTROL)

    def window(sites: tuple[str, ...]) -> Replay:
        if sites == every.high_precision:      # trained already: measured against the control
            return Replay(sites, _mean(every.losses), every_closed, False)
        look = retrained(sites, reference)
        need = max(close, NARROW * every_closed)
        return Replay(sites, _mean(look.losses), look.closed, look.closed < need)

    found = attribute(cands, groups, window, max_windows)
    return done(found.precision_to_blame, found.blamed, WindowDecision.WINDOW_REPLAY)
