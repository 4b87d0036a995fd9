"""What the rollout controller decides: the action for a step, the stages it promotes, its
parameters, and how a decision is carried out on a `PrecisionState`.

`Action` (continue / skip the step / rewind) and `Decision` (the action, the format changes
and the events that explain them, where a rewind goes) are what `Session` acts on;
`ControllerConfig` holds the rules' parameters (`lowprec.policy.rollout.RolloutConfig` builds it
from the `rollout:` section); `apply_decision` switches the changed sites' formats. The
rules themselves are `lowprec.policy.controller.RolloutController`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lowprec.policy.detectors import Thresholds
from lowprec.policy.events import Event
from lowprec.base.enums import StrEnum

__all__ = ["Action", "Stage", "ControllerConfig", "Decision", "apply_decision"]


class Action(StrEnum):
    """What the training loop does with this step: step the optimizer, skip it (zero the
    gradients), or restore the last good state and skip `Decision.skip_batches` batches."""

    CONTINUE = "continue"
    SKIP_STEP = "skip_step"
    REWIND = "rewind"


@dataclass(frozen=True)
class Stage:
    """A named set of sites promoted together to `format` (a format name)."""

    name: str
    sites: tuple[str, ...]
    format: str


@dataclass(frozen=True)
class ControllerConfig:
    """The rules' parameters: stability before a promotion, cooldown, quarantine, rewind, and
    the thresholds and detector presets (`lowprec.policy.detectors.Thresholds`)."""

    min_steps: int = 100
    cooldown_steps: int = 200
    quarantine_after: int = 2
    rewind: bool = False
    rewind_skip_batches: int = 0
    persist_steps: int = 2       # anomalous steps in a row (not precision's) before a rewind
    accept_after: int = 8        # ... before a level is accepted (fewer: a burst, each step skipped)
    not_precision_rewind: bool = False   # a loss gap precision did not cause: rewind (with `rewind`), else go on
    thresholds: Thresholds = field(default_factory=Thresholds)
    lr_hold_rise: float | None = None    # rise of the LR sensitivity that holds a promotion; None: off
    lr_hold_above: float | None = None   # LR sensitivity above which a promotion is held; None: off

    def __post_init__(self) -> None:
        if self.persist_steps < 1:
            raise ValueError(f"persist_steps must be >= 1, got {self.persist_steps}")
        if self.accept_after < 2:
            raise ValueError(f"accept_after must be >= 2, got {self.accept_after}")
        for name in ("min_steps", "cooldown_steps", "rewind_skip_batches"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.quarantine_after < 1:
            raise ValueError(f"quarantine_after must be >= 1, got {self.quarantine_after}")


@dataclass
class Decision:
    action: Action = Action.CONTINUE
    changes: dict[str, str] = field(default_factory=dict)   # site -> new format
    events: list[Event] = field(default_factory=list)
    skip_batches: int = 0
    rewind_before: int | None = None   # a rewind goes to a state of at most this step (None: two checks back)

    @property
    def rewind(self) -> bool:
        return self.action == Action.REWIND


def apply_decision(state, decision: Decision) -> list[str]:
    """Carry a decision's format changes out on a PrecisionState; returns the changed FQNs."""
    changed = []
    by_format: dict[str, list[str]] = {}
    for site, fmt in decision.changes.items():
        by_format.setdefault(fmt, []).append(site)
    for fmt, sites in by_format.items():
        changed += state.set_format(sites, fmt)
    return changed
