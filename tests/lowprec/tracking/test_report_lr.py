"""The LR probe's sensitivity as a tracked metric (`train/lr_sensitivity`) and its picture in the report."""

from __future__ import annotations

import math

from lowprec.policy.controller import lr_sensitivity_hold
from lowprec.policy.events import Event, EventKind
from lowprec.policy.monitor import Signals
from lowprec.tracking.records import LR_SENSITIVITY
from lowprec.tracking.report import hold_levels, lr_sensitivity_figure
from lowprec.tracking.report_sources import ReportData, from_run_dir
from lowprec.tracking.tracker import Tracker

FAST = dict(flush_interval_s=0.2, retry_max_s=1.0, probe_timeout_s=1.0)
PROBES = [(9, -0.02), (19, -0.021), (29, -0.018), (39, -0.02), (49, 0.01), (59, 0.06), (69, math.inf), (79, 0.3)]


def test_hold_levels_are_where_the_controller_holds():
    rise_only = dict(hold_levels(PROBES, 0.04, None))
    assert list(rise_only) == [49, 59, 69, 79]   # from the fifth probe on
    assert rise_only[49] == -0.02 + 0.04         # median of the four before
    both = dict(hold_levels(PROBES, 0.04, 0.0))
    assert list(both) == [s for s, _ in PROBES] and both[9] == 0.0 and both[49] == 0.0
    for levels, rise, above in ((rise_only, 0.04, None), (both, 0.04, 0.0)):
        for i, (step, v) in enumerate(PROBES):
            if step in levels:   # above the level exactly when the controller holds
                assert (v > levels[step]) == lr_sensitivity_hold(PROBES[:i + 1], rise, above)[0]


def test_the_tracker_logs_the_sensitivity_and_the_report_draws_it(tmp_path, free_port):
    tracker = Tracker(f"http://127.0.0.1:{free_port()}", "lowprec-tests", "lr-probe", buffer_dir=tmp_path / "run",
                      **FAST)
    tracker.log_config({"rollout": {"lr_probe": {"enabled": True, "hold_rise": 0.04, "hold_above": 0.0}}})
    for step in range(9, 80, 10):   # a check every 10 steps, the probe at every one of them here
        sens = dict(PROBES).get(step)
        tracker.log_signals(step, Signals(step, [2.0], [1.0], lr_sensitivity=sens))
        tracker.log_metrics(step, {"train/loss": 2.0, "train/lr": 1e-3 * 1.1 ** step})
    tracker.log_signals(85, Signals(85, [2.0], [1.0]))   # a check without a probe logs none
    tracker.log_events([Event(59, EventKind.HOLD, (), {}, {}, "promotion of s held: LR sensitivity rose",
                              {"lr_sensitivity": 0.06}, "s")])
    tracker.finish("FINISHED", timeout=2)
    data = from_run_dir(tmp_path / "run")
    assert data.metrics[LR_SENSITIVITY] == PROBES
    assert data.thresholds["lr_hold_rise"] == 0.04 and data.thresholds["lr_hold_above"] == 0.0
    assert [e.kind for e in data.events] == [EventKind.HOLD]
    assert (tmp_path / "run" / "files" / "report" / "lr_sensitivity.png").is_file()   # the tracker's own report


def test_no_probe_no_picture_and_no_level_without_the_config():
    plain = ReportData("run", {"a": "bf16"}, 0, [], {"train/loss": [(0, 2.0), (1, 1.9)]})
    assert lr_sensitivity_figure(plain) is None
    probed = ReportData("run", {"a": "bf16"}, 0, [], {LR_SENSITIVITY: PROBES})
    fig = lr_sensitivity_figure(probed)
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert not any(label.startswith("hold level") for label in labels)
    probed.thresholds["lr_hold_rise"] = 0.04
    labels = [line.get_label() for line in lr_sensitivity_figure(probed).axes[0].get_lines()]
    assert any(label.startswith("hold level") for label in labels)
