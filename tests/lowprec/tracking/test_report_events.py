"""Every kind of event the controller can emit is drawn: the kinds are read from the code
(every `EventKind.X` the policy layer passes to an `Event` or a format move), each has a
style, and `lowprec report` draws a run that holds one event of each kind, read back from a
real MLflow (SQLite) store. The run's tags say its final state (the stage still promoted, a
regression that demoted nothing)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lowprec.policy
from lowprec.cli import main
from lowprec.policy.events import Event, EventKind, replay
from lowprec.tracking.report import render_report
from lowprec.tracking.report_sources import ReportData
from lowprec.tracking.report_timeline import EVENT_STYLE
from lowprec.tracking.tracker import Tracker

pytestmark = pytest.mark.usefixtures("mlflow_services")
SITES = tuple(f"blocks.{i}.{s}" for i in range(2) for s in ("attn.qkv", "mlp.fc"))
PICTURES = ["evals.png", "fallback_signals.png", "loss.png", "precision_timeline.png"]


def emitted_kinds() -> set[str]:
    """The kinds the policy layer creates events of: every `EventKind.NAME` passed to an
    `Event(...)` or to a move (`_move(..., kind, ...)`) anywhere under lowprec/policy."""
    kinds = set()
    for path in Path(lowprec.policy.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                    "Event", "_move"):
                for arg in ast.walk(node):
                    if (isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name)
                            and arg.value.id == "EventKind"):
                        kinds.add(getattr(EventKind, arg.attr))
    return kinds


def test_every_kind_the_controller_emits_is_known_and_has_a_style():
    kinds = emitted_kinds()
    assert {EventKind.WINDOW, EventKind.NOT_PRECISION, EventKind.REWIND, EventKind.GATE} <= kinds
    assert kinds <= set(EventKind.ALL)
    assert set(EVENT_STYLE) == set(EventKind.ALL)


def every_kind_run() -> ReportData:
    """A run with one event of each emitted kind, at its own step, in an order a run can have."""
    init = dict.fromkeys(SITES, "bf16")
    fc = tuple(s for s in SITES if s.endswith("mlp.fc"))
    s0 = fc[0]
    by_kind = {
        EventKind.PROMOTE: Event(10, EventKind.PROMOTE, fc, dict.fromkeys(fc, "bf16"), dict.fromkeys(fc, "fp8_tensorwise"),
                                 "stable for 10 steps", {}, "mlp_fp8"),
        EventKind.HOLD: Event(15, EventKind.HOLD, reason="lr sensitivity rising", stage="attn_fp8"),
        EventKind.REPLAY: Event(20, EventKind.REPLAY, fc, reason="replayed with 2 site(s) in high precision: clean"),
        EventKind.FALLBACK: Event(20, EventKind.FALLBACK, (s0,), {s0: "fp8_tensorwise"}, {s0: "bf16"},
                                  "grad_norm_spike gone", {}, "mlp_fp8"),
        EventKind.SKIP_STEP: Event(20, EventKind.SKIP_STEP, reason="grad_norm_spike: precision to blame"),
        EventKind.RETRY: Event(30, EventKind.RETRY, (s0,), {s0: "bf16"}, {s0: "fp8_tensorwise"}, "cooldown over",
                               {}, "mlp_fp8"),
        EventKind.ACCEPT: Event(33, EventKind.ACCEPT, reason="grad_norm_spike for 2 steps: accepted"),
        EventKind.INCONCLUSIVE: Event(35, EventKind.INCONCLUSIVE, reason="grad_norm_spike: inside the noise margin",
                                      evidence={"margins": {"grad_norm_spike": {"clear": False}}}),
        EventKind.WINDOW: Event(40, EventKind.WINDOW, fc, reason="loss_gap: window trained again closes 90% of the gap",
                                evidence={"high_precision": list(fc), "losses": [2.0], "closed": 0.9, "retrained": True}),
        EventKind.NOT_PRECISION: Event(40, EventKind.NOT_PRECISION, reason="loss_gap: not precision",
                                       evidence={"loss_gap": {"gap": 0.03, "threshold": 0.02, "step": 38},
                                                 "decided_by": "control_window"}),
        EventKind.GATE: Event(40, EventKind.GATE, reason="gate at eval checkpoint: regress",
                              evidence={"verdict": "regress", "detail": "eval loss +3%"}),
        EventKind.ROLLBACK: Event(50, EventKind.ROLLBACK, fc, dict.fromkeys(fc, "fp8_tensorwise"),
                                  dict.fromkeys(fc, "bf16"), "global signal: loss_spike", {"loss_spike": {"value": 9.0}},
                                  "mlp_fp8"),
        EventKind.QUARANTINE: Event(50, EventKind.QUARANTINE, fc, reason="stage rolled back 2 times", stage="mlp_fp8"),
        EventKind.REWIND: Event(50, EventKind.REWIND, reason="rewind after loss_spike", evidence={"skip_batches": 0}),
        EventKind.ROUTER_FAULT: Event(55, EventKind.ROUTER_FAULT, reason="router fault: blocks.1.mlp sent its tokens "
                                      "to few experts", evidence={"layer": "blocks.1.mlp", "router/collapse": 1.0}),
    }
    assert set(by_kind) == emitted_kinds()          # a new kind gets its event here
    events = sorted(by_kind.values(), key=lambda e: e.step)
    metrics = {"train/loss": [(s, 3.0 - s / 100) for s in range(0, 61)], "train/loss_rewound": [(50, 9.0)],
               "train/rewound_to": [(50, 40.0)], "eval/inloop/loss": [(45, 2.6)]}
    return ReportData("every-kind", init, 0, events, metrics)


def test_every_kind_is_drawn_in_every_picture(tmp_path):
    render_report(every_kind_run(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == PICTURES


def test_lowprec_report_draws_a_tracked_run_holding_every_kind(tmp_path, sqlite_store):
    data = every_kind_run()
    uri = sqlite_store(tmp_path / "store")
    tracker = Tracker(uri, "lowprec-tests", "every-kind", buffer_dir=tmp_path / "run", flush_interval_s=0.2,
                      retry_max_s=1.0, probe_timeout_s=1.0)
    tracker.log_precision(0, data.initial, {"bf16": 1.0})
    current = dict(data.initial)
    for step in range(0, 61):
        tracker.log_metrics(step, {k: v for k, series in data.metrics.items() for s, v in series if s == step})
        events = [e for e in data.events if e.step == step]
        if events:
            tracker.log_events(events)
            current = replay(current, events)
            tracker.log_precision(step, current, {f: sum(v == f for v in current.values()) / len(current)
                                                   for f in set(current.values())})
    assert tracker.finish("FINISHED", timeout=60)["pending"] == 0   # its own report drawn too
    from mlflow.tracking import MlflowClient
    tags = MlflowClient(uri).get_run(tracker.run_id).data.tags
    # from the final state: mlp_fp8 was rolled back (no stage is promoted at the end), and the
    # regression at step 40 was judged not precision's (nothing demoted)
    assert tags["lowprec.stage"] == "none" and "stage now **none**" in tags["mlflow.note.content"]
    assert tags["lowprec.gate"] == "regress (not precision: nothing demoted)"
    assert sorted(p.name for p in (tracker.files / "report").iterdir()) == PICTURES
    out = tmp_path / "pics"
    assert main(["report", tracker.run_id, "--tracking-uri", uri, "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == PICTURES
