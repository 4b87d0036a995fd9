"""The loss curve, the evals (and the telemetry) of a baseline run stored in MLflow (`rollout.baseline.mlflow_run`).

`lowprec run` logs every run's per-step losses as the artifact `losses.json`; a later
run names the baseline by run id, or by run name (the newest FINISHED run of that name
in the config's experiment). Its eval checkpoints (`eval/<task>/<metric>` at each step,
`eval_mode/eval` for their mode) are what a run's own checkpoints are compared with at the
same step (`BaselineEvals`, read once, at the first checkpoint that asks). MLflow is imported
here, when a baseline is read.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

from lowprec.base.parse import ConfigError
from lowprec.base.quiet import quiet_artifact_downloads

__all__ = ["losses_of_run", "telemetry_of_run", "BaselineEvals", "baseline_evals", "LOSSES_ARTIFACT", "RUN_HOW",
           "TRAINER_HOW"]

LOSSES_ARTIFACT = "losses.json"
_WHERE = "rollout.baseline.mlflow_run"


RUN_HOW = "e.g. `lowprec run CONFIG --as-baseline --run-name {ref}`"
# a framework's user trains with their trainer, not `lowprec run`
TRAINER_HOW = ("with your trainer: the same training with lowprec's callback, every layer in bf16 (no stages) and "
               "tracking on, under the run name {ref} (tracking.run_name, or the trainer's run name); at its end "
               "the callback logs the losses.json a baseline needs")


def _find_run(client, experiment: str, ref: str, how: str = RUN_HOW):
    from mlflow.exceptions import MlflowException
    try:
        return client.get_run(ref)
    except MlflowException:
        pass
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise ConfigError(_WHERE, f"no run {ref!r}: the store has no experiment {experiment!r} (tracking.experiment); "
                          f"train the baseline first, {how.format(ref=ref)}")
    runs = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{ref}' and "
                              f"attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"],
                              max_results=1)
    if not runs:
        raise ConfigError(_WHERE, f"no FINISHED run with id or name {ref!r} in experiment {experiment!r}; train the "
                          f"baseline first, {how.format(ref=ref)}")
    return runs[0]


def _ask_store(read, tracking_uri: str, experiment: str, ref: str, how: str = RUN_HOW):
    """`read(tracking_uri, experiment, ref)` within the tracking deadline; a SQLite store that
    is not there is a ConfigError (asking MLflow would create an empty one)."""
    if tracking_uri.startswith("sqlite:///"):
        db = Path(tracking_uri[len("sqlite:///"):])
        if not db.is_file():
            raise ConfigError(_WHERE, f"no run {ref!r}: there is no tracking store at {db} (tracking.uri); train "
                              f"the baseline first, {how.format(ref=ref)}")
    from lowprec.tracking.deadline import DEFAULT_TIMEOUT_S, Deadline, NoAnswer
    deadline = Deadline(DEFAULT_TIMEOUT_S, f"the tracking store {tracking_uri}")
    try:
        return deadline.run(f"reading the baseline run {ref!r}", read, tracking_uri, experiment, ref, how)
    except NoAnswer as e:
        raise ConfigError(_WHERE, str(e)) from None


def losses_of_run(tracking_uri: str, experiment: str, ref: str, how: str = RUN_HOW) -> list[float]:
    """The baseline run's losses; `how`: how to make that baseline, said when it is missing
    (`RUN_HOW` for `lowprec run`, `TRAINER_HOW` under a framework's trainer)."""
    return _ask_store(_read, tracking_uri, experiment, ref, how)


def _read(tracking_uri: str, experiment: str, ref: str, how: str = RUN_HOW) -> list[float]:
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri)
    run = _find_run(client, experiment, ref, how)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with quiet_artifact_downloads():
                local = client.download_artifacts(run.info.run_id, LOSSES_ARTIFACT, tmp)
        except Exception as e:  # noqa: BLE001 - MLflow raises several kinds for a missing artifact
            raise ConfigError(_WHERE, f"run {run.info.run_id} has no {LOSSES_ARTIFACT} artifact ({type(e).__name__}); "
                              f"name a run that `lowprec run` trained") from None
        return json.loads(Path(local).read_text())


def telemetry_of_run(tracking_uri: str, experiment: str, ref: str) -> dict[str, float]:
    """The baseline run's `telemetry/*` numbers (for the summary's comparison); raises
    ConfigError when the run cannot be read, and gives {} for a run logged without them."""
    return _ask_store(_read_telemetry, tracking_uri, experiment, ref)


def _read_telemetry(tracking_uri: str, experiment: str, ref: str, how: str = RUN_HOW) -> dict[str, float]:
    from mlflow.tracking import MlflowClient
    run = _find_run(MlflowClient(tracking_uri), experiment, ref)
    return {k: float(v) for k, v in run.data.metrics.items() if k.startswith("telemetry/")}


class BaselineEvals:
    """`(step, mode) -> {task: {metric: value}}` of the baseline run's evals (None where it has
    none at that step and mode). Read from the store at the first call; a store or run that
    cannot be read then gives None for every step (`problem` says why), since a training run
    must not stop for it: the baseline's losses were already read at the start."""

    def __init__(self, tracking_uri: str, experiment: str, ref: str):
        self.where = (tracking_uri, experiment, ref)
        self.by_step: dict[tuple[int, str | None], dict[str, dict[str, float]]] | None = None
        self.problem: str | None = None

    def __call__(self, step: int, mode: str) -> dict[str, dict[str, float]] | None:
        if self.by_step is None:
            try:
                self.by_step = _ask_store(_read_evals, *self.where)
            except ConfigError as e:
                self.by_step, self.problem = {}, e.message
        found = self.by_step.get((int(step), mode))
        return found if found is not None else self.by_step.get((int(step), None))   # logged without a mode


def _read_evals(tracking_uri: str, experiment: str, ref: str, how: str = RUN_HOW) -> dict:
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri)
    run = _find_run(client, experiment, ref)
    rid = run.info.run_id
    modes = {m.step: ("full" if m.value >= 0.5 else "fast")
             for m in client.get_metric_history(rid, "eval_mode/eval")} if "eval_mode/eval" in run.data.metrics else {}
    out: dict[tuple[int, str | None], dict[str, dict[str, float]]] = {}
    for key in run.data.metrics:
        parts = key.split("/")
        if len(parts) != 3 or parts[0] != "eval" or parts[2].endswith("_stderr"):
            continue
        for m in client.get_metric_history(rid, key):
            value = math.copysign(math.inf, m.value) if abs(m.value) == sys.float_info.max else m.value
            out.setdefault((m.step, modes.get(m.step)), {}).setdefault(parts[1], {})[parts[2]] = value
    return out


def baseline_evals(cfg) -> BaselineEvals | None:
    """The evals of the baseline run a config's `rollout.baseline.mlflow_run` names (None: no
    such baseline; a losses file holds no evals)."""
    b = cfg.rollout.baseline if cfg.rollout is not None else None
    if b is None or b.mlflow_run is None or cfg.tracking is None:
        return None
    uri = cfg.tracking.uri or f"sqlite:///{Path.cwd() / 'mlflow.db'}"
    return BaselineEvals(uri, cfg.tracking.experiment, b.mlflow_run)
