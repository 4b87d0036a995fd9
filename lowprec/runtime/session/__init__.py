"""The rollout every host drives: `Session` (decide, skip, replay, rewind) and its parts, the
window's judgment, step replays, snapshots, the LR probe, `AfterStep` (what every host does
after an optimizer step), eval checkpoints, the precision map a run reports, the run's life
(`RunLife`: its tracker, its evals' wiring, its end) and what every host reads from its config
(`host`). `lowprec run`, `HostedRollout` (HF, Lightning) and torchtitan's trainer all build on it.

Part of the runtime layer: it may import what lowprec.runtime may import (its
`__init__` says)."""
