"""`lowprec report | ui | sync`: the command-line side of tracking (registered by lowprec.cli).

    lowprec report RUN_ID [--tracking-uri URI] [--out DIR] [--baseline RUN] [--timeout S]
        reads a run from MLflow, writes the rollout pictures (lowprec.tracking.report) as PNGs and
        prints the run's events, one line each (`lowprec.policy.events.describe`: the sites, then the reason).
    lowprec ui [--tracking-uri sqlite:///mlflow.db] [--port 5000] [--artifacts-destination URI]
        starts `mlflow server` on that store, bound to 127.0.0.1 only, in a process group of its
        own; Ctrl+C, SIGTERM or SIGHUP stop the whole group. A SQLite store that does not exist
        is an exit 2 (no empty mlflow.db is created and served).
    lowprec sync RUN_DIR [--tracking-uri URI] [--timeout S]
        sends what a tracker's buffer dir still holds (the server was away); exit 0 when
        nothing is left, 1 when the server still does not take it, 2 on unusable input, a
        server that does not answer, or a run that is alive (a live process holds the folder's
        writer lock: that run sends its own records; nothing is sent beside it).

`report` and `sync` give the store --timeout seconds in all (60 by default,
`lowprec.tracking.deadline`): a server that answers /health but never the API is an exit 2
that names it, not a wait of many minutes.

The tracking URI defaults to `sqlite:///<cwd>/mlflow.db` (the local store `make run`
writes); pass `--tracking-uri` for another store or a server. MLflow and matplotlib are imported by the commands.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from lowprec.tracking.deadline import DEFAULT_TIMEOUT_S, Deadline, NoAnswer
from lowprec.tracking.records import tidy_numbers

__all__ = ["add_commands", "default_tracking_uri", "ui_command"]


def default_tracking_uri() -> str:
    """`sqlite:///<cwd>/mlflow.db` as an absolute path: the store `make run` writes."""
    return f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def add_commands(sub) -> None:
    """Register `report`, `ui` and `sync` on lowprec's subparsers (a registrar of lowprec.cli)."""
    p = sub.add_parser("report", help="draw a run's precision timeline, loss, signals and evals as PNGs")
    p.add_argument("run_id", help="MLflow run id")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: sqlite:///<cwd>/mlflow.db)")
    p.add_argument("--out", default=None, help="output folder (default: report-<first 8 of RUN_ID>)")
    p.add_argument("--baseline", "--baseline-run", dest="baseline_run", default=None, metavar="RUN",
                   help="run (id, or name in the run's experiment) drawn beside it in the loss, eval, signal "
                   "and LR pictures (default: the loss-gap baseline the run recorded, rollout.baseline.mlflow_run)")
    _timeout_arg(p)
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser("ui", help="start the MLflow UI on a local store, bound to 127.0.0.1")
    p.add_argument("--tracking-uri", default=None, help="backend store (default: sqlite:///<cwd>/mlflow.db)")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--artifacts-destination", default=None, help="where proxied artifacts go "
                   "(default: MLflow's ./mlartifacts)")
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    p.set_defaults(func=_cmd_ui)

    p = sub.add_parser("sync", help="send a tracker's buffered records (kept while the server was away)")
    p.add_argument("run_dir", help="the tracker's buffer_dir (holds outbox.jsonl and run.json)")
    p.add_argument("--tracking-uri", default=None, help="send there instead of the URI in run.json")
    _timeout_arg(p)
    p.set_defaults(func=_cmd_sync)


def _timeout_arg(p) -> None:
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help=f"give up (exit 2) when the tracking store has not answered in S seconds "
                   f"(default {DEFAULT_TIMEOUT_S:g})")


def _cmd_report(args) -> int:
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from lowprec.tracking.report import render_report
    from lowprec.tracking.report_baseline import read_run

    uri = args.tracking_uri or default_tracking_uri()
    out = Path(args.out or f"report-{args.run_id[:8]}")
    missing = _missing_store(uri)
    if missing:   # MlflowClient would create an empty store there, and then not find the run
        print(f"lowprec report: {missing}", file=sys.stderr)
        return 2
    try:
        dl = Deadline(args.timeout, f"the tracking store {uri}")
        data = dl.run(f"reading run {args.run_id}", read_run, MlflowClient(uri), args.run_id,
                      baseline_run=args.baseline_run)
    except MlflowException as e:
        print(f"lowprec report: cannot read run {args.run_id!r} from {uri}: {e.message}", file=sys.stderr)
        return 2
    except (NoAnswer, ValueError) as e:
        print(f"lowprec report: {e}", file=sys.stderr)
        return 2
    if not data.initial and not data.metrics:
        print(f"lowprec report: run {args.run_id} has no precision map and no train/eval metrics: "
              f"was it logged by lowprec.tracking.tracker.Tracker?", file=sys.stderr)
        return 2
    for note in data.notes:
        print(f"lowprec report: {note}", file=sys.stderr)
    for path in render_report(data, out):
        print(path)
    if data.events:   # what happened, in the words of the run's summary and its MLflow note
        print(f"{len(data.events)} events:")
        for e in data.events:
            print("  " + tidy_numbers(e.summary()))
    return 0


def ui_command(tracking_uri: str, port: int, artifacts_destination: str | None = None) -> list[str]:
    """The `mlflow server` command line `lowprec ui` runs (one worker, localhost only)."""
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", tracking_uri,
           "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    if artifacts_destination:
        cmd += ["--artifacts-destination", artifacts_destination]
    return cmd


def _cmd_ui(args) -> int:
    uri = args.tracking_uri or default_tracking_uri()
    if uri.startswith(("http://", "https://")):
        print(f"lowprec ui: {uri} is a server already; open it in a browser. `lowprec ui` serves a local "
              f"store such as sqlite:///mlflow.db", file=sys.stderr)
        return 2
    cmd = ui_command(uri, args.port, args.artifacts_destination)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    missing = _missing_store(uri)
    if missing:
        print(f"lowprec ui: {missing}", file=sys.stderr)
        return 2
    # `mlflow server` starts job-consumer processes unless this is false (mlflow/server/jobs/__init__.py);
    # browsing runs needs none, and they cost start-up time.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    print(f"lowprec ui: http://127.0.0.1:{args.port} (store {uri}); Ctrl+C stops it", file=sys.stderr)
    return _serve(cmd, env)


def _sqlite_file(uri: str) -> Path | None:
    if not uri.startswith("sqlite:///") or uri.endswith(":memory:"):
        return None
    return Path(uri[len("sqlite:///"):])


def _missing_store(uri: str) -> str | None:
    """What to say when `uri` is a SQLite store that does not exist (opening it would create it)."""
    db = _sqlite_file(uri)
    if db is None or db.is_file():
        return None
    return (f"there is no tracking store at {db} ({uri}); `lowprec run` creates one where it runs "
            f"(tracking.uri, default ./mlflow.db): run there, or pass --tracking-uri with the store your "
            f"runs were logged to")


class _Stop(Exception):
    pass


def _serve(cmd: list[str], env: dict) -> int:
    """Run the server in a process group of its own until it ends or this process is told to
    stop (Ctrl+C, SIGTERM, SIGHUP); then stop the whole group (its workers too)."""
    def stop(signum, frame):
        raise _Stop()

    # SIGINT too, explicitly: a process started in the background of a non-interactive shell
    # inherits SIGINT ignored, and Python then installs no KeyboardInterrupt for it
    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    proc = None
    try:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        return proc.wait()
    except (KeyboardInterrupt, _Stop):
        return 0
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if proc is not None:
            _stop_group(proc)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL to what is left after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        try:  # the leader is gone; its workers may not be
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)


def _cmd_sync(args) -> int:
    import mlflow.tracking  # noqa: F401 - imported here, not in the time given to the store

    from lowprec.base.writer_lock import WriterBusyError
    from lowprec.tracking.outbox import RUN_INFO, Outbox, sync_run_dir

    info = Path(args.run_dir) / RUN_INFO
    try:
        uri = args.tracking_uri or (json.loads(info.read_text()).get("tracking_uri") if info.is_file() else None)
        dl = Deadline(args.timeout, f"the tracking store {uri}")
        # sending stops between requests a little before the deadline; a request hung past it is NoAnswer
        res = dl.run("sending the buffered records", sync_run_dir, args.run_dir, tracking_uri=args.tracking_uri,
                     timeout=0.9 * args.timeout)
    except (FileNotFoundError, ValueError) as e:
        print(f"lowprec sync: {e}", file=sys.stderr)
        return 2
    except WriterBusyError as e:   # a live run sends its own records; two senders would race on the ack
        print(f"lowprec sync: {e.path.parent} is being written by a live process ({e.holder.describe()}): that "
              f"run sends its records itself; sync a run whose process is gone. Nothing was sent", file=sys.stderr)
        return 2
    except NoAnswer as e:
        print(f"lowprec sync: {e}; {Outbox(args.run_dir).n_pending()} records stay buffered in {args.run_dir}",
              file=sys.stderr)
        return 2
    print(f"lowprec sync: sent {res.sent} records, {res.rejected} refused by the server "
          f"(see {Path(args.run_dir) / 'rejected.jsonl'}), {res.pending} still buffered"
          + (f": {res.error}" if res.error else ""))
    return 0 if res.pending == 0 else 1
