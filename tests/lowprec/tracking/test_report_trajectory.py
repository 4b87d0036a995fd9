"""The pictures follow the final trajectory: a run that rewound at step 89 to step 60 and then
ended at step 70 (a framework's step count never goes back, so the redone pass ended before the
abandoned one) draws its loss and timeline to step 70, without the abandoned steps 71-89,
read from the tracker's journal and from a real MLflow (SQLite) store alike."""

from __future__ import annotations

import time

import pytest

from lowprec.policy.events import Event, EventKind
from lowprec.tracking.report import loss_figure
from lowprec.tracking.report_sources import from_mlflow, from_run_dir
from lowprec.tracking.report_timeline import timeline_figure
from lowprec.tracking.tracker import Tracker

pytestmark = pytest.mark.usefixtures("mlflow_services")
SITES = ("blocks.0.mlp.fc", "blocks.0.mlp.proj")


def test_a_rewound_run_is_drawn_to_its_last_step_not_to_the_abandoned_one(tmp_path, sqlite_store):
    from mlflow.tracking import MlflowClient
    uri = sqlite_store(tmp_path / "store")
    tracker = Tracker(uri, "lowprec-tests", "rewound", buffer_dir=tmp_path / "run", flush_interval_s=0.2,
                      retry_max_s=1.0, probe_timeout_s=1.0)
    init = dict.fromkeys(SITES, "fp8_tensorwise")
    tracker.log_precision(0, init, {"fp8_tensorwise": 1.0})
    for step in range(0, 90):                                # the first pass, to step 89
        tracker.log_metrics(step, {"train/loss": 3.0 - step / 100})
    back = dict.fromkeys(SITES, "bf16")
    tracker.log_events([Event(89, EventKind.ROLLBACK, SITES, init, back, "global signal: loss_spike", {}, "mlp_fp8"),
                        Event(89, EventKind.REWIND, reason="rewind after loss_spike", evidence={"skip_batches": 0})])
    tracker.log_precision(89, back, {"bf16": 1.0})
    time.sleep(0.005)              # MLflow stamps in milliseconds; a training step takes longer than one
    tracker.log_metrics(89, {"train/loss_rewound": 9.0, "train/rewound_to": 60})
    time.sleep(0.005)
    for step in range(60, 71):                               # redone from 60; the run ends at 70
        tracker.log_metrics(step, {"train/loss": 2.5 - step / 100})
    assert tracker.finish("FINISHED", timeout=60, report=False)["pending"] == 0
    for data in (from_run_dir(tmp_path / "run"), from_mlflow(MlflowClient(uri), tracker.run_id)):
        loss = dict(data.metrics["train/loss"])
        assert max(loss) == 70 and data.last_step == 70
        assert loss[65] == pytest.approx(2.5 - 0.65) and loss[59] == pytest.approx(3.0 - 0.59)
        assert data.metrics["train/rewound_to"] == [(89, 60.0)]   # the rewind itself is kept
        fig = loss_figure(data)
        (curve,) = [ln for ln in fig.axes[0].lines if ln.get_label().startswith("candidate")]
        assert max(curve.get_xdata()) == 70
        assert {ax.get_xlim()[1] for ax in timeline_figure(data).axes[:2]} == {70}


def test_eval_axes_carry_no_offset_under_the_verdicts_and_signal_legends_stay_off_the_data():
    from lowprec.tracking.report import evals_figure, signals_figure
    from lowprec.tracking.report_sources import ReportData
    site = "blocks.0.mlp.fc"
    events = [Event(20, EventKind.FALLBACK, (site,), {site: "fp8_tensorwise"}, {site: "bf16"}, "saturated",
                    {"input/saturated_frac": 0.03}, "mlp_fp8"),
              Event(30, EventKind.GATE, reason="gate: pass", evidence={"verdict": "pass"})]
    metrics = {"eval/heldout/word_perplexity": [(10, 1.2e7), (30, 1.1e7)], "train/loss": [(s, 3.0) for s in range(40)],
               f"signal/{site}/input/saturated_frac": [(s, 0.001 * s) for s in range(0, 40, 5)]}
    data = ReportData("big", dict.fromkeys(SITES, "fp8_tensorwise"), 0, events, metrics)
    fig = evals_figure(data)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(fig).draw()
    assert fig.axes[0].yaxis.get_offset_text().get_text() == ""
    box = fig.legends[0].get_window_extent()   # the panels' one legend lies under every panel
    assert all(box.y1 <= ax.get_window_extent().y0 for ax in fig.axes if ax.axison)
    fig = signals_figure(data)
    FigureCanvasAgg(fig).draw()
    box = fig.legends[0].get_window_extent()   # one legend under every panel: never over the data, never cut
    assert all(box.y1 <= ax.get_window_extent().y0 for ax in fig.axes if ax.axison)
    assert box.y0 >= 0 and box.x0 >= 0 and box.x1 <= fig.bbox.x1
