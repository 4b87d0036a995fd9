"""A tracking server that answers /health but never the API (issue 12, item 5): `lowprec gate`,
`report` and `sync` exit 2 within --timeout, naming the server, and write nothing. The server
is a few lines of http.server on 127.0.0.1 in this process; the commands run as subprocesses.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from lowprec.tracking.outbox import Outbox
from tests.snapshots import folder_snapshot

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT_S = 3


class _Hangs(BaseHTTPRequestHandler):
    def _answer(self):
        if self.path.split("?")[0] == "/health":
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"OK")
            return
        self.server.requests.append(self.path)
        self.server.release.wait(600)   # never answers while the test runs

    do_GET = do_POST = do_PATCH = do_DELETE = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def hanging_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Hangs)
    srv.daemon_threads, srv.release, srv.requests = True, threading.Event(), []
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.release.set()
    srv.shutdown()
    srv.server_close()


_tree = folder_snapshot


@pytest.mark.slow   # it waits out three deadlines (about 7 s)
def test_gate_report_and_sync_give_up_on_a_server_that_never_answers(tmp_path, hanging_server):
    srv, url = hanging_server
    buf = tmp_path / "buf"
    box = Outbox(buf, writer=True)
    box.write_info(uid="u" * 32, tracking_uri=url, experiment="e", run_name="r")
    box.append([{"op": "create_run", "experiment": "e", "run_name": "r", "uid": "u" * 32, "start_time": 0,
                 "tags": {}},
                {"op": "metrics", "metrics": [["train/loss", 1.0, 0, 0]]}])
    box.close()   # the writer is gone: `sync` may send what it left
    before = _tree(tmp_path)
    run_id = "0123456789abcdef0123456789abcdef"
    commands = {
        "gate": ["gate", "--baseline", run_id, "--candidate", run_id, "--gates", str(ROOT / "gates/default.yaml"),
                 "--tracking-uri", url, "--markdown", "summary.md", "--junit", "junit.xml"],
        "report": ["report", run_id, "--tracking-uri", url],
        "sync": ["sync", str(buf)],
    }
    procs = {name: (time.monotonic(), subprocess.Popen(
        [sys.executable, "-m", "lowprec.cli", *args, "--timeout", str(TIMEOUT_S)], cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)) for name, args in commands.items()}
    for name, (t0, p) in procs.items():
        try:
            _, err = p.communicate(timeout=120)   # without a timeout: MLflow retries for many minutes
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            pytest.fail(f"lowprec {name} was still waiting after 120 s")
        took = time.monotonic() - t0
        assert p.returncode == 2 and "Traceback" not in err, (name, err[-3000:])
        assert err.startswith(f"lowprec {name}: the tracking store {url} did not answer in {TIMEOUT_S} s (while "), err
        assert "--timeout" in err and took < 60, (name, took)
    assert "1 records stay buffered" in err or "2 records stay buffered" in err, err
    assert srv.requests, "the commands never got past /health"
    assert _tree(tmp_path) == before   # no report folder, no summary, no junit, the buffer as it was


def test_timeout_must_be_positive(tmp_path, monkeypatch, capsys):
    from lowprec.cli import main
    monkeypatch.chdir(tmp_path)
    assert main(["report", "x", "--tracking-uri", "http://127.0.0.1:9", "--timeout", "0"]) == 2
    assert "--timeout must be > 0 seconds, got 0" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
