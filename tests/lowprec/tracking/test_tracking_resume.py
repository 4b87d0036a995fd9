"""A tracking buffer folder holds one run: continued only on resume and only when it did not
finish (issue 12, items 1 and 2). The Tracker on its own (a server that is not there: only the
journal is looked at), a FAILED run reopened in a SQLite store, and `lowprec run` killed with
SIGKILL then resumed with `--resume`, as processes forked from the session's pre-imported server
(`lowprec_forks`, tests/cli_forks.py).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from lowprec.policy.events import Event, EventKind
from lowprec.tracking.resume import BufferInUseError, RunState, buffered_run
from lowprec.tracking.tracker import Tracker
from tests.snapshots import folder_snapshot

ROOT = Path(__file__).resolve().parents[3]
DEAD = "http://127.0.0.1:9"   # nothing listens: records stay in the journal
FAST = dict(flush_interval_s=0.2, retry_max_s=1.0, probe_timeout_s=0.5)
EVENT = Event(2, EventKind.SKIP_STEP, (), reason="loss spike")


def _journal(d: Path) -> list[dict]:
    return [json.loads(x) for x in (d / "outbox.jsonl").read_text().splitlines()]


def _points(d: Path, key: str) -> list[int]:
    return [m[3] for r in _journal(d) if r["op"] == "metrics" for m in r["metrics"] if m[0] == key]


def _tags(journal: list[dict]) -> dict[str, str]:
    """The run's tags once the journal is sent: each record's tags, the later ones winning."""
    return {k: v for r in journal if r["op"] == "tags" for k, v in r["tags"].items()}


def _killed_run(buf: Path, steps: range) -> None:
    """A process that tracks `steps` and an event, then is killed with SIGKILL (no finish)."""
    code = textwrap.dedent(f"""
        import os, signal
        from lowprec.policy.events import Event, EventKind
        from lowprec.tracking.tracker import Tracker
        t = Tracker({DEAD!r}, "e", "first", buffer_dir={str(buf)!r})
        for s in {list(steps)!r}:
            t.log_metrics(s, {{"train/loss": 1.0 / (s + 1)}})
        t.log_events([Event(2, EventKind.SKIP_STEP, (), reason="loss spike")])
        t._journal_flush(30)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr


def test_a_finished_run_is_never_continued(tmp_path):
    buf = tmp_path / "tracking"
    t = Tracker(DEAD, "e", "first", buffer_dir=buf, **FAST)
    t.log_metrics(0, {"train/loss": 1.0})
    t.finish("FINISHED", timeout=0.5, report=False)
    assert buffered_run(buf)[0] is RunState.FINISHED
    # the lock files name their latest holder (a refused tracker held them for a moment)
    before = {p: p.read_bytes() for p in buf.rglob("*") if p.is_file() and p.suffix != ".lock"}
    for resume in (False, True):   # a second run, even one that asks to resume, is refused
        with pytest.raises(BufferInUseError, match="finished; a finished run is never continued") as e:
            Tracker(DEAD, "e", "second", buffer_dir=buf, resume=resume, **FAST)
        assert "another --out" in str(e.value) and "'first'" in str(e.value)
    assert {p: p.read_bytes() for p in buf.rglob("*") if p.is_file() and p.suffix != ".lock"} == before


def test_a_killed_run_continues_only_on_resume_without_logging_a_step_twice(tmp_path):
    buf = tmp_path / "tracking"
    _killed_run(buf, range(6))
    assert buffered_run(buf)[0] is RunState.UNFINISHED
    with pytest.raises(BufferInUseError, match="stopped without finishing .*--resume"):
        Tracker(DEAD, "e", "first", buffer_dir=buf, **FAST)
    t = Tracker(DEAD, "e", "first", buffer_dir=buf, resume=True, **FAST)
    for s in range(4, 10):   # redone from the checkpoint at step 4
        t.log_metrics(s, {"train/loss": 1.0 / (s + 1)})
        if s == 4:
            t.log_events([EVENT])                                       # the same event again: kept once
            t.log_events([Event(4, EventKind.SKIP_STEP, (), reason="new")])  # a new one
    t.finish("FINISHED", timeout=0.5, report=False)
    assert _points(buf, "train/loss") == list(range(10))
    assert [json.loads(x)["step"] for x in (buf / "events.jsonl").read_text().splitlines()] == [2, 4]
    journal = _journal(buf)
    assert [r["op"] for r in journal].count("create_run") == 1 and journal[-1]["op"] == "terminate"
    assert buffered_run(buf)[0] is RunState.FINISHED


@pytest.mark.parametrize("snapshot", ["events.jsonl", "precision_map.json"])
def test_a_snapshot_written_but_not_journaled_is_uploaded_on_resume(tmp_path, snapshot):
    """Killed after the journal thread wrote a snapshot (the event log and files/events.jsonl, or
    files/precision_map.json) and before it journaled the upload: the resumed run logs the same
    event and map again, which are already there, so nothing new is written. The kill-and-resume
    campaign found it (the finished run had no events.jsonl artifact); now a resume journals every
    snapshot of the buffer again, with the tags made from them."""
    buf = tmp_path / "tracking"
    code = textwrap.dedent(f"""
        import os, signal
        from lowprec.policy.events import Event, EventKind
        from lowprec.tracking.tracker import Tracker
        t = Tracker({DEAD!r}, "e", "first", buffer_dir={str(buf)!r})
        t.log_precision(0, {{"a": "bf16", "b": "bf16"}}, {{"bf16": 1.0}})
        t._journal_flush(30)
        append = t.outbox.append
        def dying(recs):   # the kill, between the snapshot's write and its journal line
            if any(r.get("file") == "files/{snapshot}" for r in recs):
                os.kill(os.getpid(), signal.SIGKILL)
            append(recs)
        t.outbox.append = dying
        if {snapshot!r} == "events.jsonl":
            t.log_events([Event(2, EventKind.SKIP_STEP, (), reason="loss spike")])
        else:
            t.log_precision(1, {{"a": "fp8_tensorwise", "b": "bf16"}}, {{"fp8_tensorwise": 0.5, "bf16": 0.5}})
        t._journal_flush(30)
    """)
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert (buf / "files" / snapshot).is_file()
    before = _tags(_journal(buf))   # written, its upload never journaled: the journal has the old tags
    assert "loss spike" not in json.dumps(before) and before["lowprec.precision_map"] == "bf16(2): a, b"
    if snapshot == "events.jsonl":
        assert not any(r.get("file") == f"files/{snapshot}" for r in _journal(buf))

    t = Tracker(DEAD, "e", "first", buffer_dir=buf, resume=True, **FAST)   # redone from a checkpoint at step 1
    if snapshot == "events.jsonl":   # the map as it was, the event again
        t.log_events([EVENT])
        t.log_precision(1, {"a": "bf16", "b": "bf16"}, {"bf16": 1.0})
    else:                            # the map as the killed life changed it
        t.log_precision(1, {"a": "fp8_tensorwise", "b": "bf16"}, {"fp8_tensorwise": 0.5, "bf16": 0.5})
    t.finish("FINISHED", timeout=0.5, report=False)
    journal = _journal(buf)
    assert any(r.get("file") == f"files/{snapshot}" for r in journal)
    tags = _tags(journal)
    if snapshot == "events.jsonl":
        assert [json.loads(x)["step"] for x in (buf / "files" / snapshot).read_text().splitlines()] == [2]
        assert "loss spike" in json.dumps(tags)
    else:
        assert tags["lowprec.precision_map"] == "bf16(1): b | fp8_tensorwise(1): a"
        assert tags["lowprec.flops_share"] == "fp8_tensorwise 50.0%, bf16 50.0%"


def test_a_failed_run_is_reopened_and_closed_finished(tmp_path, sqlite_store):
    from mlflow.tracking import MlflowClient
    uri = sqlite_store(tmp_path / "store")
    buf = tmp_path / "tracking"
    t = Tracker(uri, "resume", "r", buffer_dir=buf, **FAST)
    for s in range(3):
        t.log_metrics(s, {"train/loss": float(s)})
    assert t.finish("FAILED", timeout=60, report=False)["pending"] == 0
    client = MlflowClient(uri)
    run_id = t.run_id
    assert client.get_run(run_id).info.status == "FAILED"
    t = Tracker(uri, "resume", "r", buffer_dir=buf, resume=True, **FAST)
    for s in range(1, 5):
        t.log_metrics(s, {"train/loss": float(s)})
    assert t.flush(timeout=60) and client.get_run(run_id).info.status == "RUNNING"
    assert t.finish("FINISHED", timeout=60, report=False)["pending"] == 0
    assert t.run_id == run_id and client.get_run(run_id).info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == list(range(5))
    exp = client.get_experiment_by_name("resume")
    assert len(client.search_runs([exp.experiment_id])) == 1


# ------------------------------------------------------------------ `lowprec run`, killed and resumed
STEPS = 12


_tree = folder_snapshot


@pytest.mark.slow   # three `lowprec run` processes
def test_lowprec_run_killed_then_resumed_continues_and_closes_the_same_run(tmp_path, sqlite_store, tiny_lm,
                                                                           lowprec_forks):
    from mlflow.tracking import MlflowClient
    uri = sqlite_store(tmp_path / "store")
    tiny_lm(tmp_path, "slowlm")
    cfg = {"model": {"factory": "slowlm:build", "args": {"width": 16, "step_seconds": 0.3}},
           "data": {"factory": "slowlm:tokens", "block_size": 8},
           "train": {"steps": STEPS, "batch_size": 2, "warmup": 1, "ckpt_every": 4, "log_every": 1},
           "precision": {"backend": "emulated", "default": "bf16", "rules": []},
           "tracking": {"uri": uri, "experiment": "killed", "run_name": "k"}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    out, buf = tmp_path / "out", tmp_path / "out" / "tracking"
    p = lowprec_forks.start(["run", "run.yaml", "--out", "out"], tmp_path)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and p.poll() is None:   # the run exists and step 6 is logged: kill it
        info = json.loads((buf / "run.json").read_text()) if (buf / "run.json").exists() else {}
        if info.get("run_id") and (buf / "outbox.jsonl").exists() and max(_points(buf, "train/loss"), default=-1) >= 6:
            break
        time.sleep(0.1)
    assert p.poll() is None, p.communicate()[1][-3000:]
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=60)
    run_id = info["run_id"]
    client = MlflowClient(uri)
    time.sleep(0.5)
    assert client.get_run(run_id).info.status == "RUNNING"

    p = lowprec_forks.start(["run", "run.yaml", "--out", "out", "--resume"], tmp_path)
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stderr[-3000:]
    assert (out / "run_id").read_text().strip() == run_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "k"
    for key in ("train/loss", "train/grad_norm"):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == list(range(STEPS)), key
    assert len(client.search_runs([client.get_experiment_by_name("killed").experiment_id])) == 1

    # Resuming the finished run again: refused before anything is done, nothing written anywhere.
    before, store = _tree(tmp_path), _tree(tmp_path / "store")
    p = lowprec_forks.start(["run", "run.yaml", "--out", "out", "--resume"], tmp_path)
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.startswith("lowprec run: ") and run_id in stderr and "which finished" in stderr, stderr
    assert _tree(tmp_path) == before and _tree(tmp_path / "store") == store
    assert client.get_run(run_id).info.status == "FINISHED"
