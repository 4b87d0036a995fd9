"""The Tracker against real MLflow: a SQLite store, and an `mlflow server` on 127.0.0.1 that
the tests start, stop in the middle of a run and restart. Everything is checked through
MLflow's REST API with plain HTTP; the run page is rendered by headless Chromium.

One server serves the session (starting one takes 10-25 s; `mlflow_services`, conftest.py, launches it
when the first module that uses it starts, test_report.py, and the tests here wait for it). The rollout is real (a small
GPT prepared with lowprec, trained on text bytes), trained once; the other tests replay its
tracker calls step by step. Its events are constructed (tracking_helpers.run_rollout)
until the controller is wired in.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lowprec.base.writer_lock import WriterBusyError
from lowprec.policy.events import EventKind
from lowprec.tracking.outbox import Outbox
from lowprec.tracking.records import MAX_KEY, MAX_PARAM_VALUE, PrecisionMapLog, flatten_config, metric_key
from lowprec.tracking.tracker import Tracker
from tracking_helpers import FALLBACK_SITE, check_run_over_rest, png_colors, replay, run_and_record

ROOT = Path(__file__).resolve().parents[3]
CHROMIUM = Path("/usr/bin/chromium")
STEPS = 10
FAST = dict(flush_interval_s=0.2, retry_max_s=1.0, probe_timeout_s=1.0)


pytestmark = pytest.mark.usefixtures("mlflow_services")  # server and store start with the module


@pytest.fixture
def server(mlflow_services):
    mlflow_services.wait()
    return mlflow_services


# ------------------------------------------------------------------ no MLflow needed
def test_config_flattens_to_valid_mlflow_params():
    cfg = {"precision": {"rules": [{"format": "nvfp4", "select": {"glob": "blocks.*"}}], "fused": True},
           "lr": 3e-4, "none": None, "empty": [], "long": "x" * 7000, "k" * 300: 1, "odd key[1]": "v"}
    p = flatten_config(cfg)
    assert p["precision.rules.0.format"] == "nvfp4"           # MLflow refuses `[0]` in names
    assert p["precision.rules.0.select.glob"] == "blocks.*"
    assert p["precision.fused"] == "true" and p["lr"] == "0.0003" and p["none"] == "null" and p["empty"] == "[]"
    assert len(p["long"]) <= MAX_PARAM_VALUE and "truncated" in p["long"]
    assert all(len(k) <= MAX_KEY for k in p) and "odd key_1_" in p
    assert metric_key("signal//blocks.0.fc/./input/amax") == "signal/blocks.0.fc/input/amax"


def test_precision_map_of_a_resumed_run_is_the_uninterrupted_runs():
    """A run resumed from a checkpoint older than a change logs the checkpoint's map at the
    checkpoint's step (its start) and redoes the change: precision_map.json then held a revert and
    the change twice. The abandoned steps' changes go; the file equals the uninterrupted run's."""
    bf16, fp8 = {"a": "bf16", "b": "bf16"}, {"a": "fp8_tensorwise", "b": "bf16"}
    half, whole = {"fp8_tensorwise": 0.5, "bf16": 0.5}, {"bf16": 1.0}
    straight = PrecisionMapLog()
    for step, fm, sh in ((0, bf16, whole), (4, bf16, whole), (8, fp8, half), (12, fp8, half)):
        straight.update(step, fm, sh)
    first = PrecisionMapLog()
    for step, fm, sh in ((0, bf16, whole), (4, bf16, whole), (8, fp8, half)):
        first.update(step, fm, sh)
    resumed = PrecisionMapLog(json.loads(json.dumps(first.data)))   # killed at step 9, saved at step 6
    _, tags = resumed.update(6, bf16, whole)   # the checkpoint's map, at its step
    assert tags["lowprec.precision_map"] == "bf16(2): a, b" and resumed.data["changes"] == []
    assert resumed.update(8, fp8, half)[1]["lowprec.precision_map"] == "bf16(1): b | fp8_tensorwise(1): a"
    resumed.update(12, fp8, half)
    assert resumed.data == straight.data and resumed.data["changes"] == [{"step": 8, "formats": {"a": "fp8_tensorwise"}}]
    # steps redone after a rewind run in the map of the moment of the rewind: the change holds from them on
    resumed.update(7, fp8, half)
    assert resumed.data["changes"] == [{"step": 7, "formats": {"a": "fp8_tensorwise"}}]
    assert resumed.update(9, fp8, half)[1] is None   # no change, nothing abandoned: no tags to send


def test_rank_other_than_zero_does_nothing(tmp_path):
    t = Tracker("http://127.0.0.1:9", "e", "r", rank=1, buffer_dir=tmp_path / "buf")
    assert t.log_metrics(0, {"train/loss": 1.0}) is None and t.finish() is None
    assert t.run_id is None and not (tmp_path / "buf").exists()


def test_tracking_modules_do_not_import_mlflow_or_matplotlib():
    code = textwrap.dedent("""
        import sys, lowprec, lowprec.tracking
        import lowprec.tracking.tracker, lowprec.tracking.records, lowprec.tracking.outbox, lowprec.tracking.report
        import lowprec.tracking.report_sources, lowprec.tracking.report_timeline, lowprec.tracking.cli, lowprec.cli
        print(sorted(m for m in ("mlflow", "matplotlib") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_outbox_keeps_order_cuts_a_torn_line_and_reads_in_chunks(tmp_path):
    box = Outbox(tmp_path, writer=True)
    for i in range(300):
        box.append([{"op": "metrics", "metrics": [["train/loss", 1.0 / (i + 1), 0, i]]}])
    with open(box.path, "ab") as f:
        f.write(b'{"op":"metr')                    # a writer killed in the middle of a line
    reader = Outbox(tmp_path)                        # `lowprec sync` alongside: reads, never cuts
    assert reader.n_pending() == 300 and box.path.read_bytes().endswith(b'"metr')
    assert len(reader.pending(max_bytes=2000)) < 300 and len(reader.pending()) == 300
    assert [r["metrics"][0][3] for r, _ in reader.pending()] == list(range(300))
    with pytest.raises(WriterBusyError, match=f"pid {os.getpid()}"):   # one writer at a time
        Outbox(tmp_path, writer=True)
    box.close()                                      # the writer is gone (killed: the OS let go of its lock)
    assert Outbox(tmp_path, writer=True).n_pending() == 300 and box.path.read_bytes().endswith(b"}\n")


# ------------------------------------------------------------------ (a) SQLite store
def test_sqlite_store_gets_config_metrics_signals_events_and_report(tmp_path, sqlite_store):
    from mlflow.tracking import MlflowClient

    uri = sqlite_store(tmp_path / "store")
    tracker = Tracker(uri, "lowprec-tests", "sqlite-run", buffer_dir=tmp_path / "run", **FAST)
    r = run_and_record(tracker, STEPS)  # trained here; the server tests replay its tracker calls
    tracker.log_config({"train": {"lr": 1.0}})  # a changed param: refused, and nothing behind it blocked
    tracker.log_metrics(STEPS, {"train/after_refused": 1.0})
    st = tracker.finish("FINISHED", timeout=60)
    assert st["pending"] == 0, st
    client = MlflowClient(uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["precision.rules.1.format"] == "nvfp4"
    assert run.data.params["rollout.thresholds.max_underflow_frac"] == "0.01"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == list(range(STEPS))
    assert run.data.params["train.lr"] == "0.003" and run.data.metrics["train/after_refused"] == 1.0
    refused = [json.loads(x) for x in (tmp_path / "run" / "rejected.jsonl").read_text().splitlines()]
    assert [r["record"]["params"] for r in refused] == [{"train.lr": "1.0"}]
    assert any(k.startswith(f"signal/{FALLBACK_SITE}/input/") for k in run.data.metrics)
    share = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "precision/flops_share/nvfp4")}
    # the MLP sites are half the GEMM FLOPs (lm_head, no site, counts as bf16); one MLP site's fallback shows
    assert 0 not in share and share[4] == 0.5 and 0 < share[5] < share[4]
    assert client.get_metric_history(run.info.run_id, "precision/flops_share/bf16")[0].value == pytest.approx(1.0)
    assert "eval/next_byte/acc" in run.data.metrics and "eval/next_byte/acc_stderr" in run.data.metrics
    tags = run.data.tags
    assert tags["lowprec.stage"] == "mlp_fp4" and tags["lowprec.fallbacks"] == "1"
    assert tags["lowprec.gate"] == "pass" and FALLBACK_SITE in tags["lowprec.fallback_sites"]
    assert "nvfp4(3)" in tags["lowprec.precision_map"] and "fallback" in tags["mlflow.note.content"]
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "events.jsonl", "events.json", "precision_map.json", "evals.jsonl", "report"} <= names
    pics = {a.path for a in client.list_artifacts(run.info.run_id, "report")}
    assert {"report/precision_timeline.png", "report/loss.png", "report/fallback_signals.png",
            "report/evals.png"} <= pics
    assert run.info.artifact_uri.startswith((tmp_path / "store" / "mlruns").as_uri())  # next to the store
    pmap = json.loads(Path(client.download_artifacts(run.info.run_id, "precision_map.json", str(tmp_path))).read_text())
    assert pmap["final"][FALLBACK_SITE] == "fp8_tensorwise" and pmap["initial"][FALLBACK_SITE] == "bf16"
    # Logging never made training wait: every tracker call returned at once.
    assert max(r.log_seconds) < 1.0, sorted(r.log_seconds)[-5:]


# ------------------------------------------------------------------ (b, c) a real server
def test_server_run_has_everything_over_rest_and_renders_in_the_ui(server, tmp_path):
    tracker = Tracker(server.url, "lowprec-tests", "server-run", buffer_dir=tmp_path / "run", **FAST)
    r = replay(tracker, STEPS)
    assert tracker.finish("FINISHED", timeout=60)["pending"] == 0
    assert [e.kind for e in r.events] == [EventKind.PROMOTE, EventKind.PROMOTE, EventKind.FALLBACK, EventKind.GATE]
    run = check_run_over_rest(server, tracker.run_id, list(range(STEPS)), r.events, report=True)
    assert run["info"]["status"] == "FINISHED"
    png = server.raw("/get-artifact", path="report/precision_timeline.png", run_uuid=tracker.run_id)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000

    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is not installed (make test installs Debian's chromium where apt-get works)")
    shot = tmp_path / "run_page.png"
    url = f"{server.url}/#/experiments/{run['info']['experiment_id']}/runs/{tracker.run_id}"
    out = subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                          "--disable-component-update", "--disable-sync", "--no-first-run",
                          f"--user-data-dir={tmp_path / 'chromium'}", "--virtual-time-budget=15000",
                          f"--screenshot={shot}", "--window-size=1400,1000", url],
                         capture_output=True, text=True, timeout=120)
    assert shot.exists(), out.stderr[-2000:]
    data = shot.read_bytes()
    w, h, colors = png_colors(data)
    assert (w, h) == (1400, 1000)
    # A blank or error page is a few flat colours; the rendered run page has text, icons and tags.
    assert len(data) > 60_000 and colors > 300, (len(data), colors)
    shutil.copy(shot, tmp_path.parent / "run_page_latest.png")  # kept next to the test's tmp dirs to look at


@pytest.mark.slow   # stops and restarts the MLflow server while the run paces its steps
def test_server_stopped_mid_run_then_restarted_loses_nothing(server, tmp_path):
    tracker = Tracker(server.url, "lowprec-tests", "restart-run", buffer_dir=tmp_path / "run", **FAST)
    seen = {}

    def on_step(step):
        if step == 3:  # what was logged so far is on the server, then it goes away
            assert tracker.flush(timeout=30)
            server.stop()
        if step == 7:  # training went on while the server was away; it comes back
            st = tracker.status()
            seen["pending_while_away"] = st["pending"] + st["queued"]
            seen["online_while_away"] = st["online"]
            server.start()
            deadline = time.monotonic() + 30  # sent automatically, without sync()
            while tracker.status()["pending"] and time.monotonic() < deadline:
                time.sleep(0.1)
            seen["pending_after_restart"] = tracker.status()["pending"]

    r = replay(tracker, STEPS, on_step=on_step, step_seconds=0.3)
    assert seen["pending_while_away"] > 0 and seen["online_while_away"] is False
    assert seen["pending_after_restart"] == 0
    assert max(r.log_seconds) < 1.0, sorted(r.log_seconds)[-5:]  # training never waited for the server
    assert tracker.finish("FINISHED", timeout=60, report=False)["pending"] == 0
    assert tracker.sync(timeout=30).pending == 0
    run = check_run_over_rest(server, tracker.run_id, list(range(STEPS)), r.events)
    assert run["info"]["status"] == "FINISHED"


def test_server_away_at_start_then_lowprec_sync_sends_the_buffer(server, tmp_path, free_port):
    """The run cannot even be created; training goes on; `lowprec sync RUN_DIR` sends it all."""
    dead = f"http://127.0.0.1:{free_port()}"
    tracker = Tracker(dead, "lowprec-tests", "offline-run", buffer_dir=tmp_path / "run", **FAST)
    r = replay(tracker, STEPS)
    tracker.log_metrics(0, {"bad": "not a number"})  # a caller's mistake is a warning, not a crash
    t = time.monotonic()
    st = tracker.finish("FINISHED", timeout=2, report=False)
    assert time.monotonic() - t < 30 and st["pending"] > 0 and tracker.run_id is None
    from lowprec.cli import main
    assert main(["sync", str(tmp_path / "run"), "--tracking-uri", server.url]) == 0
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    run = check_run_over_rest(server, info["run_id"], list(range(STEPS)), r.events)
    assert run["info"]["status"] == "FINISHED" and run["info"]["run_name"] == "offline-run"
    assert main(["sync", str(tmp_path / "run"), "--tracking-uri", server.url]) == 0  # nothing left, nothing twice
    assert sorted(m["step"] for m in server.history(info["run_id"], "train/loss")) == list(range(STEPS))
