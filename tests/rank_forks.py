"""torchrun's ranks as processes forked from one that has imported torch, lowprec (and torchtitan) once.

A rank of a test's torchrun job spends most of its CPU importing: torch, its distributed
packages, lowprec, MLflow, and under torchtitan's Trainer `torchtitan.train` (about 7 s of CPU a
rank on the test machine, against seconds of training). This file is two programs:

- the server (`python -P rank_forks.py --serve SOCKET`, started once per pytest worker by the
  `rank_forks` fixture in tests/conftest.py) imports PRELOAD, then listens on a Unix socket and
  forks one child per request;
- the client (`torchrun ... rank_forks.py -m MODULE ARGS` or `... rank_forks.py SCRIPT ARGS`):
  what torchrun starts as the rank. It imports nothing heavy: it sends the server its command
  line, working folder, environment and its standard input, output and error (the descriptors
  themselves), waits for the forked child's end and ends as it did (its exit code, or killed by
  its signal). A signal torchrun sends the client (SIGTERM when another rank failed) is passed to
  the child; a client killed outright (SIGKILL) makes the server kill its child.

So torchrun, its rendezvous, its environment for each rank (RANK, LOCAL_RANK, MASTER_ADDR, ...),
its failure handling and its output are torchrun's own; only the rank's interpreter start is
shared. The child runs `python -u -m MODULE ARGS` (or the script) as a fresh interpreter would:
its environment, working folder, `sys.argv`, the PYTHONPATH entries of its environment on
`sys.path`, unbuffered output. Without RANK_FORKS_SOCKET in its environment the client execs
`python -u` on its command line instead (a job that runs without the fixture).

Nothing is shared with the server after the fork: the server opens no store, starts no thread
and runs no torch operation. A request may name more modules to import before the fork
(RankForks.env's `imports`): a server of its own imports them once (torchtitan's trainer for the
torchtitan jobs, after lowprec's launcher's device change).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

SOCKET_VAR = "RANK_FORKS_SOCKET"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
MESSAGE = 1 << 20

# what a rank of `lowprec run` and the tests' distributed workers import on their way: PRELOAD's
# objects are frozen (see `_serve`), LATE's are imported after that and not, as in cli_forks.py:
# torch._dynamo (which torch's distributed packages import) brings Triton, whose extension reports
# each of its objects never freed ("nanobind: leaked ...") on stderr at exit
PRELOAD = ("torch", "lowprec", "lowprec.cli", "lowprec.runtime.trainer.run", "lowprec.runtime.trainer.loop",
           "lowprec.tracking.tracker", "lowprec.evals.suite", "lm_eval.evaluator", "mlflow.tracking",
           "mlflow.store.tracking.sqlalchemy_store", "matplotlib.figure")
LATE = ("torch._dynamo", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
        "torch.distributed.tensor.parallel", "torch.distributed.pipelining", "torch.distributed.checkpoint",
        "torch.distributed.elastic.multiprocessing.errors", "lowprec.runtime.trainer.parallel_run")


# ---- the client: what torchrun starts as a rank ---------------------------------------------

def _client(argv: list[str]) -> None:
    path = os.environ.get(SOCKET_VAR)
    if not path:
        os.execv(sys.executable, [sys.executable, "-u", *argv])
    request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
        conn.connect(path)
        socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
        reply = json.loads(conn.recv(MESSAGE) or b'{"error": "the rank server closed the connection"}')
        if "error" in reply:
            sys.stderr.write(f"rank_forks: {reply['error']}\n")
            sys.exit(1)
        child = reply["pid"]
        for sig in FORWARDED:
            signal.signal(sig, lambda number, frame: os.kill(child, number))
        end = conn.recv(MESSAGE)   # the child's end (PEP 475: retried after a forwarded signal)
    code = json.loads(end)["returncode"] if end else -signal.SIGKILL
    if code < 0:   # end as the child did: killed by its signal
        if -code != signal.SIGKILL:   # (Python ignores SIGPIPE, and this file forwards some)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code   # (a signal whose default is not to end the process)
    sys.exit(code)


# ---- the server ------------------------------------------------------------------------------

def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _serve(path: str, imports: list[str]) -> dict | None:
    """Import PRELOAD, then `imports` (`module` or `module:function`, the function called: a change that
    must precede an import, as lowprec's torchtitan launcher's device change precedes torchtitan's),
    answer requests until stdin closes (returns None); in a forked child, the request to run."""
    import gc
    import importlib
    import selectors
    import threading

    for name in PRELOAD:
        importlib.import_module(name)
    gc.freeze()   # a child's collections pass over what the imports made (see cli_forks.py)
    for name in LATE:
        importlib.import_module(name)
    for name in imports:
        module, _, function = name.partition(":")
        loaded = importlib.import_module(module)
        if function:
            getattr(loaded, function)()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(sys.stdin, selectors.EVENT_READ, "stdin")
    sel.register(wake_r, selectors.EVENT_READ, "wake")
    children: dict[int, socket.socket] = {}   # pid -> its client's connection
    print("ready", flush=True)
    while True:
        for key, _ in sel.select():
            what = key.data
            if what == "stdin":
                if sys.stdin.readline():
                    continue
                for pid in children:   # the tests ended with ranks running: kill them
                    os.kill(pid, signal.SIGKILL)
                return None
            if what == "accept":
                conn, _ = listener.accept()
                sel.register(conn, selectors.EVENT_READ, "request")
                continue
            if what == "wake":
                os.read(wake_r, 4096)
                while children:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                    if not pid:
                        break
                    conn = children.pop(pid, None)
                    if conn is not None:
                        conn.sendall(json.dumps({"returncode": _returncode(status)}).encode())
                        sel.unregister(conn)
                        conn.close()
                continue
            conn = key.fileobj   # a client: its request, or its end
            msg, fds, _, _ = socket.recv_fds(conn, MESSAGE, 3)
            owner = next((pid for pid, c in children.items() if c is conn), None)
            if not msg:   # the client is gone (killed): so is its child
                if owner is not None:
                    os.kill(owner, signal.SIGKILL)
                    children[owner] = None   # reaped at its SIGCHLD, nobody to tell
                sel.unregister(conn)
                conn.close()
                continue
            req = json.loads(msg)
            if _startup(req["env"]) != _startup(dict(os.environ)):   # RankForks.env picks the server
                conn.sendall(json.dumps({"error": "the rank's start-up settings are not this server's: "
                                                  f"{_startup(req['env'])} against {_startup(dict(os.environ))}"}).encode())
                continue
            assert threading.active_count() == 1, f"threads before a fork: {threading.enumerate()}"
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                for fd, target in zip(fds, (0, 1, 2)):
                    os.dup2(fd, target)
                    os.close(fd)
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                sel.close()
                for c in [listener, conn, *(c for c in children.values() if c is not None)]:
                    c.close()
                os.close(wake_r)
                os.close(wake_w)
                return req
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            conn.sendall(json.dumps({"pid": pid}).encode())


def _error_files_written_aside() -> None:
    """torch elastic's `@record` writes a rank's error file in place (open "w", then json.dump). A
    rank whose collective fails because another rank died writes it just as the agent SIGTERMs it:
    killed between the two, it leaves an empty file, and the agent dies reading it
    (JSONDecodeError, no failure summary; dlrover works around the same,
    intelligent-machine-learning/dlrover#618). Seen once in four fresh clones in the torchtitan kill
    test. A forked rank writes the file aside and renames it: the agent reads all of it or none."""
    try:
        from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler
    except ImportError:
        return
    record = ErrorHandler.record_exception

    def record_exception(self, e: BaseException) -> None:
        path = self._get_error_file_path()
        if not path:
            return record(self, e)
        self._get_error_file_path = lambda: path + ".tmp"
        try:
            record(self, e)
        finally:
            del self._get_error_file_path
        os.replace(path + ".tmp", path)

    ErrorHandler.record_exception = record_exception


def _become_rank(req: dict) -> None:
    """This forked child: `python -u ARGV` in the request's folder and environment."""
    import io
    import runpy

    os.environ.clear()
    os.environ.update(req["env"])
    _error_files_written_aside()
    os.chdir(req["cwd"])
    for fd, name in ((1, "stdout"), (2, "stderr")):   # -u: unbuffered
        setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True,
                                            errors="backslashreplace" if fd == 2 else None))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    argv = req["argv"]
    if argv[0] == "-m":
        sys.path[:0] = [req["cwd"], *extra]   # `python -m` puts the working folder first
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(argv[0])
        sys.path[:0] = [os.path.dirname(script), *extra]
        sys.argv = [script, *argv[1:]]
        runpy.run_path(script, run_name="__main__")


# ---- the fixture's handle (tests/conftest.py: `rank_forks`) -----------------------------------

# what a process reads from its environment once, at its start or at the first torch operation (the
# OpenMP and MKL runtimes, torch's CPU kernels, Python's warning filters and hash seed): a forked rank
# has its server's, so each set of these values gets a server of its own
STARTUP_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "ATEN_")
STARTUP_NAMES = ("PYTHONWARNINGS", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE", "PYTHONOPTIMIZE")


def _startup(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(STARTUP_PREFIXES) or k in STARTUP_NAMES))


class _Server:
    def __init__(self, env: dict[str, str], imports: tuple[str, ...]):
        import subprocess
        import tempfile
        self.folder = tempfile.mkdtemp(prefix="rank-forks-")   # short: a socket path has 108 bytes
        self.socket = os.path.join(self.folder, "socket")
        with open(os.path.join(self.folder, "server.err"), "w") as err:
            # -P: tests/ is not put first on sys.path (its lowprec/ folder would hide the package)
            self.proc = subprocess.Popen([sys.executable, "-P", __file__, "--serve", self.socket, *imports], env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            self.proc.wait(timeout=60)
            raise RuntimeError(f"the rank server did not start: {self.err()}")

    def err(self) -> str:
        with open(os.path.join(self.folder, "server.err")) as f:
            return f.read()[-3000:]

    def close(self) -> None:
        import shutil
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.proc.stdout.close()
        shutil.rmtree(self.folder, ignore_errors=True)


class RankForks:
    """The servers of a session, one per set of start-up settings (`_startup`) and imports, each started
    when a job first needs it: `rank(...)` is the rank command torchrun runs, `env(job_env)` the job's
    environment with its server's socket."""

    def __init__(self):
        self.servers: dict[tuple, _Server] = {}

    @staticmethod
    def rank(*target: str) -> list[str]:
        """The rank's command after torchrun's options: this file, then `-m MODULE ARGS` or `SCRIPT ARGS`."""
        return [os.path.abspath(__file__), *map(str, target)]

    def env(self, job_env: dict[str, str], imports: tuple[str, ...] = ()) -> dict[str, str]:
        """`job_env` (the torchrun job's whole environment) with the socket of the server whose start-up
        settings are the job's and which imported `imports` (see `_serve`) besides PRELOAD."""
        key = (_startup(job_env), tuple(imports))
        server = self.servers.get(key)
        if server is None:
            base = {k: v for k, v in os.environ.items() if not (k.startswith(STARTUP_PREFIXES) or k in STARTUP_NAMES)}
            server = self.servers[key] = _Server({**base, **dict(key[0])}, key[1])
        if server.proc.poll() is not None:
            raise RuntimeError(f"the rank server ended: {server.err()}")
        return {**job_env, SOCKET_VAR: server.socket}

    def close(self) -> None:
        for server in self.servers.values():
            server.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        req = _serve(sys.argv[2], sys.argv[3:])
        if req is None:
            sys.stdout.flush()
            os._exit(0)   # the server: no interpreter shutdown over everything it imported
        _become_rank(req)
        sys.exit(0)
    else:
        _client(sys.argv[1:])
