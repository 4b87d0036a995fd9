"""The config `lowprec profile` writes: the input config with the profiled `precision:` and `rollout:`.

Everything else (model, data, train, eval, tracking, telemetry) is the input's, as written
there (comments aside); `tracking.run_name` gets a `-profiled` suffix so that its MLflow run
is not mistaken for the hand-written plan's. Paths the input gives relative to its own folder
(`eval.gates`, `rollout.baseline.losses`) are rewritten relative to the new file's folder.
`check_written` runs the checks `lowprec plan` runs, except reading the loss-gap baseline.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import yaml

from lowprec.base.yaml_read import read_yaml_file
from lowprec.state.durable import write_text_atomically
from lowprec.profile.planner import SiteChoice, StagePlan, plan_sections

__all__ = ["write_config", "check_written"]


def _moved(value: str, src_dir: Path, dest_dir: Path) -> str:
    p = Path(value)
    if p.is_absolute() or not (src_dir / p).exists() or src_dir.resolve() == dest_dir.resolve():
        return value
    return os.path.relpath((src_dir / p).resolve(), dest_dir.resolve())


def write_config(source: str | Path, dest: str | Path, choices: dict[str, SiteChoice], stages: Sequence[StagePlan],
                 order: Sequence[str], header: Sequence[str] = ()) -> str:
    """Write the profiled config to `dest` (atomically); returns its text."""
    source, dest = Path(source), Path(dest)
    raw = read_yaml_file(source)
    sections = plan_sections(raw.get("precision") or {}, raw.get("rollout"), choices, stages, order)
    out = dict(raw)
    out.update(sections)
    if out["rollout"] is None:   # no stage: the written config has no rollout
        del out["rollout"]
    tracking = dict(out.get("tracking") or {})
    base = tracking.get("run_name") or source.stem
    tracking["run_name"] = f"{base}-profiled"
    out["tracking"] = tracking
    src_dir, dest_dir = source.parent, dest.parent
    if isinstance(out.get("eval"), dict) and isinstance(out["eval"].get("gates"), str):
        out["eval"] = {**out["eval"], "gates": _moved(out["eval"]["gates"], src_dir, dest_dir)}
    b = (out.get("rollout") or {}).get("baseline")
    if isinstance(b, dict) and isinstance(b.get("losses"), str):
        out["rollout"]["baseline"] = {**b, "losses": _moved(b["losses"], src_dir, dest_dir)}
    text = "".join(f"# {line}\n" for line in header)
    text += yaml.safe_dump(out, sort_keys=False, default_flow_style=None, width=110)
    dest.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(dest, text)
    return text


def check_written(path: str | Path) -> None:
    """Parse the written config and build its plan and controller against a fresh model, as
    `lowprec plan` does (the loss-gap baseline is not read); raises ConfigError."""
    from lowprec.config import LowprecConfig
    from lowprec.policy.rollout import build_controller
    from lowprec.runtime.trainer.run import prepare_run
    cfg = LowprecConfig.from_yaml(path)
    prepared = prepare_run(replace(cfg, rollout=None, eval=None), controller=False, with_data=False)
    if cfg.rollout is not None:   # the stages and ladders; the loss gap's baseline is read by `run`
        rollout = replace(cfg.rollout, thresholds=replace(cfg.rollout.thresholds, loss_gap=None))
        build_controller(rollout, prepared.state, prepared.model)
