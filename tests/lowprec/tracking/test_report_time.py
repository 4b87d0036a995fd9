"""The report's "where the time went" picture (`time_breakdown.png`): a made-up 60-step run logs
its per-window phase seconds, a rewind (the redone windows logged again, one phase of the
abandoned pass not logged again), an eval and the run summary through a real Tracker into a
SQLite MLflow store; both readers keep the final trajectory, and the picture draws it."""

from __future__ import annotations

import time

import pytest

from lowprec.policy.events import Event, EventKind
from lowprec.tracking.report import render_report
from lowprec.tracking.report_sources import ReportData, from_mlflow, from_run_dir
from lowprec.tracking.report_time import BUCKETS, PHASES, WASTED_LABEL, time_figure
from lowprec.tracking.report_timeline import EVENT_STYLE
from lowprec.tracking.tracker import Tracker
from test_report_rewind import _drawn, _hatched_spans

FAST = dict(flush_interval_s=0.2, retry_max_s=1.0, probe_timeout_s=1.0)
SITES = {"blocks.0.mlp.fc": "bf16", "blocks.0.attn.qkv": "bf16"}
SUMMARY = {"telemetry/bucket/productive_s": 72.0, "telemetry/bucket/startup_s": 6.0, "telemetry/bucket/redone_s": 9.0,
           "telemetry/bucket/recovery_s": 2.3, "telemetry/bucket/eval_s": 4.0, "telemetry/bucket/checkpoint_s": 4.0,
           "telemetry/bucket/tracking_s": 1.2, "telemetry/bucket/other_s": 1.5, "telemetry/goodput": 0.72,
           "telemetry/tokens_per_s": 12345.0, "telemetry/mfu": 0.381, "telemetry/energy_j": 3.0e4,
           "telemetry/energy_per_token_j": 0.0243, "telemetry/wall_s": 100.0}


def window(step: int, redone: bool = False) -> dict[str, float]:
    """The seconds of the window ending at `step` (the redone pass slower in forward)."""
    w = {"time/data_s": 0.1, "time/forward_s": 0.5 + step / 100 + (0.25 if redone else 0.0),
         "time/backward_s": 1.0 + step / 50, "time/optimizer_s": 0.2, "time/tracking_s": 0.02, "time/other_s": 0.01}
    wasted = 0.0
    if step % 10 == 0:
        w["time/monitor_s"] = 0.05
    if step == 15:
        w["time/recovery_s"] = wasted = 0.8
    if step in (20, 40) and not (step == 40 and not redone):   # checkpoints (the one at 40 in the redone pass)
        w["time/checkpoint_s"] = wasted = 2.0
    if step == 30:
        w["time/eval_s"] = wasted = 4.0
    if step == 45 and not redone:                              # the abandoned pass replayed here
        w["time/recovery_s"] = wasted = 1.5
    if step == 40 and redone:                                  # the restore after the rewind
        w["time/recovery_s"] = 3.0
        wasted += 3.0
    w["time/wasted_s"] = wasted
    w["time/window_s"] = sum(v for k, v in w.items() if k not in ("time/wasted_s",))
    return w


def log_run(tracker: Tracker) -> dict[str, dict[int, float]]:
    """Log the run; returns the final trajectory of every `time/` and `telemetry/` metric."""
    final: dict[str, dict[int, float]] = {}

    def log(step, metrics):
        tracker.log_metrics(step, metrics)
        for k, v in metrics.items():
            final.setdefault(k, {})[step] = v

    tracker.log_precision(0, SITES, {"bf16": 1.0})
    for step in range(5, 50, 5):                               # first pass up to the rewind at 45
        log(step, {"train/loss": 3 - step / 100, **window(step)})
        if step == 20:
            promote = Event(20, EventKind.PROMOTE, ("blocks.0.mlp.fc",), {"blocks.0.mlp.fc": "bf16"},
                            {"blocks.0.mlp.fc": "fp8_tensorwise"}, "stable", {}, "mlp_fp8")
            tracker.log_events([promote])
            tracker.log_precision(20, dict(SITES, **promote.to_format), {"bf16": 0.5, "fp8_tensorwise": 0.5})
        if step == 30:
            tracker.log_eval(30, {"hellaswag": {"acc,none": 0.31, "acc_stderr,none": 0.01}})
    tracker.log_metrics(45, {"train/loss_rewound": 9.0, "train/rewound_to": 35})
    tracker.log_events([Event(45, EventKind.REWIND, reason="rewind after loss_spike", evidence={"skip_batches": 0})])
    final = {k: {s: v for s, v in pts.items() if s < 40} for k, pts in final.items()}   # 40, 45 abandoned
    time.sleep(0.05)                                           # the redone pass: later timestamps
    for step in range(40, 65, 5):
        log(step, {"train/loss": 3 - step / 100, **window(step, redone=True)})
    log(60, SUMMARY)
    return {k: v for k, v in final.items() if k.startswith(("time/", "telemetry/"))}


@pytest.fixture(scope="module")
def logged(tmp_path_factory, sqlite_store):
    from mlflow.tracking import MlflowClient

    tmp = tmp_path_factory.mktemp("time-run")
    uri = sqlite_store(tmp / "store")
    tracker = Tracker(uri, "lowprec-tests", "time-run", buffer_dir=tmp / "run", **FAST)
    final = log_run(tracker)
    assert tracker.finish("FINISHED", timeout=60)["pending"] == 0
    return from_mlflow(MlflowClient(uri), tracker.run_id), from_run_dir(tmp / "run"), final, tmp / "run"


def test_both_readers_keep_the_final_trajectory_of_the_time_series(logged):
    remote, local, final, _ = logged
    assert final["time/recovery_s"] == {15: 0.8, 40: 3.0}       # the abandoned pass's recovery at 45 is gone
    for key, pts in final.items():
        assert remote.metrics[key] == local.metrics[key] == sorted(pts.items()), key
    assert {k for k in remote.metrics if k.startswith(("time/", "telemetry/"))} == set(final)
    assert dict(remote.metrics["time/forward_s"])[45] == window(45, redone=True)["time/forward_s"]


def _heights(ax, step: int) -> dict[str, float]:
    """{label: height} of the step patches over the window that ends at `step`."""
    out = {}
    for p in ax.patches:
        if type(p).__name__ == "StepPatch":
            values, edges, baseline = p.get_data()
            i = list(edges).index(step) - 1
            out[p.get_label()] = float(values[i] - baseline[i])
    return out


def test_the_picture_stacks_the_logged_phases_and_marks_waste_rewind_and_eval(logged):
    data, _, final, _ = logged
    fig = time_figure(data)
    _drawn(fig)
    ax, bax = fig.axes[:2]
    logged_phases = [p for p in PHASES if f"time/{p}_s" in final]
    assert "collective" not in logged_phases and "recovery" in logged_phases
    stairs = [p.get_label() for p in ax.patches if type(p).__name__ == "StepPatch"]
    assert stairs == logged_phases + [WASTED_LABEL]            # one per logged phase, stacked in order
    for step in (15, 30, 40, 45, 60):
        h = _heights(ax, step)
        want = {p: final[f"time/{p}_s"].get(step, 0.0) for p in logged_phases}
        assert {p: h[p] for p in logged_phases} == pytest.approx(want), step
        assert sum(want.values()) == pytest.approx(final["time/window_s"][step])
        assert h[WASTED_LABEL] == pytest.approx(final["time/wasted_s"][step]), step
    assert _heights(ax, 45)["recovery"] == 0.0 and _heights(ax, 40)["recovery"] == pytest.approx(3.0)
    wasted = next(p for p in ax.patches if p.get_label() == WASTED_LABEL)
    assert wasted.get_hatch() and wasted.get_data()[0][list(wasted.get_data()[1]).index(30) - 1] == \
        pytest.approx(final["time/window_s"][30])              # the top of the column is hatched
    assert (35, 45) in _hatched_spans(ax)                      # the rewound, redone steps
    lines = {ln.get_label(): ln for ln in ax.lines}
    assert list(lines["eval"].get_xdata()) == [30, 30]
    assert list(lines["rewind"].get_xdata()) == [45, 45] and lines["rewind"].get_color() == \
        EVENT_STYLE[EventKind.REWIND][0]
    assert list(lines["promote"].get_xdata()) == [20, 20]
    bars = {c.get_label().split()[0]: c for c in bax.containers}
    assert list(bars) == [b for b in BUCKETS if f"telemetry/bucket/{b}_s" in SUMMARY]
    assert {b: c.patches[0].get_width() for b, c in bars.items()} == pytest.approx({
        b: SUMMARY[f"telemetry/bucket/{b}_s"] for b in bars})
    title = bax.get_title(loc="left")
    for text in ("goodput 72%", "12,345 tokens/s", "MFU 38.1%", "0.0243 J/token"):
        assert text in title, title


def test_without_mfu_or_energy_the_summary_says_what_it_has():
    metrics = {"time/forward_s": [(5, 1.0), (10, 1.2)], "telemetry/goodput": [(10, 0.5)],
               "telemetry/bucket/productive_s": [(10, 2.0)], "telemetry/bucket/other_s": [(10, 2.0)]}
    fig = time_figure(ReportData("r", {}, 0, [], metrics))
    title = fig.axes[1].get_title(loc="left")
    assert "goodput 50%" in title and "MFU" not in title and "J/token" not in title
    assert _heights(fig.axes[0], 10) == {"forward": 1.2} and _heights(fig.axes[0], 5) == {"forward": 1.0}


def test_render_report_writes_the_picture_and_skips_it_for_older_runs(logged, tmp_path):
    data, _, _, run_dir = logged
    assert (run_dir / "files" / "report" / "time_breakdown.png").is_file()   # the tracker's own report
    names = [p.name for p in render_report(data, tmp_path / "new")]
    assert "time_breakdown.png" in names and (tmp_path / "new" / "time_breakdown.png").stat().st_size > 10_000
    older = ReportData("old", dict(SITES), 0, [], {"train/loss": [(s, 3.0) for s in range(0, 60, 5)]})
    assert time_figure(older) is None
    assert [p.name for p in render_report(older, tmp_path / "old")] == ["precision_timeline.png", "loss.png"]
