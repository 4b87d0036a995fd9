"""The baseline run a report draws beside the candidate, read from MLflow.

The baseline is the run `lowprec report RUN --baseline REF` names, else the loss-gap baseline
the run recorded: its logged parameter `rollout.baseline.mlflow_run` (`lowprec run` logs the
whole config). REF is a run id, or a run name: the newest FINISHED run of that name in the
candidate's experiment, as `lowprec run` finds its loss-gap baseline.

Of the baseline run, `baseline_curves` reads the series the pictures draw beside the
candidate's: `train/loss`, the eval results with their stderr and intervals (`eval/...`),
`train/lr_sensitivity` and the `signal/<site>/...` series the candidate's pictures show;
`ReportData.baseline_metrics` holds them and `ReportData.baseline_name` says which run it
is. A baseline that cannot be found is an error when it was asked for by `--baseline`, and
a note (no baseline drawn) when only the run's parameter names it. The tracker's own report
at the end of a run reads the same (`add_recorded_baseline`, within a few seconds).
"""

from __future__ import annotations

import logging
from typing import Callable

from lowprec.tracking.report_scales import as_inf
from lowprec.tracking.records import LR_SENSITIVITY
from lowprec.tracking.report_sources import ReportData

__all__ = ["BASELINE_PARAM", "find_run", "baseline_curves", "add_baseline", "add_recorded_baseline",
           "BaselineNotFound"]

log = logging.getLogger("lowprec.tracking")
BASELINE_PARAM = "rollout.baseline.mlflow_run"
Series = list[tuple[int, float]]


class BaselineNotFound(ValueError):
    """No run of that id or name (the message says where it looked)."""


def find_run(client, ref: str, experiment_id: str):
    """The run with id `ref`, else the newest FINISHED run named `ref` in `experiment_id`."""
    from mlflow.exceptions import MlflowException
    try:
        return client.get_run(ref)
    except MlflowException:
        pass
    name = ref.replace("'", "\\'")
    runs = client.search_runs([experiment_id], filter_string=f"attributes.run_name = '{name}' and "
                              f"attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"],
                              max_results=1)
    if not runs:
        raise BaselineNotFound(f"no baseline run {ref!r}: no run has that id, and no FINISHED run of that name is in "
                               f"the candidate's experiment; pass --baseline with a run id or the name of a finished run")
    return runs[0]


def baseline_curves(client, run, wanted: Callable[[str], bool]) -> dict[str, Series]:
    """{key: [(step, value)] by step} of the metrics of `run` that `wanted(key)` keeps (a step
    logged twice, after a rewind, keeps its later value)."""
    out: dict[str, Series] = {}
    for key in run.data.metrics:
        if wanted(key):
            hist = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.timestamp)
            out[key] = sorted({m.step: as_inf(m.value) for m in hist}.items())   # MLflow's +-1.797e308: +-inf
    return out


def add_baseline(data: ReportData, client, ref: str, experiment_id: str, sites: set[str] | None = None, *,
                 asked: bool = False) -> None:
    """The baseline run `ref`'s curves into `data`: `baseline_name`, `baseline_metrics` (its
    loss, evals, LR sensitivity and the signals of `sites`), and its `train/loss` as the loss
    baseline when it was `asked` for or the run logged no `train/baseline_loss`. A run that is
    not there raises BaselineNotFound when `asked`, else becomes a note in `data.notes`."""
    try:
        base = find_run(client, ref, experiment_id)
    except BaselineNotFound as e:
        if asked:
            raise
        data.notes.append(f"the loss-gap baseline the run recorded ({BASELINE_PARAM}) is not drawn: {e}")
        return
    sites = set(sites or ())

    def wanted(k: str) -> bool:
        if k.startswith("signal/"):
            return k[len("signal/"):].rsplit("/", 2)[0] in sites
        return k in ("train/loss", LR_SENSITIVITY) or k.startswith(("eval/", "eval_mode/eval"))
    data.baseline_name = base.info.run_name or base.info.run_id
    data.baseline_metrics = baseline_curves(client, base, wanted)
    if asked or not data.baseline:
        data.baseline = data.baseline_metrics.get("train/loss", [])


def add_recorded_baseline(data: ReportData, tracking_uri: str, experiment: str, config: dict,
                          timeout: float = 10.0) -> None:
    """At the end of a run (the tracker's report): the curves of the loss-gap baseline `config`
    names (`rollout.baseline.mlflow_run`) into `data`, read within `timeout` s; a store that does
    not answer, or no such run, leaves the pictures without them (said in the log)."""
    ref = ((config.get("rollout") or {}).get("baseline") or {}).get("mlflow_run")
    if not ref:
        return
    from lowprec.tracking.deadline import Deadline
    from lowprec.tracking.report_sources import fallback_sites

    def read():
        from mlflow.tracking import MlflowClient
        client = MlflowClient(tracking_uri)
        exp = client.get_experiment_by_name(experiment)
        if exp is not None:
            add_baseline(data, client, str(ref), exp.experiment_id, set(fallback_sites(data.events)))
    try:
        Deadline(timeout, f"the tracking store {tracking_uri}").run("reading the baseline run", read)
    except Exception as e:  # noqa: BLE001 - the pictures are drawn without the baseline's curves
        log.warning("lowprec tracking: the report pictures are drawn without the baseline run %r (%s: %s)",
                    ref, type(e).__name__, e)
    for note in data.notes:
        log.warning("lowprec tracking: %s", note)


def read_run(client, run_id: str, baseline_run: str | None = None) -> ReportData:
    """A run read through an MlflowClient, with its baseline run beside it: `baseline_run` (an
    id or a name), else the loss-gap baseline the run recorded (its params)."""
    from lowprec.tracking.report_sources import fallback_sites, from_mlflow
    data = from_mlflow(client, run_id)
    run = client.get_run(run_id)
    ref = baseline_run or run.data.params.get(BASELINE_PARAM)
    if ref and ref != "None":
        add_baseline(data, client, ref, run.info.experiment_id, set(fallback_sites(data.events)),
                     asked=bool(baseline_run))
    return data
