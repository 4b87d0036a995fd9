"""The evals picture keeps the kinds of eval apart: a run logs fast in-loop evals and a full
final one, of the model as it runs and of the same weights in high precision, through a real
Tracker into a SQLite MLflow store; the picture read back from the run's journal draws the fast
evals as one line, the full eval as its own unjoined marker, and the high-precision series in
its own colour above the candidate's."""

from __future__ import annotations

import pytest

from lowprec.tracking.report import CANDIDATE_COLOR, HP_COLOR, eval_modes, evals_figure
from lowprec.tracking.report_sources import from_run_dir
from lowprec.tracking.tracker import Tracker

FAST = dict(flush_interval_s=0.2, retry_max_s=1.0, probe_timeout_s=1.0)
RUN = "evals-run"


@pytest.fixture(scope="module")
def data(tmp_path_factory, sqlite_store):
    tmp = tmp_path_factory.mktemp("evals-run")
    tracker = Tracker(sqlite_store(tmp / "store"), "lowprec-tests", RUN, buffer_dir=tmp / "run", **FAST)
    tracker.log_precision(0, {"blocks.0.mlp.fc": "fp8_tensorwise"}, {"fp8_tensorwise": 1.0})
    for step in (10, 20, 30):   # fast in-loop evals (few examples): bits per byte near 1.9
        tracker.log_eval(step, {"heldout": {"bits_per_byte": 1.9 - step / 1000, "bits_per_byte_stderr": 0.02}},
                         mode="fast")
        tracker.log_eval(step, {"heldout": {"bits_per_byte": 1.89 - step / 1000, "bits_per_byte_stderr": 0.02}},
                         prefix="eval_hp", mode="fast")
    # the full final eval at the last step measures another set: a different level, not a jump
    tracker.log_eval(40, {"heldout": {"bits_per_byte": 1.6, "bits_per_byte_stderr": 0.005}}, mode="full")
    tracker.log_eval(40, {"heldout": {"bits_per_byte": 1.595, "bits_per_byte_stderr": 0.005}},
                     prefix="eval_hp", mode="full")
    assert tracker.finish("FINISHED", timeout=60)["pending"] == 0
    return from_run_dir(tmp / "run")


def _lines(fig) -> dict:
    return {ln.get_label(): ln for ln in fig.axes[0].get_lines() if not ln.get_label().startswith("_")}


def test_fast_and_full_evals_are_separate_series(data):
    assert eval_modes(data.metrics, "eval", [10, 20, 30, 40]) == [
        ("in-loop (fast) evals", [10, 20, 30], False), ("final (full) eval", [40], True)]
    lines = _lines(evals_figure(data))
    fast, full = lines[f"candidate: {RUN}, in-loop (fast) evals"], lines[f"candidate: {RUN}, final (full) eval"]
    assert list(fast.get_xdata()) == [10, 20, 30] and fast.get_linestyle() == "-"
    assert list(full.get_xdata()) == [40] and full.get_linestyle() == "None"   # a marker, joined to nothing
    assert list(full.get_ydata()) == [1.6]
    # no drawn line runs from a fast eval to the full one
    for ln in lines.values():
        xs = list(ln.get_xdata())
        assert not (40 in xs and len(xs) > 1), ln.get_label()


def test_the_high_precision_series_is_drawn_apart_and_under_the_candidate(data):
    lines = _lines(evals_figure(data))
    hp_fast = lines["same weights, high precision, in-loop (fast) evals"]
    hp_full = lines["same weights, high precision, final (full) eval"]
    cand = lines[f"candidate: {RUN}, in-loop (fast) evals"]
    assert list(hp_fast.get_xdata()) == [10, 20, 30] and list(hp_full.get_ydata()) == [1.595]
    assert hp_fast.get_color() == HP_COLOR != CANDIDATE_COLOR == cand.get_color()
    assert hp_fast.get_marker() != cand.get_marker() and hp_fast.get_markerfacecolor() == "none"  # hollow: both seen
    # wide, light and under the candidate's thin line, its hollow markers larger than the candidate's
    # dots: where the two coincide both are seen
    assert hp_fast.get_zorder() < cand.get_zorder() and hp_full.get_zorder() < cand.get_zorder()
    assert hp_fast.get_linewidth() > cand.get_linewidth() and hp_fast.get_markersize() > cand.get_markersize()
    assert hp_fast.get_alpha() < 1


def test_a_run_with_one_kind_of_eval_keeps_one_series(data):
    only_fast = {k: v for k, v in data.metrics.items() if not k.startswith("eval_mode/")}
    assert eval_modes(only_fast, "eval", [10, 20]) == [("", [10, 20], False)]
    assert eval_modes({"eval_mode/eval": [(10, 0.0), (20, 0.0)]}, "eval", [10, 20]) == [("", [10, 20], False)]
