"""What a rollout report is drawn from, read from a tracker's buffer dir or from an MLflow run.

`ReportData` holds the precision map at the first logged step, the controller events, and
the metric histories the pictures need: everything under `train/`, `eval/`, `eval_hp/`,
`eval_mode/` (which evals were fast in-loop ones, which full), `precision/`,
`time/` (seconds per log window by phase) and `telemetry/` (the run summary), and the
`signal/<site>/...` series of the sites that fell back (not the thousands of others).
`from_run_dir` reads the tracker's local journal (what `finish` draws, even with the server
away); `from_mlflow` reads a run through `MlflowClient` (what `lowprec report RUN_ID` draws).
The same events also give the run's compact `lowprec.*` tags, its Markdown note and the
rows of its events table (`events_tags`, `events_table`), so the MLflow page and the
pictures can never disagree.

`precision_history` is the precision map at each step of the final trajectory (after a
rewind, the redone steps in the map they were redone in; the rewinds from the REWIND events
and `train/rewound_to`, `rewinds`); the timeline and the FLOP-share panel are both drawn from
it (`flops_share_steps`), so they cannot contradict each other. A step logged twice (after a
rewind) keeps the later value, and steps a rewind abandoned that the run never redid (past its
end) are dropped (`_final_trajectory`); of its `time/` series only the later pass's points (those
logged after the step's earlier `time/window_s`): a phase the redone window did not log
counts as 0 there, not as the abandoned pass's seconds (`_final_pass`). A site's `output` signals
other than `nonfinite` are never measured and not read (older runs logged them as zeros).

Evidence a fallback carries, so that the report can plot the signal that triggered it:
the controller's `{"input/saturated_frac": 0.031, ...}` (role/stat -> value; the
threshold then comes from the logged config's `rollout.thresholds`), or an explicit
`{"signal": "saturated_frac", "role": "input", "value": 0.031, "threshold": 0.01}`,
either directly or per site (`{"blocks.3.mlp.fc": {...}}`). A gate event carries
`{"verdict": "pass" | "regress" | "inconclusive", ...}`.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path


from lowprec.base.yaml_read import read_yaml_file
from lowprec.base.quiet import quiet_artifact_downloads
from lowprec.policy.events import Event, EventKind, describe, read_events, replay
from lowprec.tracking.records import BASELINE_LOSS, flatten_config, tidy_numbers
from lowprec.tracking.report_scales import as_inf

__all__ = ["ReportData", "from_run_dir", "from_mlflow", "events_table", "events_tags", "signals_of",
           "fallback_sites", "rewinds", "precision_history", "flops_share_steps", "STATS"]

Series = list[tuple[int, float]]
_KEPT_PREFIXES = ("train/", "eval/", "eval_hp/", "eval_mode/", "precision/", "time/", "telemetry/")
WINDOW = "time/window_s"
STATS = ("amax", "saturated_frac", "underflow_frac", "underflow_energy_frac", "rel_mse", "sqnr_db", "nonfinite")
# rollout.thresholds keys (lowprec.policy.detectors.Thresholds) -> the stat they bound
THRESHOLD_KEYS = {"max_saturated_frac": "saturated_frac", "max_underflow_frac": "underflow_frac",
                  "max_underflow_energy": "underflow_energy_frac", "min_sqnr_db": "sqnr_db"}


@dataclass
class ReportData:
    run_name: str
    initial: dict[str, str]                              # site -> format at initial_step
    initial_step: int = 0
    events: list[Event] = field(default_factory=list)
    metrics: dict[str, Series] = field(default_factory=dict)  # key -> [(step, value)] by step
    baseline: Series = field(default_factory=list)       # baseline loss curve, if any
    thresholds: dict[str, float] = field(default_factory=dict)  # stat -> configured threshold
    baseline_name: str = ""                              # the baseline run drawn beside this one, if any
    baseline_metrics: dict[str, Series] = field(default_factory=dict)  # its curves (report_baseline)
    notes: list[str] = field(default_factory=list)       # what the report could not draw, and why

    @property
    def last_step(self) -> int:
        """The last step of the final trajectory: of the training loss where there is one (a
        rewind's abandoned steps past the run's end are not on it), else of anything logged."""
        loss = self.metrics.get(TRAIN_LOSS)
        if loss:
            return max(loss[-1][0], self.initial_step)
        steps = [s for series in self.metrics.values() for s, _ in series[-1:]] + [e.step for e in self.events]
        return max(steps, default=self.initial_step)


def fallback_sites(events: list[Event]) -> list[str]:
    """Sites that fell back on their own signals, in order of first fallback."""
    seen: dict[str, None] = {}
    for e in events:
        if e.kind == EventKind.FALLBACK:
            seen.update(dict.fromkeys(e.sites))
    return list(seen)


def signals_of(event: Event, site: str, thresholds: dict[str, float] | None = None) -> list[dict]:
    """The signals an event's evidence names for `site`: [{role, signal, value, threshold?}]."""
    ev = event.evidence.get(site) if isinstance(event.evidence.get(site), dict) else event.evidence
    if not isinstance(ev, dict):
        return []
    if "signal" in ev:
        return [dict(ev)]
    out = []
    for key, v in ev.items():
        role, _, stat = str(key).partition("/")
        if stat in STATS and isinstance(v, (int, float)):
            item = {"role": role, "signal": stat, "value": v}
            if thresholds and stat in thresholds:
                item["threshold"] = thresholds[stat]
            out.append(item)
    return out


def _thresholds(flat_params: dict[str, str]) -> dict[str, float]:
    """stat -> its threshold from the logged config; `lr_hold_rise` and `lr_hold_above` are
    `rollout.lr_probe.hold_rise` and `.hold_above` (only when the probe was enabled)."""
    out = {}
    keys = {f"rollout.thresholds.{key}": stat for key, stat in THRESHOLD_KEYS.items()}
    if str(flat_params.get("rollout.lr_probe.enabled")).lower() == "true":
        keys["rollout.lr_probe.hold_rise"] = "lr_hold_rise"
        keys["rollout.lr_probe.hold_above"] = "lr_hold_above"
    for key, stat in keys.items():
        v = flat_params.get(key)
        try:
            out[stat] = float(v)
        except (TypeError, ValueError):
            pass
    return out


def _wanted(key: str, sites: set[str]) -> bool:
    if key.startswith(_KEPT_PREFIXES):
        return True
    if not key.startswith("signal/"):
        return False
    site, role, stat = (key[len("signal/"):].rsplit("/", 2) + ["", ""])[:3]
    # a site's output is only checked for non-finite values: older runs logged zeros for the rest
    return site in sites and (role != "output" or stat == "nonfinite")


TRAIN_LOSS, REWOUND_TO = "train/loss", "train/rewound_to"
_REWIND_MARKS = (REWOUND_TO, "train/loss_rewound")   # logged at the step that rewound: kept


def _final_trajectory(points: dict[str, list[tuple[int, float, float]]]) -> dict[str, dict[int, float]]:
    """{key: [(step, timestamp, value)]} -> {key: {step: value}} along the final trajectory:
    a rewind to step B (a `train/rewound_to` point, logged when it happened) abandons every
    point logged before it at a step from B on; the redone steps log theirs again, and the
    abandoned steps past the run's end are dropped. Otherwise the latest value of a step wins.
    Timestamps order the points (the journal's line first); MLflow's are milliseconds, finer
    than a training step, so an abandoned step's points are older than the rewind and a
    redone step's points are not. An eval's abandoned points (taken on weights a rewind then abandoned) are kept apart, under
    `abandoned/<key>`: the evals picture draws them beside the gate verdicts they produced."""
    backs = sorted((ts, int(v)) for _, ts, v in points.get(REWOUND_TO, []))
    out: dict[str, dict[int, float]] = {}
    for key, pts in points.items():
        kept, dropped, i = {}, {}, 0
        for step, ts, v in sorted(pts, key=lambda p: p[1]) + [(None, None, None)]:   # None: the end
            while key not in _REWIND_MARKS and i < len(backs) and (ts is None or backs[i][0] <= ts):
                dropped.update({k: x for k, x in kept.items() if k >= backs[i][1]})
                kept = {k: x for k, x in kept.items() if k < backs[i][1]}
                i += 1
            if step is not None:
                kept[step] = v
        out[key] = kept
        if dropped and key.startswith("eval"):
            out[f"abandoned/{key}"] = dropped
    return out


def _final_pass(timed: dict[str, list[tuple[int, float, float]]]) -> dict[str, dict[int, float]]:
    """`time/` points {key: [(step, timestamp, value)] in logging order} -> {key: {step: value}},
    where a step whose `time/window_s` was logged more than once keeps only the points logged
    after the last-but-one of them (the redone window's, not the abandoned pass's)."""
    stamps: dict[int, list[float]] = {}
    for step, ts, _ in timed.get(WINDOW, []):
        stamps.setdefault(step, []).append(ts)
    cut = {step: sorted(ts)[-2] for step, ts in stamps.items() if len(ts) > 1}
    out: dict[str, dict[int, float]] = {}
    for key, pts in timed.items():
        for step, ts, v in pts:
            if ts > cut.get(step, -float("inf")):
                out.setdefault(key, {})[step] = v
    return out


# ------------------------------------------------------------------ precision history
def rewinds(data: ReportData) -> list[tuple[int, int]]:
    """(step that rewound, step it went back to), in order: from the REWIND events' evidence
    (`to_step`/`checkpoint_step`) or else the `train/rewound_to` metric logged at that step."""
    logged = {s: int(v) for s, v in data.metrics.get("train/rewound_to", [])}
    out = []
    for e in data.events:
        if e.kind != EventKind.REWIND:
            continue
        back = e.evidence.get("to_step", e.evidence.get("checkpoint_step", logged.get(e.step)))
        if isinstance(back, (int, float)) and back <= e.step:
            out.append((e.step, int(back)))
    seen = {s for s, _ in out}
    return out + [(s, b) for s, b in sorted(logged.items()) if s not in seen and b <= s]


def precision_history(data: ReportData) -> list[tuple[int, dict[str, str]]]:
    """The precision map along the final trajectory: [(first step, {site: format})], steps
    increasing. A format change holds from its step on; a rewind to step B drops what the
    abandoned steps from B on had, and the redone steps run in the map of the moment of the
    rewind (a rewind keeps the precision map), later changes of those steps replacing it."""
    back_of = {}
    for step, back in rewinds(data):
        back_of.setdefault(step, []).append(back)
    segments: list[tuple[int, dict[str, str]]] = [(data.initial_step, dict(data.initial))]

    def start(step: int, formats: dict[str, str]) -> None:
        while segments and segments[-1][0] >= step and len(segments) > 1:
            segments.pop()
        if segments[-1][0] >= step:
            segments[-1] = (max(step, data.initial_step), formats)
        else:
            segments.append((step, formats))

    used: dict[int, int] = {}
    for e in data.events:
        if e.kind in EventKind.CHANGES_FORMATS:
            start(e.step, replay(segments[-1][1], [e]))
        elif e.kind == EventKind.REWIND and back_of.get(e.step):
            k = used.get(e.step, 0)
            back = back_of[e.step][min(k, len(back_of[e.step]) - 1)]
            used[e.step] = k + 1
            start(back, dict(segments[-1][1]))
    # merge neighbours with the same map
    out: list[tuple[int, dict[str, str]]] = []
    for step, fm in segments:
        if not out or out[-1][1] != fm:
            out.append((step, fm))
    return out


def formats_at(history: list[tuple[int, dict[str, str]]], step: int) -> dict[str, str]:
    cur = history[0][1]
    for s, fm in history:
        if s > step:
            break
        cur = fm
    return cur


def flops_share_steps(data: ReportData, history: list[tuple[int, dict[str, str]]] | None = None
                      ) -> tuple[list[int], dict[str, list[float]]]:
    """The GEMM FLOP share per format over the same history the timeline draws: one value per
    history segment (steps = the segments' first steps), each the share logged at the latest
    logged step inside the segment (the redone value where a step was logged twice), else the
    share logged anywhere for the same map; a segment with neither is left at 0."""
    history = history or precision_history(data)
    share = {k.rsplit("/", 1)[1]: dict(v) for k, v in data.metrics.items() if k.startswith("precision/flops_share/")}
    if not share:
        return [], {}
    logged = sorted({s for v in share.values() for s in v})
    by_map: dict[tuple, dict[str, float]] = {}
    for s in logged:
        by_map[tuple(sorted(formats_at(history, s).items()))] = {f: v.get(s, 0.0) for f, v in share.items()}
    steps, ys = [], {f: [] for f in share}
    bounds = [s for s, _ in history[1:]] + [float("inf")]
    for (first, fm), end in zip(history, bounds):
        inside = [s for s in logged if first <= s < end]
        vals = ({f: v.get(inside[-1], 0.0) for f, v in share.items()} if inside
                else by_map.get(tuple(sorted(fm.items())), {}))
        steps.append(first)
        for f in share:
            ys[f].append(vals.get(f, 0.0))
    return steps, ys


# ------------------------------------------------------------------ run dir (local journal)
def from_run_dir(run_dir: str | os.PathLike) -> ReportData:
    d = Path(run_dir)
    info = json.loads((d / "run.json").read_text()) if (d / "run.json").exists() else {}
    events = read_events(d / "events.jsonl")
    pmap = json.loads((d / "files" / "precision_map.json").read_text()) if (d / "files" / "precision_map.json").exists() else {}
    sites = set(fallback_sites(events))
    logged: dict[str, list[tuple[int, float, float]]] = {}
    timed: dict[str, list[tuple[int, float, float]]] = {}
    journal = d / "outbox.jsonl"
    if journal.exists():
        with open(journal) as f:
            for n, line in enumerate(f):
                if '"op":"metrics"' not in line:
                    continue
                for k, v, ts, step in json.loads(line)["metrics"]:
                    if k.startswith("time/"):
                        timed.setdefault(k, []).append((int(step), float(ts), float(v)))
                    elif _wanted(k, sites):   # ordered by the journal's line, then its timestamp
                        logged.setdefault(k, []).append((int(step), (n, float(ts)), float(v)))
    points = _final_trajectory(logged)
    points.update(_final_pass(timed))
    metrics = {k: sorted(v.items()) for k, v in points.items()}
    cfg_file = d / "files" / "config.yaml"
    thresholds = {}
    if cfg_file.exists():
        thresholds = _thresholds(flatten_config(read_yaml_file(cfg_file)))
    return ReportData(info.get("run_name", d.name), pmap.get("initial", {}), pmap.get("initial_step", 0),
                      events, metrics, metrics.get(BASELINE_LOSS, []), thresholds)


# ------------------------------------------------------------------ MLflow run
def from_mlflow(client, run_id: str) -> ReportData:
    """Read a run through an MlflowClient (with its baseline run beside it:
    `lowprec.tracking.report_baseline.read_run`)."""
    run = client.get_run(run_id)
    with tempfile.TemporaryDirectory() as tmp, quiet_artifact_downloads():
        names = {a.path for a in client.list_artifacts(run_id)}
        events, pmap = [], {}
        if "events.jsonl" in names:
            events = read_events(client.download_artifacts(run_id, "events.jsonl", tmp))
        if "precision_map.json" in names:
            pmap = json.loads(Path(client.download_artifacts(run_id, "precision_map.json", tmp)).read_text())
    sites = set(fallback_sites(events))
    metrics, timed = {}, {}
    for key in run.data.metrics:
        if _wanted(key, sites):
            hist = sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)
            if key.startswith("time/"):
                timed[key] = [(m.step, m.timestamp, as_inf(m.value)) for m in hist]
            else:
                metrics[key] = [(m.step, m.timestamp, as_inf(m.value)) for m in hist]
    metrics = {k: sorted(v.items()) for k, v in _final_trajectory(metrics).items()}
    metrics.update({k: sorted(v.items()) for k, v in _final_pass(timed).items()})
    data = ReportData(run.info.run_name or run_id, pmap.get("initial", {}), pmap.get("initial_step", 0),
                      events, metrics, metrics.get(BASELINE_LOSS, []), _thresholds(run.data.params))
    return data


# ------------------------------------------------------------------ events as table and tags
EVENT_COLUMNS = ["step", "kind", "stage", "sites", "from", "to", "reason", "evidence"]


def _moves(e: Event, which: dict[str, str]) -> str:
    fmts = sorted(set(which.values()))
    return fmts[0] if len(fmts) == 1 else ", ".join(f"{s}={f}" for s, f in which.items())


def events_table(events: list[Event]) -> dict:
    """Rows of the `events.json` table artifact (MLflow's `log_table` layout, orient=split)."""
    rows = [[e.step, e.kind, e.stage or "", ", ".join(e.sites), _moves(e, e.from_format), _moves(e, e.to_format),
             e.reason, json.dumps(json.loads(e.to_json())["evidence"], sort_keys=True)] for e in events]
    return {"columns": EVENT_COLUMNS, "data": rows}


def events_tags(events: list[Event], run_name: str = "") -> dict[str, str]:
    """Compact, filterable run tags (`tags.lowprec.fallbacks > '0'`) and the run's note."""
    by = {k: [e for e in events if e.kind == k] for k in EventKind.ALL}
    promoted = [e.stage or "?" for e in by[EventKind.PROMOTE]]
    fb_sites = [f"{s}@{e.step}" for e in by[EventKind.FALLBACK] for s in e.sites]
    quarantined = sorted({s for e in by[EventKind.QUARANTINE] for s in e.sites})
    gates = [f"step {e.step}{' ' + e.stage if e.stage else ''}: {_gate_outcome(e, events)}"
             for e in by[EventKind.GATE]]
    tags = {
        "lowprec.stage": _stage_now(events),
        "lowprec.stages_promoted": ", ".join(promoted) or "none",
        "lowprec.fallbacks": str(len(fb_sites)),
        "lowprec.fallback_sites": ", ".join(fb_sites) or "none",
        "lowprec.rollbacks": str(len(by[EventKind.ROLLBACK])),
        "lowprec.rewinds": str(len(by[EventKind.REWIND])),
        "lowprec.skipped_steps": str(len(by[EventKind.SKIP_STEP])),
        "lowprec.replays": str(len(by[EventKind.REPLAY])),
        "lowprec.quarantined": ", ".join(quarantined) or "none",
        "lowprec.gate": _gate_outcome(by[EventKind.GATE][-1], events) if gates else "none",
        "lowprec.gates": "; ".join(gates) or "none",
        "mlflow.loggedArtifacts": json.dumps([{"path": "events.json", "type": "table"}]),
    }
    tags["mlflow.note.content"] = _note(events, tags, run_name)
    return tags


def _stage_now(events: list[Event]) -> str:
    """The newest stage still promoted at the end (a rollback takes its stage back), or "none"."""
    promoted: list[str] = []
    for e in events:
        if e.kind == EventKind.PROMOTE:
            promoted.append(e.stage or "?")
        elif e.kind == EventKind.ROLLBACK and e.stage in promoted:
            promoted.remove(e.stage)
    return promoted[-1] if promoted else "none"


def _gate_outcome(gate: Event, events: list[Event]) -> str:
    """A gate's verdict as it stands: a regression the window judgment found not to be
    precision's (a NOT_PRECISION event at the same step) demoted nothing and says so."""
    verdict = str(gate.evidence.get("verdict", "?"))
    cleared = any(e.kind == EventKind.NOT_PRECISION and e.step == gate.step for e in events)
    return f"{verdict} (not precision: nothing demoted)" if verdict == "regress" and cleared else verdict


def _note(events: list[Event], tags: dict[str, str], run_name: str) -> str:
    head = (f"**lowprec rollout {run_name}**: stage now **{tags['lowprec.stage']}**, "
            f"{tags['lowprec.fallbacks']} fallbacks, {tags['lowprec.rollbacks']} rollbacks, "
            f"{tags['lowprec.rewinds']} rewinds, quarantined: {tags['lowprec.quarantined']}, "
            f"last gate: {tags['lowprec.gate']}.\n\n"
            "Events (all in the `events.json` table and `events.jsonl`; pictures in `report/`):\n\n"
            "| step | kind | stage | what happened |\n|---:|---|---|---|\n")
    rows = [f"| {e.step} | {e.kind} | {e.stage or ''} | {tidy_numbers(describe(e)).replace('|', '/')} |" for e in events[-40:]]
    more = f"\n\n({len(events) - 40} earlier events not shown)" if len(events) > 40 else ""
    return head + "\n".join(rows) + more
