"""`SessionSettings`: what a `lowprec.runtime.session.session.Session` takes from the config, typed
and frozen. `SessionSettings.from_rollout(rollout)` reads a parsed `rollout:` section (None:
the defaults, for a session without a rollout); a host overrides single fields by keyword
(`from_rollout(rollout, max_grad_norm=...)`, the framework's own clip norm)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from lowprec.policy.monitor import MonitorConfig

__all__ = ["SessionSettings"]


@dataclass(frozen=True)
class SessionSettings:
    """monitor: when the signals are read (the rollout's `monitor_config()`).
    max_grad_norm: the default clip's norm (None: measure, do not clip).
    snapshot_every / snapshot_keep: the default in-memory snapshots' cadence and count.
    max_replays: replays per anomalous step to find whether precision is to blame (0: none;
        anomalies then wait for the next check's statistics).
    window_close: a slow signal (the loss gap, an eval regression) is judged by the window
        since the last snapshot (`lowprec.runtime.session.window`): the fraction of its loss gap that
        high precision must close to blame precision; None: not judged (the newest stage
        rolls back). window_replays: windows trained again per suspicion, at most.
    lr_probe: the rollout's `lr_probe` section (None or disabled: no probe from the config)."""

    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    max_grad_norm: float | None = 1.0
    snapshot_every: int = 20
    snapshot_keep: int = 2
    max_replays: int = 8
    window_close: float | None = 0.3
    window_replays: int = 3
    lr_probe: object = None

    @classmethod
    def from_rollout(cls, rollout, **overrides) -> "SessionSettings":
        """The settings a parsed `rollout:` section gives (None: the defaults), then `overrides`."""
        if rollout is None:
            return cls(**overrides)
        a = rollout.attribution
        base = cls(monitor=rollout.monitor_config(), snapshot_every=rollout.rewind.snapshot_every,
                   snapshot_keep=rollout.rewind.keep, max_replays=a.max_replays if a.replay else 0,
                   window_close=a.window_close if a.window else None, window_replays=a.window_replays,
                   lr_probe=rollout.lr_probe)
        return dataclasses.replace(base, **overrides)
