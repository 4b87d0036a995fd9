"""Read a run's eval results from MLflow into `lowprec.gates.scores.Scores` (what `lowprec gate` compares).

    scores = load_scores("sqlite:////abs/mlflow.db", run_id, metrics=spec.metrics)   # last eval step
    scores = load_scores("http://127.0.0.1:5000", run_id, metrics=spec.metrics, step=300)

Values and stderrs are the run's metrics (`eval/<task>/<metric>` and `..._stderr`, as
`lowprec.tracking.tracker.Tracker.log_eval` logs them) at one step: the given one, or by default the
last step at which every requested metric has a value (metrics evaluated at different steps are
never mixed). Per-example scores come from the artifact that `log_eval(..., samples=...)` wrote
for that step, `evals/<prefix>_step<NNNNNN>.json`; a run without it is compared by stderr.

Every problem is a `GateInputError` that says what was asked and what exists: a tracking store
that does not answer (a SQLite file that is not there is reported, never created), a run id
that is not in the store (with the most recent runs listed; a unique run *name* is accepted
too), a metric the run never logged (with a did-you-mean and the metrics under that prefix), a
step at which a metric has no value. `check_comparable` refuses two runs whose evals are not
of one kind: a run that did not finish (MLflow status not FINISHED), evals of different modes
(`eval_mode/<prefix>`: a fast in-loop eval against a full final one), unless --step names the
step, or of different suites (the artifact's `suite`, else the `eval.suite` param) or document
limits (the `eval.limit` param: a capped eval scores other examples, and its aggregate another
sample); each
run's final evals are compared by default, at whatever step each run ended. A named step must
be one both runs evaluated (`check_named_step`), and a refusal suggests only a step both have.
MLflow is imported by the functions, not by this module.
"""

from __future__ import annotations

import json
import math
import re
import sys
import tempfile
from pathlib import Path
from typing import Iterable

from lowprec.base.quiet import quiet_artifact_downloads
from lowprec.gates.errors import GateInputError
from lowprec.gates.scores import STDERR_SUFFIX, MetricScores, Scores, missing_metric_message
from lowprec.tracking.outbox import server_answers
from lowprec.tracking.records import RunStatus, eval_artifact_name

__all__ = ["open_client", "resolve_run", "resolve_runs", "load_scores", "recent_runs", "check_comparable",
           "check_named_step", "common_steps"]

RUN_ID = re.compile(r"[0-9a-f]{32}")
MODE_METRIC = "eval_mode/"   # + prefix: 1 full, 0 fast at the eval's step (Tracker.log_eval(mode=...))
SUITE_PARAM = "eval.suite"   # the config's eval.suite, as `lowprec run` logs it
LIMIT_PARAM = "eval.limit"   # the config's eval.limit (documents per task); absent in a run that set none


def open_client(tracking_uri: str, timeout: float = 5.0):
    """An MlflowClient for `tracking_uri`, after checking the store is there and answers."""
    if tracking_uri.startswith("sqlite:///") and not tracking_uri.endswith(":memory:"):
        db = Path(tracking_uri[len("sqlite:///"):])
        if not db.is_file():
            raise GateInputError(f"the tracking store {tracking_uri} does not exist ({db} is not a file); pass "
                                 f"--tracking-uri with the store the runs were logged to, e.g. "
                                 f"sqlite:///{Path.cwd() / 'mlflow.db'} or http://HOST:PORT")
    elif tracking_uri.startswith(("http://", "https://")):
        if not server_answers(tracking_uri, timeout):
            raise GateInputError(f"the tracking server {tracking_uri} does not answer ({tracking_uri.rstrip('/')}"
                                 f"/health gave no reply in {timeout:g} s); start it or pass another --tracking-uri")
    from mlflow.tracking import MlflowClient
    try:
        client = MlflowClient(tracking_uri)
        client.search_experiments(max_results=1)
    except Exception as e:  # noqa: BLE001 - any failure to reach the store is the same problem for the user
        raise GateInputError(f"cannot read the tracking store {tracking_uri}: {type(e).__name__}: "
                             f"{str(e)[:500]}") from None
    return client


def recent_runs(client, n: int = 5) -> list[tuple[str, str, str]]:
    """The `n` most recently started runs of the store: (run id, run name, experiment name)."""
    exps = {e.experiment_id: e.name for e in client.search_experiments()}
    if not exps:
        return []
    runs = client.search_runs(list(exps), order_by=["attributes.start_time DESC"], max_results=n)
    return [(r.info.run_id, r.info.run_name or "", exps.get(r.info.experiment_id, "")) for r in runs]


def _listing(client) -> str:
    runs = recent_runs(client)
    if not runs:
        return "The store holds no runs at all"
    return "Most recent runs: " + "; ".join(f"{rid} ({name or 'unnamed'}, experiment {exp})" for rid, name, exp in runs)


def resolve_run(client, tracking_uri: str, ref: str):
    """The run `ref` names: a run id, or else the name of exactly one run in the store."""
    from mlflow.exceptions import MlflowException
    if RUN_ID.fullmatch(ref):
        try:
            return client.get_run(ref)
        except MlflowException:
            pass
    if "'" not in ref:
        exps = [e.experiment_id for e in client.search_experiments()]
        found = client.search_runs(exps, filter_string=f"attributes.run_name = '{ref}'",
                                   order_by=["attributes.start_time DESC"], max_results=10) if exps else []
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            ids = ", ".join(r.info.run_id for r in found)
            raise GateInputError(f"{len(found)} runs in {tracking_uri} are named {ref!r} ({ids}); pass a run id")
    raise GateInputError(f"no run with id {ref!r} in {tracking_uri} (nor a run of that name). {_listing(client)}. "
                         f"Pass a run id from this store, or the --tracking-uri the run was logged to.")


def resolve_runs(client, tracking_uri: str, refs: list[str]) -> list[str]:
    """Run ids for `--baseline REF [REF ...]`: each REF a run id or a run name. One REF that is a
    name several runs carry means all of them that FINISHED (a seed-aware baseline: at least 2);
    a name among several REFs must be unique."""
    from mlflow.exceptions import MlflowException
    if len(refs) == 1 and not RUN_ID.fullmatch(refs[0]) and "'" not in refs[0]:
        exps = [e.experiment_id for e in client.search_experiments()]
        found = client.search_runs(exps, filter_string=f"attributes.run_name = '{refs[0]}'",
                                   order_by=["attributes.start_time DESC"], max_results=1000) if exps else []
        if len(found) > 1:
            done = [r.info.run_id for r in found if r.info.status == RunStatus.FINISHED]
            if len(done) < 2:
                raise GateInputError(f"{len(found)} runs in {tracking_uri} are named {refs[0]!r} but "
                                     f"{len(done)} of them finished ({', '.join(r.info.run_id for r in found)}); "
                                     f"a seed-aware baseline needs at least 2 finished runs: pass run ids, or "
                                     f"finish the runs")
            return done
    ids = []
    for ref in refs:
        try:
            ids.append(resolve_run(client, tracking_uri, ref).info.run_id)
        except MlflowException as e:  # pragma: no cover - resolve_run turns these into GateInputError
            raise GateInputError(str(e)) from None
    if len(set(ids)) != len(ids):
        raise GateInputError(f"--baseline names the same run twice ({', '.join(refs)}); each baseline must be a "
                             f"different run (e.g. the same config at different seeds)")
    return ids


# MLflow's SQL stores keep +-inf as +-the largest float (mlflow/store/tracking/sqlalchemy_store.py,
# `sanitize_metric_value`); read back, that is the inf that was logged (a diverged model's perplexity)
_STORED_INF = sys.float_info.max


def _history(client, run_id: str, key: str) -> dict[int, float]:
    """{step: value} of a metric; of several points at one step, the last recorded (+-inf as logged)."""
    out: dict[int, tuple[int, float]] = {}
    for m in client.get_metric_history(run_id, key):
        if m.step not in out or m.timestamp >= out[m.step][0]:
            out[m.step] = (m.timestamp, m.value)
    return {s: math.copysign(math.inf, v) if abs(v) == _STORED_INF else v for s, (_, v) in out.items()}


def _pick_step(histories: dict[str, dict[int, float]], step: int | None, source: str) -> int:
    if step is not None:
        for k, h in histories.items():
            if step not in h:
                raise GateInputError(f"{source} has no value of {k!r} at step {step}; it has values at steps "
                                     f"{_steps(h)}. Pass one of those with --step, or leave --step out for the "
                                     f"last step at which every gated metric was evaluated.")
        return step
    common = set.intersection(*(set(h) for h in histories.values()))
    if not common:
        per = "; ".join(f"{k}: {_steps(h)}" for k, h in histories.items())
        raise GateInputError(f"{source}: the gated metrics were never evaluated at the same step ({per}); "
                             f"gate metrics that are evaluated together, or pass --step")
    return max(common)


def _steps(h: dict[int, float]) -> str:
    s = sorted(h)
    return ", ".join(map(str, s)) if len(s) <= 10 else ", ".join(map(str, s[:4] + ["..."] + s[-4:]))


def _samples(client, run_id: str, prefixes: set[str], step: int, source: str,
             kinds: dict[str, dict] | None = None) -> dict[str, dict[str, float]]:
    """Per-example scores by full metric name, from the eval artifacts of `step` (if any); the
    artifacts' `mode` and `suite` (where recorded) go into `kinds[prefix]`."""
    try:
        listed = {a.path for a in client.list_artifacts(run_id, "evals")}
    except Exception:  # noqa: BLE001 - no artifacts folder: no samples
        return {}
    out: dict[str, dict[str, float]] = {}
    for prefix in sorted(prefixes):
        name = eval_artifact_name(prefix, step)
        if name not in listed:
            continue
        with tempfile.TemporaryDirectory(prefix="lowprec-gate-") as tmp:
            try:
                with quiet_artifact_downloads():
                    local = client.download_artifacts(run_id, name, tmp)
                doc = json.loads(Path(local).read_text())
                if kinds is not None:
                    kinds[prefix] = {k: doc[k] for k in ("mode", "suite") if isinstance(doc.get(k), str)}
                samples = doc["samples"]
                for task, per in samples.items():
                    for metric, ex in per.items():
                        out[f"{prefix}/{task}/{metric}"] = {str(k): float(v) for k, v in ex.items()}
            except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
                raise GateInputError(f"{source}: the artifact {name} cannot be read as eval samples "
                                     f"({type(e).__name__}: {e}); it should hold {{step, prefix, results, "
                                     f"samples: {{task: {{metric: {{example key: score}}}}}}}}") from None
    return out


def load_scores(tracking_uri: str, run_ref: str, *, metrics: Iterable[str] | None = None, step: int | None = None,
                prefix: str = "eval", client=None) -> Scores:
    """The run's eval metrics (the given ones, or all under `prefix/`) at one step, with stderrs
    and, where the run stored them, per-example scores (see the module doc)."""
    client = client or open_client(tracking_uri)
    run = resolve_run(client, tracking_uri, run_ref)
    run_id, name = run.info.run_id, run.info.run_name or ""
    source = f"run {run_id}" + (f" ({name})" if name else "")
    logged = sorted(run.data.metrics)
    if metrics is None:
        wanted = [k for k in logged if k.startswith(prefix + "/") and not k.endswith(STDERR_SUFFIX)]
        if not wanted:
            raise GateInputError(missing_metric_message(f"{prefix}/...", logged, source))
    else:
        wanted = list(dict.fromkeys(metrics))
        for m in wanted:
            if m not in run.data.metrics:
                raise GateInputError(missing_metric_message(m, logged, source))
    histories = {m: _history(client, run_id, m) for m in wanted}
    at = _pick_step(histories, step, source)
    prefixes = {m.split("/", 1)[0] for m in wanted}
    kinds: dict[str, dict] = {}
    samples = _samples(client, run_id, prefixes, at, source, kinds)
    for p in sorted(prefixes):   # the kind of eval at `at`: the mode metric, else the artifact; the suite param
        kind = kinds.setdefault(p, {})
        if MODE_METRIC + p in run.data.metrics:
            flag = _history(client, run_id, MODE_METRIC + p).get(at)
            if flag is not None:
                kind["mode"] = "full" if flag >= 0.5 else "fast"
        if isinstance(run.data.params.get(SUITE_PARAM), str):   # a run of lowprec's eval section
            kind.setdefault("suite", run.data.params[SUITE_PARAM])
            if p.startswith("eval"):   # eval/, eval_hp/: the documents scored (not telemetry/'s numbers)
                kind["limit"] = run.data.params.get(LIMIT_PARAM, "null")
    out = {}
    for m in wanted:
        se = _history(client, run_id, m + STDERR_SUFFIX).get(at) if m + STDERR_SUFFIX in run.data.metrics else None
        out[m] = MetricScores(histories[m][at], se if se is not None and math.isfinite(se) and se >= 0 else None,
                              samples.get(m))
    steps = sorted(set.intersection(*(set(h) for h in histories.values())))   # every gated metric evaluated
    return Scores(out, source=f"{source} at step {at}", step=at,
                  extra={"run_id": run_id, "run_name": name, "tracking_uri": tracking_uri,
                         "status": run.info.status, "kinds": kinds, "describe": source, "steps": steps})


def common_steps(baseline: Scores, candidate: Scores) -> list[int]:
    """The steps at which both runs evaluated every gated metric."""
    return sorted(set(baseline.extra.get("steps", ())) & set(candidate.extra.get("steps", ())))


def step_fix(baseline: Scores, candidate: Scores) -> str:
    """What --step can still do for these two runs: name a step both evaluated, or nothing."""
    both = common_steps(baseline, candidate)
    if not both:
        return "no --step can help: the two runs share no step at which every gated metric was evaluated"
    return f"compare the evals of one step both runs have with --step N (N one of {_steps(dict.fromkeys(both))})"


def check_named_step(baseline: Scores, candidate: Scores, step: int) -> None:
    """A GateInputError unless both runs evaluated every gated metric at `step` (read at their finals)."""
    missing = [(role, s) for role, s in (("baseline", baseline), ("candidate", candidate))
               if step not in s.extra.get("steps", ())]
    if missing:
        have = "; ".join(f"the {role} {s.extra.get('describe', s.source)} has evals at steps "
                         f"{_steps(dict.fromkeys(s.extra.get('steps', ())))}" for role, s in missing)
        raise GateInputError(f"--step {step}: {have}. Fix: {step_fix(baseline, candidate)}, or leave --step out "
                             f"(--step final, the default) to compare each run's final evals")


def check_comparable(baseline: Scores, candidate: Scores, step_named: bool) -> None:
    """A GateInputError unless the two runs' evals can be compared: without --step (each run's
    final evals) both runs finished and the evals are of one mode (fast in-loop / full final);
    the final evals of two finished runs are compared even at different steps (a framework run
    that rewound ends where its control ends, at the framework's step; a shorter run is said in
    the sources). A step named with --step lifts both (the user chose the evals); different
    suites never compare. A fix it suggests is one that is not refused in turn."""
    problems = []
    for role, s in (("baseline", baseline), ("candidate", candidate)):
        status = s.extra.get("status")
        if status is not None and status != RunStatus.FINISHED and not step_named:
            problems.append(f"the {role} {s.extra.get('describe', s.source)} did not finish (MLflow status "
                            f"{status}): its last eval, at step {s.step}, may be an in-loop one of a run cut short")
    bk, ck = baseline.extra.get("kinds", {}), candidate.extra.get("kinds", {})
    for prefix in sorted(set(bk) & set(ck)):
        for what in ("mode", "suite", "limit"):
            b, c = bk[prefix].get(what), ck[prefix].get(what)
            if b is not None and c is not None and b != c and (what != "mode" or not step_named):
                label = "eval.limit" if what == "limit" else what   # documents per task: other examples
                problems.append(f"the baseline's {prefix} eval at step {baseline.step} is of {label} {b!r}, the "
                                f"candidate's at step {candidate.step} of {label} {c!r}")
    if problems:
        suites = any("of suite" in p or "of eval.limit" in p for p in problems)
        fix = ("evaluate both runs on one suite with one eval.limit" if suites or step_named else
               "gate two finished runs (a run killed half-way stays RUNNING, one a signal stopped is KILLED: resume it "
               "to the end), or "
               + step_fix(baseline, candidate))
        raise GateInputError("refusing to compare: " + "; ".join(problems) + f". Fix: {fix}")
