"""The window judgment on a real `lowprec run` loop: a fault tied to its steps is not blamed on
precision, and the suspicion holds the schedule up no longer than its window.

A small GPT on Shakespeare (golden_trace's model and data), the MLP stage promoted at step 39,
then the attention of block 0 at step 69; `loss_gap` against the same model trained in BF16.
The fault: block 1's attention input (a BF16 site, in no stage) times 1e4 on iterations
40-43 (a corrupted input on fixed steps, in every format). The loss drifts from the baseline
and the gap fires at step 49. Trained again with every FP8 site in high precision the window
closes the gap, because the fault does not recur in a retrain; the control (the same window
trained again as configured) closes it too, so nothing is demoted, and the attention stage
promotes at step 69 as it does in the run without the fault. The run is tracked in a SQLite
MLflow store, and `lowprec report` draws it.
"""

from __future__ import annotations

import copy
import json

import pytest

from golden_trace import CONFIG
from lowprec.cli import main
from lowprec.policy.events import EventKind
from lowprec.runtime import Injection
from lowprec.runtime.trainer.run import run_config
from lowprec.tracking.tracker import Tracker

FAULT_SITE = "blocks.1.attn.qkv"


def _config(baseline_file) -> dict:
    cfg = copy.deepcopy(CONFIG)
    cfg["train"]["steps"] = 80
    ro = cfg["rollout"]
    ro["min_steps"] = 30
    ro["thresholds"].update(loss_gap=0.02, loss_gap_smoothing=0.5)
    ro["baseline"] = {"losses": str(baseline_file)}
    ro["rewind"].update(snapshot_every=10, keep=3)
    ro["stages"][1]["select"] = {"glob": "blocks.0.attn.*"}
    return cfg


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sqlite_store):
    tmp = tmp_path_factory.mktemp("window")
    bf16 = copy.deepcopy(CONFIG)
    bf16["train"]["steps"] = 80
    bf16.pop("rollout")
    (tmp / "bf16.json").write_text(json.dumps([float(x) for x in run_config(bf16, tmp / "bf16").losses]))
    clean = run_config(_config(tmp / "bf16.json"), tmp / "clean")
    uri = sqlite_store(tmp / "store")
    tracker = Tracker(uri, "lowprec-tests", "input-fault", buffer_dir=tmp / "fault" / "tracking", flush_interval_s=0.2)
    faulted = run_config(_config(tmp / "bf16.json"), tmp / "fault", tracker=tracker,
                         faults=[Injection("input", 40, 44, FAULT_SITE, factor=1e4)])
    assert tracker.finish("FINISHED", timeout=60)["pending"] == 0
    faulted.tracked = (tracker, uri)
    return clean, faulted


@pytest.mark.slow
def test_a_fault_on_fixed_steps_demotes_nothing(runs):
    _, faulted = runs
    kinds = [e.kind for e in faulted.events]
    assert EventKind.FALLBACK not in kinds and EventKind.ROLLBACK not in kinds and EventKind.REWIND not in kinds
    (verdict,) = [e for e in faulted.events if e.kind == EventKind.NOT_PRECISION]
    assert verdict.evidence["decided_by"] == "control_window" and "did not recur" in verdict.reason
    # both retrains close the gap: the one with every FP8 site in high precision and the control
    retrained = [x for x in verdict.evidence["looks"] if x["retrained"]]
    assert [bool(x["high_precision"]) for x in retrained] == [True, False]
    assert all(x["closed"] >= 0.3 for x in retrained)
    final = faulted.formats[max(faulted.formats)]     # the precision map at the last step it changed
    assert all(f == "fp8_tensorwise" for s, f in final.items() if ".mlp." in s)


def test_a_suspicion_cleared_holds_the_schedule_up_no_longer_than_its_window(runs):
    clean, faulted = runs
    promotions = [[(e.step, e.stage) for e in r.events if e.kind == EventKind.PROMOTE] for r in (clean, faulted)]
    assert promotions[0] == promotions[1] == [(39, "mlp_fp8"), (69, "attn_fp8")]


def test_lowprec_report_draws_the_run_with_its_window_events(runs, tmp_path):
    """The run's own pictures (drawn when its tracker finished) and `lowprec report` on it."""
    _, faulted = runs
    tracker, uri = faulted.tracked
    drawn = sorted(p.name for p in (tracker.files / "report").iterdir())
    assert {"precision_timeline.png", "loss.png"} <= set(drawn)
    assert main(["report", tracker.run_id, "--tracking-uri", uri, "--out", str(tmp_path / "pics")]) == 0
    assert sorted(p.name for p in (tmp_path / "pics").iterdir()) == drawn
