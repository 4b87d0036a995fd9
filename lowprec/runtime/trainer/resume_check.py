"""Whether a config can continue the run a folder holds (`lowprec run CONFIG --out DIR --resume`).

A new run writes the config it trains (after --steps, --run-name and --as-baseline) to
`DIR/config.yaml`. A resume compares its own config with that copy before anything is
loaded and before an MLflow run is touched: the checkpoints hold the model, optimizer and
data position the original config made, and the MLflow run holds its params, so a resume
with another `model.args.d_model` or `train.seed` would fail half-way (a shape that does
not fit) or, worse, go on training another run under the first one's name. The first key
that differs is named with both values, with the two commands that work: the original
config, or a new --out.

Keys that may change on a resume: `train.steps` (train a stopped run further) and
`train.log_every`, and the `tracking` and `telemetry` sections (where and what is
recorded, not what is trained). The model the config builds is then always checked against
the checkpoint the resume continues from: a parameter whose shape differs from the model's
is named (`lowprec.state.checkpoint.checkpoint_mismatch`), also where the saved config
matches (a model factory whose code changed), before an MLflow run is touched.

`train.steps` on a resume (`--steps N`): N is where the resumed run stops. N below the
checkpoint's step is refused (nothing would be trained, and the run's recorded steps would
be undone); N equal to it trains nothing more (the final eval only). MLflow params cannot
change, so the run keeps the param `train.steps` it started with, and the tag `train.steps`
holds the steps it is trained to (set by every run, changed by a resume); the resume's line
says so (`resume_line`).

A `--resume` of a run that finished but was killed before its last records reached MLflow
sends them, as `lowprec sync` would, and trains nothing (`send_finished`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

__all__ = ["CONFIG_COPY", "MAY_CHANGE", "STEPS_TAG", "record_config", "resume_mismatch", "started_steps",
           "resume_line", "logged_config", "send_finished"]

EXIT_OK, EXIT_UNUSABLE = 0, 2   # `lowprec run`'s (lowprec.runtime.trainer.run)
STEPS_TAG = "train.steps"   # the MLflow tag: the steps a run is trained to (the param: those it started with)

CONFIG_COPY = "config.yaml"
MAY_CHANGE = ("train.steps", "train.log_every", "tracking", "telemetry")


def record_config(folder: Path, cfg) -> Path:
    """Write the config a new run trains to `folder/config.yaml` (atomically)."""
    from lowprec.state.durable import write_text_atomically
    path = folder / CONFIG_COPY
    write_text_atomically(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return path


def _flatten(v: Any, key: str, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(v, dict) and v:
        for k, x in v.items():
            _flatten(x, f"{key}.{k}" if key else str(k), out)
    elif isinstance(v, (list, tuple)) and v:
        for i, x in enumerate(v):
            _flatten(x, f"{key}.{i}" if key else str(i), out)
    else:
        out[key] = list(v) if isinstance(v, tuple) else v
    return out


def _may_change(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in MAY_CHANGE)


def _differences(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
    a, b = _flatten(old, "", {}), _flatten(new, "", {})
    missing = object()
    keys = list(a) + [k for k in b if k not in a]
    return [(k, a.get(k, missing), b.get(k, missing)) for k in keys
            if not _may_change(k) and a.get(k, missing) != b.get(k, missing)]


def _shown(v: Any) -> str:
    return "(absent)" if type(v) is object else repr(v)


def _world(saved: dict) -> int:
    """The number of processes a saved config's `parallel:` section trains on (1 without one)."""
    from lowprec.base.parse import parse
    from lowprec.config import ParallelConfig
    return parse(ParallelConfig, saved.get("parallel") or {}, "parallel").world


def resume_mismatch(folder: Path, cfg, config_path: str, model=None, checkpoint: Path | None = None) -> str | None:
    """The one line refusing to resume the run in `folder` with `cfg` (read from
    `config_path`), or None when it fits. model: the model `cfg` builds, checked against the
    shapes of `checkpoint` (default: the newest usable one, found without a warning). The
    commands it suggests for a job carry its `--nproc-per-node`."""
    from lowprec.runtime.trainer.run_folder import run_command
    folder = Path(folder)
    copy = folder / CONFIG_COPY
    new_out = run_command(config_path, "NEW_DIR", nproc=cfg.parallel.world if cfg is not None else 1)
    if copy.is_file():
        old = yaml.safe_load(copy.read_text()) or {}
        diffs = _differences(old, cfg.to_dict())
        if diffs:
            key, was, now = diffs[0]
            more = f" (and {len(diffs) - 1} more keys)" if len(diffs) > 1 else ""
            why = "a resume continues a run with the config it started with"
            if key.startswith("parallel."):   # the checkpoints hold each rank's shards, data position and RNG
                why = ("a resume keeps the parallel layout: its checkpoints hold each rank's shards, data position "
                       "and RNG for that layout")
            return (f"--resume: {key} is {_shown(now)} in {config_path} but {_shown(was)} in the run {folder} "
                    f"holds{more}; {why}. Resume with that config "
                    f"({run_command(copy, folder, nproc=_world(old), resume=True)}), or train this config as a "
                    f"new run ({new_out})")
    if model is None:
        return None
    from lowprec.state.checkpoint import checkpoint_mismatch
    last = checkpoint if checkpoint is not None else _newest_quietly(folder)
    why = checkpoint_mismatch(last, model) if last is not None else None
    if why is None:
        return None
    return (f"--resume: {why}: {config_path} builds another model than the run {folder} holds; resume with the "
            f"config that run started with, or train this config as a new run ({new_out})")


def _newest_quietly(folder: Path) -> Path | None:
    """The newest usable checkpoint, without the warnings the resume itself gives."""
    import warnings
    from lowprec.state.checkpoint import latest_checkpoint
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return latest_checkpoint(folder / "checkpoints") if (folder / "checkpoints").is_dir() else None


def started_steps(folder: Path) -> int | None:
    """`train.steps` of the config the run in `folder` started with (None without a config copy)."""
    copy = Path(folder) / CONFIG_COPY
    if not copy.is_file():
        return None
    steps = ((yaml.safe_load(copy.read_text()) or {}).get("train") or {}).get("steps")
    return steps if isinstance(steps, int) else None


def resume_line(folder: Path, cfg, checkpoint: Path, step: int) -> tuple[str | None, str]:
    """(the line refusing `cfg.train.steps` for a resume at `step`, or None; the line the
    resume says: the checkpoint and step it continues from, the steps it trains to)."""
    steps = cfg.train.steps
    if steps < step:
        return (f"--resume: train.steps is {steps}, below step {step}, where the run {folder} continues "
                f"({checkpoint.name}); a resume trains from its checkpoint's step up to train.steps: give "
                f"--steps {step} or more"), ""
    line = f"--resume: continuing from {checkpoint} at step {step} of {steps}"
    if steps == step:
        line += " (nothing left to train: the final eval only)"
    was = started_steps(folder)
    if was is not None and was != steps:
        line += (f"; train.steps is {steps}, the run started with {was}: MLflow keeps the param "
                 f"train.steps={was}, the tag {STEPS_TAG} says {steps}")
    return None, line


def logged_config(cfg, folder: Path, resume) -> dict:
    """The config as MLflow params: on a resume with other `train.steps`, the value the run
    started with (a param cannot change; the tag `train.steps` holds the new one)."""
    logged = cfg.to_dict()
    was = started_steps(folder) if resume else None
    if was is not None and isinstance(logged.get("train"), dict):
        logged["train"] = {**logged["train"], "steps": was}
    return logged


def send_finished(out: Path, console) -> int | None:
    """`--resume` of a run that finished but was killed before its last records reached MLflow
    (its end among them: the MLflow run still says RUNNING): send them, as `lowprec sync` would,
    and exit 0 (2 when the server does not take them); None when there is nothing to send."""
    from lowprec.base.writer_lock import WriterBusyError
    from lowprec.tracking.outbox import Outbox, sync_run_dir
    from lowprec.tracking.resume import RunState, buffered_run
    buf = out / "tracking"
    state, info = buffered_run(buf)
    if state is not RunState.FINISHED or Outbox(buf).n_pending() == 0:
        return None
    try:
        res = sync_run_dir(buf, timeout=60)
    except WriterBusyError as e:   # a `lowprec sync` of this folder is sending right now
        console.say(f"--resume: {out} holds a finished run; {e}: it sends the last records, nothing to resume")
        return EXIT_UNUSABLE
    run_id = Outbox(buf).read_info().get("run_id")
    if res.pending:
        console.say(f"--resume: {out} holds a finished run whose last {res.pending} records were not sent "
                    f"({res.error}); send them with `lowprec sync {buf}`")
        return EXIT_UNUSABLE
    if run_id:
        (out / "run_id").write_text(run_id + "\n")
    console.print(f"lowprec run: {out} holds a run that had finished (MLflow run {run_id}); its last records were "
                  f"sent now, nothing was trained")
    return EXIT_OK
