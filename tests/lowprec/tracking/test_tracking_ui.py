"""`lowprec ui` (issue 12, item 9): stopping it stops the MLflow server it started, workers
included; a folder with no store is an exit 2 that creates nothing; the UI hint `lowprec run`
prints is a command `lowprec ui` accepts.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from lowprec.cli import main
from lowprec.runtime.trainer.loop import RunResult
from lowprec.runtime.trainer.run_summary import summary_text


def _lowprec(cwd: Path, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lowprec.cli", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def test_no_store_is_an_error_and_creates_nothing(tmp_path):
    p = _lowprec(tmp_path, "ui", "--port", str(_free_port()), start_new_session=True)
    try:
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:   # it serves (an empty store it created): stop what it started
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        pytest.fail("lowprec ui served a folder that has no store")
    assert p.returncode == 2 and "Traceback" not in err, err
    assert err.startswith(f"lowprec ui: there is no tracking store at {tmp_path / 'mlflow.db'}"), err
    assert list(tmp_path.iterdir()) == []   # no mlflow.db, no mlruns, no mlartifacts


@pytest.mark.parametrize("uri", ["http://127.0.0.1:5000", "https://mlflow.example.org", "sqlite:///{store}"])
def test_the_ui_hint_of_a_run_summary_is_a_command_lowprec_ui_accepts(tmp_path, monkeypatch, capsys, uri):
    (tmp_path / "mlflow.db").write_bytes(b"")
    uri = uri.format(store=tmp_path / "mlflow.db")
    res = RunResult(losses=[1.0, 0.5], seconds_per_step=0.1)
    text = summary_text("r", res, SimpleNamespace(baseline=None), tmp_path, "a" * 32, uri)
    hint = next(line for line in text.splitlines() if "UI:" in line)
    assert uri in hint
    monkeypatch.chdir(tmp_path)
    for cmd in re.findall(r"lowprec (ui [^ ]+ [^ ]+)", hint):
        capsys.readouterr()
        assert main(shlex.split(cmd) + ["--dry-run"]) == 0, capsys.readouterr().err
    if uri.startswith("http"):
        assert "lowprec ui" not in hint   # a server is opened as it is


def _children(pid: int) -> set[int]:
    """Every live descendant of `pid` (read from /proc)."""
    parents = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            parents[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = {c for c, pp in parents.items() if pp == p}
        out |= kids
        todo += kids
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.mark.slow   # starts an MLflow server (10-25 s)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stopping_lowprec_ui_stops_the_server_it_started(tmp_path, sqlite_store, sig):
    uri = sqlite_store(tmp_path / "store")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    ui = _lowprec(tmp_path, "ui", "--tracking-uri", uri, "--port", str(port), start_new_session=True)
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 180
        while not _answers(url):
            assert ui.poll() is None and time.monotonic() < deadline, ui.communicate()[1][-3000:]
            time.sleep(0.3)
        started = _children(ui.pid)
        assert started, "lowprec ui started no server process"
        ui.send_signal(sig)   # to lowprec ui only, as `kill` does (Ctrl+C reaches only its process group)
        ui.communicate(timeout=60)
        assert ui.returncode == 0
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in started if _alive(p)], "the MLflow server outlived lowprec ui"
        assert not _answers(url)
    finally:
        for p in started | _children(ui.pid):
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        if ui.poll() is None:
            ui.kill()
            ui.communicate()
