"""What every host reads from its config the same way: `lowprec run` (one process and under
torchrun), `HostedRollout` (the HF and Lightning callbacks), torchtitan's `LowprecTrainer` and
`Session.from_yaml` all call these, so a config behaves alike whichever host runs it.

* `config_file(cfg, value, key)`: a path a config names, relative to the config file's folder
  (then to the working folder, for a config built from a dict or a file named from there);
* `tracking_uri(cfg)`: the store `tracking.uri` names, or `sqlite:///<cwd>/mlflow.db`;
* `read_baseline(cfg)`: the loss curve `rollout.baseline` names: a losses file
  (`config_file`), or an MLflow run's `losses.json` in that store.
"""

from __future__ import annotations

import math
from pathlib import Path

from lowprec.base.parse import ConfigError

__all__ = ["config_folder", "config_file", "tracking_uri", "read_baseline"]


def config_folder(cfg) -> Path | None:
    """The folder of the file `cfg` was read from; None for a config made from a dict."""
    src = getattr(cfg, "source", None)
    return Path(src).resolve().parent if src and src != "<dict>" else None


def config_file(cfg, value: str | Path, key: str) -> Path:
    """The file `value` (a config's `key`) names: absolute as given, else beside the config
    file, else from the working folder; ConfigError naming every place looked at."""
    p = Path(value)
    folder = config_folder(cfg)
    cands = [p] if p.is_absolute() else [q / p for q in (folder, Path.cwd()) if q is not None]
    found = next((c for c in cands if c.is_file()), None)
    if found is None:
        raise ConfigError(key, f"{str(value)!r} not found (looked at {', '.join(map(str, cands))}); give a path "
                          f"relative to the config file's folder, or an absolute one")
    return found


def tracking_uri(cfg) -> str:
    """The tracking store of a config: `tracking.uri`, or the SQLite file mlflow.db in the working folder."""
    uri = getattr(cfg.tracking, "uri", None) if cfg.tracking is not None else None
    return uri or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def read_baseline(cfg) -> dict[int, float] | None:
    """The loss curve `rollout.baseline` names ({step: loss}), or None without one."""
    b = cfg.rollout.baseline if cfg.rollout is not None else None
    if b is None:
        return None
    if b.losses is not None:
        from lowprec.policy.rollout import read_losses
        return read_losses(config_file(cfg, b.losses, "rollout.baseline.losses"))
    from lowprec.config import ConfigRole
    from lowprec.runtime.session.baseline import RUN_HOW, TRAINER_HOW, losses_of_run
    how = TRAINER_HOW if cfg.role is ConfigRole.FRAMEWORK else RUN_HOW   # a Trainer's user has no `lowprec run`
    curve = losses_of_run(tracking_uri(cfg), cfg.tracking.experiment, b.mlflow_run, how)
    return {i: float(v) for i, v in enumerate(curve) if math.isfinite(float(v))}
