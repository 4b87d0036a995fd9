"""Report pictures: a 30-layer rollout's timeline is drawn with every format and marker;
`lowprec report RUN_ID` draws the same data read back from an MLflow (SQLite) store as the
tracker's local journal holds; `lowprec ui` serves a local store on 127.0.0.1 only."""

from __future__ import annotations

import json
import math
import random

import pytest

from lowprec.cli import main
from lowprec.policy.events import Event, EventKind, replay
from lowprec.tracking.report import FORMAT_COLORS, render_report
from lowprec.tracking.report_sources import ReportData, events_table, events_tags, from_mlflow, from_run_dir, signals_of
from lowprec.tracking.tracker import Tracker
from tracking_helpers import png_colors

FAST = dict(flush_interval_s=0.2, retry_max_s=1.0, probe_timeout_s=1.0)
# The MLflow store template and the server test_tracking.py uses start now, in the background.
pytestmark = pytest.mark.usefixtures("mlflow_services")


def thirty_layer_rollout(n_layer: int = 30, last: int = 2000) -> ReportData:
    """Stages, two fallbacks, a retry, a quarantine, a rollback with a rewind, three gates."""
    sites = [f"blocks.{i}.{s}" for i in range(n_layer) for s in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]
    init = {s: "bf16" for s in sites}
    mlp, attn = [s for s in sites if ".mlp." in s], [s for s in sites if ".attn." in s]
    mid = [s for s in mlp if 2 <= int(s.split(".")[1]) < n_layer - 2]

    def promote(step, stage, ss, frm, to):
        return Event(step, EventKind.PROMOTE, tuple(ss), dict.fromkeys(ss, frm), dict.fromkeys(ss, to),
                     "stable for 200 steps", {}, stage)

    s1, s2 = f"blocks.{n_layer - 3}.mlp.proj", "blocks.3.mlp.fc"
    ev = [promote(200, "mlp_fp8", mlp, "bf16", "fp8_tensorwise"),
          Event(550, EventKind.GATE, reason="gate: pass", evidence={"verdict": "pass"}, stage="attn_fp8"),
          promote(600, "attn_fp8", attn, "bf16", "fp8_tensorwise"),
          Event(950, EventKind.GATE, reason="gate: pass", evidence={"verdict": "pass"}, stage="mid_mlp_nvfp4"),
          promote(1000, "mid_mlp_nvfp4", mid, "fp8_tensorwise", "nvfp4"),
          Event(1150, EventKind.FALLBACK, (s1,), {s1: "nvfp4"}, {s1: "fp8_tensorwise"}, "site thresholds crossed",
                {"input/saturated_frac": 0.031}, "mid_mlp_nvfp4"),
          Event(1300, EventKind.FALLBACK, (s2,), {s2: "nvfp4"}, {s2: "fp8_tensorwise"}, "underflow",
                {"signal": "underflow_frac", "role": "grad_output", "value": 0.22, "threshold": 0.15}, "mid_mlp_nvfp4"),
          Event(1400, EventKind.RETRY, (s1,), {s1: "fp8_tensorwise"}, {s1: "nvfp4"}, "cooldown over", {}, "mid_mlp_nvfp4"),
          Event(1500, EventKind.FALLBACK, (s1,), {s1: "nvfp4"}, {s1: "fp8_tensorwise"}, "site thresholds crossed",
                {"input/saturated_frac": 0.045}, "mid_mlp_nvfp4"),
          Event(1500, EventKind.QUARANTINE, (s1,), reason="2 fallbacks", stage="mid_mlp_nvfp4")]
    fp4 = [s for s, f in replay(init, ev).items() if f == "nvfp4"]
    ev += [Event(1700, EventKind.ROLLBACK, tuple(fp4), dict.fromkeys(fp4, "nvfp4"), dict.fromkeys(fp4, "fp8_tensorwise"),
                 "global signal: loss_spike", {"loss_spike": {"value": 3.9}}, "mid_mlp_nvfp4"),
           Event(1700, EventKind.REWIND, reason="rewind after loss_spike", evidence={"to_step": 1600, "skip_batches": 100}),
           Event(1900, EventKind.GATE, reason="gate: regress", evidence={"verdict": "regress"}, stage="late")]
    rnd = random.Random(0)
    base = [(s, 2 + 3.5 * math.exp(-s / 300)) for s in range(0, last + 1, 10)]
    loss = [(s, b * (1.01 if s >= 1000 else 1) + (0.5 if 1650 < s < 1710 else 0) + rnd.gauss(0, 0.01)) for s, b in base]
    metrics = {"train/loss": loss, "train/baseline_loss": base}
    for f in ("bf16", "fp8_tensorwise", "nvfp4"):
        metrics[f"precision/flops_share/{f}"] = [(s, sum(v == f for v in replay(init, ev, s).values()) / len(init))
                                                 for s in range(0, last + 1, 50)]
    for site, key in ((s1, "input/saturated_frac"), (s2, "grad_output/underflow_frac")):
        metrics[f"signal/{site}/{key}"] = [(s, 0.004 * (1 + max(0, s - 1000) / 150) + rnd.random() * 1e-3)
                                           for s in range(0, last + 1, 50)]
    for task in ("hellaswag", "arc_easy"):
        metrics[f"eval/{task}/acc"] = [(s, 0.3 + s / 1e5) for s in (500, 1000, 1500, 2000)]
        metrics[f"eval/{task}/acc_stderr"] = [(s, 0.008) for s in (500, 1000, 1500, 2000)]
    return ReportData("gpt30", init, 0, ev, metrics, base, {"saturated_frac": 0.01})


def _has_color(png: bytes, hex_color: str, tol: int = 6) -> bool:
    import io

    import matplotlib.image
    import numpy as np
    img = (np.asarray(matplotlib.image.imread(io.BytesIO(png), format="png"))[..., :3] * 255).round()
    want = np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(img - want).max(-1) <= tol).sum()) > 500


@pytest.mark.slow
def test_thirty_layer_timeline_and_the_other_pictures(tmp_path):
    data = thirty_layer_rollout()
    paths = render_report(data, tmp_path)
    assert [p.name for p in paths] == ["precision_timeline.png", "loss.png", "fallback_signals.png", "evals.png"]
    timeline = paths[0].read_bytes()
    w, h, colors = png_colors(timeline)
    assert 1200 <= w <= 1600 and 1000 <= h <= 2000, (w, h)  # one row per site, still one screen wide
    assert colors > 100
    for fmt in ("bf16", "fp8_tensorwise", "nvfp4"):
        assert _has_color(timeline, FORMAT_COLORS[fmt]), fmt
    for p in paths[1:]:
        assert png_colors(p.read_bytes())[2] > 50, p.name
    # the fallback's signal comes from the controller-style evidence plus the configured threshold
    fb = next(e for e in data.events if e.kind == EventKind.FALLBACK)
    assert signals_of(fb, fb.sites[0], data.thresholds) == [
        {"role": "input", "signal": "saturated_frac", "value": 0.031, "threshold": 0.01}]


def test_event_tags_and_table_summarise_the_rollout():
    events = thirty_layer_rollout().events
    tags = events_tags(events, "gpt30")
    # the newest stage still promoted at the end: mid_mlp_nvfp4 was rolled back at step 1700
    assert tags["lowprec.stage"] == "attn_fp8" and tags["lowprec.fallbacks"] == "3"
    assert tags["lowprec.quarantined"] == "blocks.27.mlp.proj" and tags["lowprec.gate"] == "regress"
    assert tags["lowprec.rewinds"] == "1" and tags["lowprec.rollbacks"] == "1"
    assert "| 1700 | rewind |" in tags["mlflow.note.content"]
    table = events_table(events)
    assert len(table["data"]) == len(events) and table["data"][0][4:6] == ["bf16", "fp8_tensorwise"]
    json.dumps(table)


def feed(tracker: Tracker, data: ReportData) -> None:
    """What a training loop would have logged to end up with `data`."""
    tracker.log_config({"rollout": {"thresholds": {"max_saturated_frac": data.thresholds["saturated_frac"]}}})
    tracker.log_precision(data.initial_step, data.initial, {"bf16": 1.0})
    by_step: dict[int, dict] = {}
    for key, series in data.metrics.items():
        if not key.startswith("precision/"):
            for step, v in series:
                by_step.setdefault(step, {})[key] = v
    current = dict(data.initial)
    for step in sorted(by_step.keys() | {e.step for e in data.events}):
        tracker.log_metrics(step, by_step.get(step, {}))
        events = [e for e in data.events if e.step == step]
        if events:
            tracker.log_events(events)
            current = replay(current, events)
            share = {f: sum(v == f for v in current.values()) / len(current) for f in set(current.values())}
            tracker.log_precision(step, current, share)


def test_lowprec_report_reads_the_run_back_from_mlflow(tmp_path, sqlite_store):
    from mlflow.tracking import MlflowClient

    data = thirty_layer_rollout()
    uri = sqlite_store(tmp_path / "store")
    tracker = Tracker(uri, "lowprec-tests", "report-run", buffer_dir=tmp_path / "run", **FAST)
    feed(tracker, data)
    assert tracker.finish("FINISHED", timeout=60, report=False)["pending"] == 0
    out = tmp_path / "pics"
    assert main(["report", tracker.run_id, "--tracking-uri", uri, "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["evals.png", "fallback_signals.png", "loss.png",
                                                      "precision_timeline.png"]
    remote, local = from_mlflow(MlflowClient(uri), tracker.run_id), from_run_dir(tmp_path / "run")
    assert remote.events == local.events == data.events
    assert remote.initial == local.initial == data.initial
    assert remote.metrics == local.metrics and remote.thresholds == local.thresholds == data.thresholds
    assert remote.metrics["train/loss"] == data.metrics["train/loss"] and remote.baseline == data.baseline
    assert remote.metrics.keys() >= {k for k in data.metrics if not k.startswith("precision/")}
    assert main(["report", "no-such-run", "--tracking-uri", uri, "--out", str(out)]) == 2


def test_lowprec_report_on_a_store_that_is_not_there_creates_none(tmp_path, capsys):
    """A mistyped --tracking-uri: exit 2 naming the path, and no empty store made there."""
    typo = tmp_path / "mlfow.db"
    assert main(["report", "0" * 32, "--tracking-uri", f"sqlite:///{typo}", "--out", str(tmp_path / "r")]) == 2
    assert f"there is no tracking store at {typo}" in capsys.readouterr().err
    assert not typo.exists() and not (tmp_path / "r").exists()


def test_lowprec_ui_serves_a_local_store_on_localhost_only(capsys):
    assert main(["ui", "--tracking-uri", "sqlite:///runs/mlflow.db", "--port", "5055", "--dry-run"]) == 0
    cmd = capsys.readouterr().out.split()
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "5055"
    assert cmd[cmd.index("--backend-store-uri") + 1] == "sqlite:///runs/mlflow.db" and "server" in cmd
    assert main(["ui", "--tracking-uri", "http://example.org:5000"]) == 2


def test_lowprec_sync_of_a_folder_that_is_no_buffer_exits_2(tmp_path, capsys):
    assert main(["sync", str(tmp_path / "nothing")]) == 2
    assert "run.json" in capsys.readouterr().err
