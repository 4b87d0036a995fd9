"""`lowprec` command lines run as processes forked from one that has imported lowprec already.

A `lowprec run` process spends its first seconds of CPU importing torch, MLflow, lm-eval and
lowprec before it trains a step; a campaign that starts twenty of them and kills each within
seconds spends most of its time there. `CliForks` starts one server (this file, run as a
script) that imports `lowprec.cli` and what `lowprec run` imports later (PRELOAD), then forks a
child per command line. The child points its stdin at /dev/null and its stdout and stderr at
files, sets `sys.argv` as `python -m lowprec.cli ARGS` would, and runs
`sys.exit(lowprec.cli.main(ARGS))` at the top of its interpreter, so its exit (atexit
handlers, the interpreter's shutdown) is a `python -m lowprec.cli` exit. It is a process of
its own: SIGKILL ends it with nothing flushed and its file locks let go, as it would end a
`lowprec run` started by exec. Nothing is shared with the server after the fork: the server
opens no store, starts no thread and runs no torch operation.

Only the server's children can be waited on, so the server also answers `poll` and `wait`.

The test session shares one server (`lowprec_forks` in tests/conftest.py, started by the first
test that asks for it): tests that start `lowprec` only to read its output, files and exit code
fork it from there (`run`, like `subprocess.run`; `start`, like `subprocess.Popen`); `module=`
runs another module as `python -m MODULE ARGS` would (runpy, as `__main__`: the experiments'
scripts). The child gets the environment of the test that started it. Tests of a real exec (the console script's
exit code, the wheel install, what a fresh interpreter imports) start processes of their own.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import json
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

# What a `lowprec run` imports on its way (~1,200 modules, ~1.5 s of CPU in each child when left
# to it): codecarbon with the energy meter, MLflow's system metrics, matplotlib's Figure with the
# run's report at its end, lowprec's own lazily imported modules (the loop, the gates), and
# torch._dynamo, which the optimizer's constructor imports. PRELOAD's objects are frozen (see
# `_serve`); LATE's are imported after that and not: torch._dynamo brings Triton, whose
# extension reports each of its objects never freed ("nanobind: leaked ...") on stderr at exit.
PRELOAD = ("lowprec.cli", "lowprec.runtime.trainer.run", "lowprec.tracking.tracker", "lowprec.evals.suite",
           "mlflow.tracking", "mlflow.store.tracking.sqlalchemy_store", "lm_eval.tasks", "lm_eval.evaluator",
           "codecarbon.emissions_tracker", "codecarbon.core.resource_tracker",
           "mlflow.system_metrics.system_metrics_monitor", "matplotlib.figure", "scipy.io",
           "lowprec.runtime.trainer.loop", "lowprec.runtime.trainer.parallel_run", "lowprec.tracking.telemetry",
           "lowprec.tracking.peaks", "lowprec.tracking.report", "lowprec.evals.adapter", "lowprec.gates.cli")
LATE = ("torch._dynamo",)


class Forked:
    """One forked `lowprec` command: the `subprocess.Popen` calls the kill campaign makes."""

    def __init__(self, server: "CliForks", pid: int, stdout: Path, stderr: Path):
        self.server, self.pid, self.returncode = server, pid, None
        self._out, self._err = stdout, stderr

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.ask({"poll": self.pid})["returncode"]
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:   # not reaped yet: the pid is still this child's
            os.kill(self.pid, sig)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        if self.returncode is None:
            self.returncode = self.server.ask({"wait": self.pid, "timeout": timeout})["returncode"]
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"lowprec (pid {self.pid})", timeout)
        return self._out.read_text(), self._err.read_text()


class CliForks:
    """The server: `start(argv, cwd)` forks a child that runs `lowprec ARGV` in `cwd`."""

    def __init__(self, logs: Path):
        self.logs, self.count = Path(logs), 0
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / "server.err", "w") as err:
            # -P: tests/ is not put first on sys.path (its lowprec/ folder would hide the package)
            self.proc = subprocess.Popen([sys.executable, "-P", __file__], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1)

    def ask(self, request: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            raise RuntimeError(f"the fork server ended: {(self.logs / 'server.err').read_text()[-3000:]}")
        return json.loads(line)

    def start(self, argv: list[str], cwd: Path, env: dict | None = None, module: str = "lowprec.cli") -> Forked:
        """`python -m MODULE ARGV` (`lowprec ARGV`) in `cwd`, with `env` (default: this process's
        environment now)."""
        self.count += 1
        out, err = self.logs / f"{self.count}.out", self.logs / f"{self.count}.err"
        env = dict(os.environ if env is None else env)
        pid = self.ask({"argv": [str(a) for a in argv], "module": module, "cwd": str(cwd), "stdout": str(out),
                        "stderr": str(err), "env": env})["pid"]
        return Forked(self, pid, out, err)

    def run(self, argv: list[str], cwd: Path, timeout: float = 600, env: dict | None = None,
            module: str = "lowprec.cli") -> subprocess.CompletedProcess:
        """`subprocess.run([python, "-m", MODULE, *argv], cwd=cwd, capture_output=True, text=True)`, forked."""
        child = self.start(argv, cwd, env, module)
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGKILL)
            child.communicate(timeout=60)
            raise
        return subprocess.CompletedProcess(["python", "-m", module, *argv], child.returncode, out, err)

    def close(self) -> None:
        """Stop the server; it kills and reaps the children still running (a test that failed)."""
        try:
            self.proc.stdin.close()
        except BrokenPipeError:   # it ended already (`ask` said why)
            pass
        self.proc.wait(timeout=60)
        self.proc.stdout.close()


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _wait(pid: int, timeout: float | None) -> int | None:
    """The child's exit code (negative: the signal that ended it); None when it runs past `timeout`."""
    if timeout is None:
        return _returncode(os.waitpid(pid, 0)[1])
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            return _returncode(status)
        time.sleep(0.01)
    return None


def _serve() -> dict | None:
    """Answer requests until stdin closes (returns None); in a forked child, the request to run."""
    for name in PRELOAD:
        importlib.import_module(name)
    # what the imports made goes to the collector's permanent generation: a child's collections,
    # the last one at its interpreter's shutdown among them, pass over it instead of touching (and
    # so copying) every page of it; 1.5 s of a `lowprec gate --help` child's 1.9 s was that
    gc.freeze()
    for name in LATE:
        importlib.import_module(name)
    children = set()
    for line in sys.stdin:
        req = json.loads(line)
        if "poll" in req:
            got, status = os.waitpid(req["poll"], os.WNOHANG)
            reply = {"returncode": _returncode(status) if got else None}
            children.discard(req["poll"] if got else None)
        elif "wait" in req:
            reply = {"returncode": _wait(req["wait"], req["timeout"])}
            children.discard(req["wait"] if reply["returncode"] is not None else None)
        else:
            assert threading.active_count() == 1, f"threads before a fork: {threading.enumerate()}"
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _become_child(req)
                return req
            children.add(pid)
            reply = {"pid": pid}
        print(json.dumps(reply), flush=True)
    for pid in children:   # the client left with children running
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return None


def _become_child(req: dict) -> None:
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    write = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, (path, flags) in enumerate(((os.devnull, os.O_RDONLY), (req["stdout"], write), (req["stderr"], write))):
        new = os.open(path, flags, 0o644)
        os.dup2(new, fd)
        os.close(new)
    sys.path.insert(0, req["cwd"])   # `python -m` puts the working directory first
    sys.argv = [str(Path(importlib.util.find_spec(req["module"]).origin)), *req["argv"]]


if __name__ == "__main__":
    req = _serve()
    if req is not None and req["module"] == "lowprec.cli":   # a forked child: now `python -m lowprec.cli ARGV`
        sys.exit(importlib.import_module("lowprec.cli").main(req["argv"]))
    if req is not None:   # `python -m MODULE ARGV`
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        sys.exit(0)
    sys.stdout.flush()
    os._exit(0)   # the server: no interpreter shutdown over everything it imported (seconds, for nothing)
