"""The fallback-signals picture draws what the fallback's evidence names and nothing else: a run
logs twelve signal series per site (three roles, four statistics) through a real Tracker; one
site falls back on its input's saturation, another on the loss gap's window judgment (no
site signal in its evidence), a third on a gradient-norm spike. Each panel holds only the
evidence's series, at most `MAX_SIGNALS`."""

from __future__ import annotations

import pytest

from lowprec.policy.events import Event, EventKind
from lowprec.tracking.report import MAX_SIGNALS, fallback_signal_keys, signals_figure
from lowprec.tracking.report_sources import from_run_dir
from lowprec.tracking.tracker import Tracker

FAST = dict(flush_interval_s=0.2, retry_max_s=1.0, probe_timeout_s=1.0)
SAT, GAP, GRAD = "blocks.0.mlp.fc", "blocks.1.mlp.fc", "blocks.2.mlp.fc"
ROLES, STATS = ("input", "weight", "grad_output"), ("saturated_frac", "underflow_frac", "underflow_energy_frac",
                                                    "nonfinite")


def _fallback(step, site, reason, evidence):
    return Event(step, EventKind.FALLBACK, (site,), {site: "fp8_tensorwise"}, {site: "bf16"}, reason, evidence, "mlp")


@pytest.fixture(scope="module")
def data(tmp_path_factory, sqlite_store):
    tmp = tmp_path_factory.mktemp("signals-run")
    tracker = Tracker(sqlite_store(tmp / "store"), "lowprec-tests", "signals-run", buffer_dir=tmp / "run", **FAST)
    tracker.log_config({"rollout": {"thresholds": {"max_saturated_frac": 0.01}}})
    tracker.log_precision(0, dict.fromkeys((SAT, GAP, GRAD), "fp8_tensorwise"), {"fp8_tensorwise": 1.0})
    for step in range(0, 60, 5):
        tracker.log_metrics(step, {"train/loss": 3 - step / 100, "train/grad_norm": 0.7 + (step == 50) * 4,
                                   **{f"signal/{site}/{r}/{s}": step / 1e4 for site in (SAT, GAP, GRAD)
                                      for r in ROLES for s in STATS}})
    tracker.log_events([
        _fallback(20, SAT, "site thresholds crossed for 2 checks", {"input/saturated_frac": 0.031}),
        _fallback(40, GAP, "loss_gap: closed by the window retrain with these sites in high precision",
                  {"loss_gap": {"gap": 0.04}, "losses": [3.1, 3.0]}),
        _fallback(50, GRAD, "grad_norm_spike while this site's thresholds are crossed",
                  {"loss": 2.5, "grad_norm": 4.7, "grad_norm_spike": {"sigmas": 9.0}})])
    assert tracker.finish("FINISHED", timeout=60)["pending"] == 0
    return from_run_dir(tmp / "run")


def _labels(ax) -> list[str]:
    return [ln.get_label() for ln in ax.get_lines() if not ln.get_label().startswith("_")
            and ln.get_label() not in ("threshold",) and len(ln.get_xdata()) > 2]


def test_each_panel_draws_only_the_evidence_signals(data):
    assert sum(k.startswith(f"signal/{SAT}/") for k in data.metrics) == 12   # all twelve are there to draw
    assert fallback_signal_keys(data.events[0], SAT, data) == [f"signal/{SAT}/input/saturated_frac"]
    assert fallback_signal_keys(data.events[1], GAP, data) == ["train/loss"]
    assert fallback_signal_keys(data.events[2], GRAD, data) == ["train/grad_norm"]
    fig = signals_figure(data)
    sat, gap, grad = fig.axes[:3]
    assert _labels(sat) == ["input/saturated_frac"]
    assert [ln.get_ydata()[0] for ln in sat.get_lines() if ln.get_label() == "threshold"] == [0.01]
    assert _labels(gap) == ["train/loss"] and _labels(grad) == ["train/grad_norm"]


def test_the_panel_is_capped(data):
    many = {f"{r}/{s}": 0.5 for r in ROLES for s in STATS if s != "nonfinite"}   # nine crossings named
    ev = _fallback(30, SAT, "site thresholds crossed for 2 checks", many)
    keys = fallback_signal_keys(ev, SAT, data)
    assert len(keys) == MAX_SIGNALS and keys[0] == f"signal/{SAT}/input/saturated_frac"   # the evidence's order
