"""MLflow tracking for a rollout, on rank 0, that never blocks or crashes training.

    tracker = Tracker("sqlite:///mlflow.db", "rollout", "gpt-fp8", rank=rank, buffer_dir="runs/gpt-fp8/tracking")
    tracker.log_config(cfg)                                    # params (flattened) + config.yaml
    tracker.log_precision(0, state.formats(), state.flops_share())
    tracker.log_metrics(step, {"train/loss": loss, "train/grad_norm": gn})
    tracker.log_signals(step, state.stats())                   # signal/<site>/<role>/<stat>
    tracker.log_events(controller_events)                      # events table + lowprec.* tags
    tracker.log_eval(step, {"hellaswag": {"acc": .31, "acc_stderr": .01}},   # eval/hellaswag/acc, and the
                     samples={"hellaswag": {"acc": {"q17": 1.0, ...}}})     # per-example scores gates pair
    tracker.finish(RunStatus.FINISHED)                         # report PNGs, final map, end

Why it looks like this:
* Explicit run ids through `MlflowClient`; MLflow's fluent "active run" (a process global)
  is never used, and MLflow is imported only by the sender thread, not by `import lowprec`.
* The training thread only turns its arguments into small records and puts them on a
  bounded queue. A journal thread appends them to `outbox.jsonl` in `buffer_dir` (fsynced);
  a sender thread sends the journal to MLflow (`lowprec.tracking.outbox`). A slow or absent server
  stalls only the sender: records stay in the journal and go out when `/health` answers
  again, on `sync()`, or with `lowprec sync RUN_DIR` from another process. Each metric point
  keeps the timestamp it was recorded with, so a resend is never a second point.
* Every public method catches its own errors (logged as warnings): tracking is never the
  reason a training run dies. Only a full queue (the local disk stalled) makes a caller wait.
* Ranks other than 0 get a tracker whose methods do nothing, so call sites need no `if`.
* A `buffer_dir` holds one run. A new Tracker on a folder that holds a run continues it only
  with `resume=True` and only when it did not finish (killed, or ended FAILED: it is set RUNNING
  again); a finished run, or any run without `resume=True`, is a `BufferInUseError` that names
  the run and the fix (`lowprec.tracking.resume`): nothing is ever continued by accident. A
  continued run does not log again the metric points and events its journal already holds.
  One writer: the tracker holds the folder's writer locks (the outbox's, the event log's) from
  before it reads the folder until `finish()` or the end of its process; a tracker on a folder
  that a live process writes is a `BufferInUseError` naming that process.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import queue
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from lowprec.base.yaml_read import read_yaml_file
from lowprec.base.writer_lock import WriterBusyError
from lowprec.policy.events import Event, EventLog
from lowprec.tracking.journal import Journal
from lowprec.tracking.outbox import Outbox, SendResult, server_answers
from lowprec.tracking.records import (BASELINE_LOSS, EVAL_PREFIX, LR_SENSITIVITY, MAX_TAG_VALUE, SIGNAL_STATS,
                                      PrecisionMapLog, RunStatus, chunk, eval_artifact_name, eval_metric_name, eval_metrics,
                                      eval_samples, fit_value, flatten_config, merge, metric_key, now_ms,
                                      signal_metrics)
from lowprec.tracking.report import render_report
from lowprec.tracking.report_baseline import add_recorded_baseline
from lowprec.tracking.report_sources import from_run_dir
from lowprec.tracking.resume import BufferInUseError, ResumeFilter, RunState, check_buffer
from lowprec.tracking.store import mlflow_client
from lowprec.tracking.system_metrics import SystemMetrics

__all__ = ["Tracker", "BufferInUseError", "flatten_config", "metric_key", "SIGNAL_STATS", "BASELINE_LOSS"]

log = logging.getLogger("lowprec.tracking")


def _never_raises(fn):
    """Tracking errors become warnings (at most one per method), never training failures."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if not self.enabled:
            return None
        try:
            return fn(self, *args, **kwargs)
        except Exception as e:  # noqa: BLE001
            if fn.__name__ not in self._warned:
                self._warned.add(fn.__name__)
                log.warning("lowprec tracking: %s failed (%s: %s); training goes on", fn.__name__,
                            type(e).__name__, e)
            return None
    return wrapper


class Tracker(Journal):
    """One MLflow run, logged from rank 0 through a durable local outbox (see module doc)."""

    def __init__(self, tracking_uri: str, experiment: str, run_name: str, *, rank: int = 0,
                 buffer_dir: str | os.PathLike, resume: bool = False, run_id: str | None = None,
                 tags: Mapping[str, str] | None = None,
                 queue_size: int = 65536, flush_interval_s: float = 1.0, probe_timeout_s: float = 2.0,
                 retry_max_s: float = 30.0, signal_stats: Iterable[str] = SIGNAL_STATS,
                 system_metrics_s: float | None = None):
        self.enabled = rank == 0
        self._warned: set[str] = set()
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        if not self.enabled:
            return
        self.run_dir = Path(buffer_dir)
        info = json.loads((self.run_dir / "run.json").read_text()) if (self.run_dir / "run.json").is_file() else {}
        if info.get("uid") and info.get("tracking_uri") not in (None, tracking_uri):
            raise ValueError(f"{self.run_dir} belongs to a run tracked at {info['tracking_uri']}; "
                             f"use another buffer_dir for {tracking_uri}")
        try:   # one writer per buffer folder, locked before anything in it is read or written
            self.outbox = Outbox(self.run_dir, writer=True)
            self._event_log = EventLog(self.run_dir / "events.jsonl", exclusive=True)
        except WriterBusyError as e:
            if hasattr(self, "outbox"):
                self.outbox.close()
            raise BufferInUseError(f"{self.run_dir} is being written by a live process ({e.holder.describe()}); a "
                                   f"buffer folder has one writer: wait for it to end, or track in another "
                                   f"buffer folder (`lowprec run`: another --out)") from None
        try:
            state = check_buffer(self.run_dir, resume, held=True)   # BufferInUseError: not to be continued
        except BaseException:
            self._release()
            raise
        self.files = self.run_dir / "files"          # snapshots the outbox uploads
        self.files.mkdir(parents=True, exist_ok=True)
        self.signal_stats = tuple(signal_stats)
        self.flush_interval_s, self.probe_timeout_s, self.retry_max_s = flush_interval_s, probe_timeout_s, retry_max_s
        self._events: list[Event] = self._event_log.read()           # journal thread only
        self._precision = PrecisionMapLog(self._read_json(self.files / "precision_map.json"))
        self._config: dict = {}
        if (self.files / "config.yaml").exists():  # resuming a run
            self._config = read_yaml_file(self.files / "config.yaml")
        info = self.outbox.info
        self._resume: ResumeFilter | None = None
        if state is RunState.NONE:  # a new run
            uid = uuid.uuid4().hex
            self.outbox.write_info(uid=uid, tracking_uri=tracking_uri, experiment=experiment, run_name=run_name)
            if run_id:
                self.outbox.write_info(run_id=run_id)
            else:
                self.outbox.append([{"op": "create_run", "experiment": experiment, "run_name": run_name,
                                     "uid": uid, "start_time": now_ms(), "tags": dict(tags or {})}])
        else:  # resume=True on a run that did not finish
            if run_id and run_id != info.get("run_id"):
                raise ValueError(f"{self.run_dir} already tracks run {info.get('run_id')}, not {run_id}")
            self._resume = ResumeFilter.from_journal(self.outbox, self._events)
            if not info.get("run_id") and not self.outbox.path.exists():  # killed before journaling create_run
                self.outbox.append([{"op": "create_run", "experiment": info.get("experiment", experiment),
                                     "run_name": info.get("run_name", run_name), "uid": info["uid"],
                                     "start_time": now_ms(), "tags": dict(tags or {})}])
            if state is RunState.FAILED:
                self.outbox.append([{"op": "reopen"}])
            self.outbox.append(self._snapshot_records())
        self._queue: queue.Queue = queue.Queue(queue_size)
        self._stop, self._wake = threading.Event(), threading.Event()
        self._next_try, self._backoff, self.online, self.last_error = 0.0, 0.0, None, ""
        self._attempts, self._reached = 0, True   # send attempts made; whether the last one reached the server
        self._finished = False
        # MLflow's own system-metrics monitor, started by the sender once the run exists
        self.system_metrics = (SystemMetrics(tracking_uri, system_metrics_s, resume=self._resume is not None)
                               if system_metrics_s is not None else None)
        self._journal = threading.Thread(target=self._journal_loop, name="lowprec-journal", daemon=True)
        self._sender = threading.Thread(target=self._sender_loop, name="lowprec-sender", daemon=True)
        self._journal.start()
        self._sender.start()

    @staticmethod
    def _read_json(p: Path) -> dict:
        return json.loads(p.read_text()) if p.exists() else {}

    @property
    def run_id(self) -> str | None:
        """The MLflow run id, once the run exists on the server (None on ranks other than 0)."""
        return self.outbox.info.get("run_id") if self.enabled else None

    # ------------------------------------------------------------------ public API
    @_never_raises
    def log_config(self, cfg: Mapping) -> None:
        """The config as params (`precision.rules.0.format`) and as `config.yaml`. Calling it
        again adds sections (config.yaml holds them all); a param logged before with another
        value is refused by MLflow (it goes to rejected.jsonl, nothing else is held up)."""
        params = flatten_config(cfg)
        merge(self._config, json.loads(json.dumps(dict(cfg), default=str)))
        text = yaml.safe_dump(self._config, sort_keys=False)
        recs = [{"op": "params", "params": dict(chunk_)} for chunk_ in chunk(list(params.items()), 100)]
        self._put(("file", "config.yaml", text, recs))

    @_never_raises
    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """Per-step metrics under the given names (`train/loss`, `train/grad_norm`, ...)."""
        ts = now_ms()
        rows = [[metric_key(k), float(v), ts, int(step)] for k, v in metrics.items() if v is not None]
        if rows:
            self._put(("records", [{"op": "metrics", "metrics": rows}]))

    @_never_raises
    def log_signals(self, step: int, signals: Any) -> None:
        """Per-site signals as `signal/<site>/<role>/<stat>` (the shapes `signal_metrics` takes:
        `PrecisionState.stats()`, the monitor's `Signals`, {site: SiteSignals}); a `Signals`'
        LR-probe sensitivity, when the probe ran for that check, as `train/lr_sensitivity`."""
        metrics = signal_metrics(signals, self.signal_stats)
        lr = getattr(signals, "lr_sensitivity", None)
        if lr is not None:
            metrics[LR_SENSITIVITY] = float(lr)
        self.log_metrics(step, metrics)

    @_never_raises
    def log_tags(self, tags: Mapping[str, str]) -> None:
        """Run tags (`telemetry.energy`: where a number came from), each cut to MLflow's limit."""
        if tags:
            self._put(("records", [{"op": "tags", "tags": {str(k): fit_value(str(v), MAX_TAG_VALUE, "telemetry.json")
                                                           for k, v in tags.items()}}]))

    @_never_raises
    def log_precision(self, step: int, state_formats: Mapping[str, str], flops_share: Mapping[str, float]) -> None:
        """GEMM FLOP share per format (`precision/flops_share/<format>`, 0 once a format is
        gone) and the precision map (`precision_map.json`, tag) when it changed."""
        self._put(("precision", int(step), dict(state_formats), {k: float(v) for k, v in flops_share.items()},
                   now_ms()))

    @_never_raises
    def log_events(self, events: Iterable[Event]) -> None:
        """Controller events: `events.jsonl`, the `events.json` table, `lowprec.*` tags, the run note."""
        events = list(events)
        for e in events:
            if not isinstance(e, Event):
                raise TypeError(f"log_events takes lowprec.policy.events.Event objects, got {type(e).__name__}")
        if events:
            self._put(("events", events))

    @_never_raises
    def log_eval(self, step: int, results: Mapping[str, Any], samples: Mapping[str, Any] | None = None,
                 prefix: str = "eval", mode: str | None = None, suite: str | None = None) -> None:
        """Eval results as `<prefix>/<task>/<metric>` metrics ({task: {metric: value, metric_stderr:
        se}}, lm-eval's `acc,none` / `acc_stderr,none` keys accepted) and a line in `evals.jsonl`.
        `prefix` is `eval` for the model as it runs, `eval_hp` for the same weights in high precision.
        `mode` ("fast": an in-loop eval, "full": the final one) is also the metric
        `eval_mode/<prefix>` (1 full, 0 fast) at `step`, and `mode` and `suite` are kept in the line
        and the artifact, so that `lowprec gate` never compares evals of different kinds.
        With `samples` ({task: {metric: {example key: score}}}, the per-example scores a paired
        gate needs) the call is also kept whole, as the artifact `evals/<prefix>_step<NNNNNN>.json`
        ({step, prefix, mode, suite, results, samples}; written to the buffer first, like every record)."""
        if not isinstance(prefix, str) or not EVAL_PREFIX.fullmatch(prefix):
            raise ValueError(f"log_eval prefix must be one path part of letters, digits, '_', '-', '.' "
                             f"(such as 'eval' or 'eval_hp'), got {prefix!r}")
        if mode not in (None, "fast", "full"):
            raise ValueError(f"log_eval mode must be 'fast', 'full' or None, got {mode!r}")
        metrics = eval_metrics(results, prefix)
        if mode is not None:
            metrics[f"eval_mode/{prefix}"] = 1.0 if mode == "full" else 0.0
        self.log_metrics(step, metrics)
        kind = {k: v for k, v in (("mode", mode), ("suite", suite)) if v is not None}
        line = json.dumps({"step": int(step), "prefix": prefix, **kind, "results": results}, default=str)
        self._put(("append", "evals.jsonl", line))
        if samples is not None:
            doc = {"step": int(step), "prefix": prefix, **kind,
                   "results": {t: {eval_metric_name(m): v for m, v in r.items()} if isinstance(r, Mapping) else r
                               for t, r in results.items()},
                   "samples": eval_samples(samples)}
            self._put(("json", eval_artifact_name(prefix, step), doc))  # serialised by the journal thread

    @_never_raises
    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """A file or folder, copied into the buffer now (so later changes don't matter)."""
        src = Path(path)
        dst = self.files / "artifacts" / uuid.uuid4().hex[:8] / src.name
        dst.parent.mkdir(parents=True)
        shutil.copytree(src, dst) if src.is_dir() else shutil.copy2(src, dst)
        rel = str(dst.relative_to(self.run_dir))
        if src.is_dir():
            artifact_path = f"{artifact_path}/{src.name}" if artifact_path else src.name
        self._put(("records", [{"op": "artifact", "file": rel, "artifact_path": artifact_path}]))

    @_never_raises
    def flush(self, timeout: float = 10.0) -> bool:
        """Wait (at most `timeout` s) until everything logged so far is sent; True if it was. A
        server that does not answer `/health` when asked now is not waited for (False at once);
        a store that answers and fails (a locked SQLite file, a 5xx) is retried until `timeout`."""
        if self._finished:  # no sender thread any more: send from here
            return self.sync(timeout).pending == 0
        deadline = time.monotonic() + timeout
        if not self._journal_flush(timeout):
            return False
        tried = self._attempts
        self._next_try = 0.0
        self._wake.set()
        while self.outbox.n_pending() and time.monotonic() < deadline:
            if not self._sender.is_alive() or (self._attempts > tried and not self._reached):
                break   # nothing can send (no MLflow), or a server that does not answer at all: not waited for
            time.sleep(0.05)
        return self.outbox.n_pending() == 0

    @_never_raises
    def sync(self, timeout: float | None = None) -> SendResult:
        """Send the buffer now (also after `finish`); returns what was sent and what is left."""
        if not self._finished:
            self._journal_flush(timeout or 30.0)
        if not server_answers(self.tracking_uri, self.probe_timeout_s):
            return SendResult(0, 0, self.outbox.n_pending(), f"{self.tracking_uri} does not answer")
        deadline = None if timeout is None else time.monotonic() + timeout
        return self.outbox.send(mlflow_client(self.tracking_uri), deadline)

    def status(self) -> dict:
        if not self.enabled:
            return {"enabled": False}
        return {"enabled": True, "run_id": self.run_id, "pending": self.outbox.n_pending(),
                "online": self.online, "last_error": self.last_error, "queued": self._queue.qsize()}

    @_never_raises
    def finish(self, status: RunStatus | str = RunStatus.FINISHED, timeout: float = 30.0, report: bool = True,
               warn_unsent: bool = True) -> dict:
        """Report pictures, final precision map, the run's end; waits at most `timeout` s for
        the server. What could not be sent stays in `buffer_dir` for `sync` (a warning says so,
        unless `warn_unsent=False`: the caller says it itself, as `lowprec run` does)."""
        if self._finished:
            return self.status()
        self._journal_flush(timeout)
        if report:
            try:
                out = self.files / "report"
                data = from_run_dir(self.run_dir)
                add_recorded_baseline(data, self.tracking_uri, self.experiment, self._config)
                render_report(data, out)
                self._put(("records", [{"op": "artifact", "file": "files/report", "artifact_path": "report"}]))
            except Exception as e:  # noqa: BLE001
                log.warning("lowprec tracking: report pictures failed (%s: %s)", type(e).__name__, e)
        if self.system_metrics is not None:
            self.system_metrics.stop()
        self._put(("records", [{"op": "terminate", "status": status, "end_time": now_ms()}]))
        self.flush(timeout)
        self._finished = True
        self._stop.set()
        self._queue.put(None)
        self._wake.set()
        self._journal.join(timeout=5)
        self._sender.join(timeout=1)
        st = self.status()
        self._release()
        if st["pending"] and warn_unsent:
            log.warning("lowprec tracking: %d records could not be sent (%s); they are kept in %s: "
                        "send them with `lowprec sync %s`", st["pending"], self.last_error, self.run_dir, self.run_dir)
        return st

    def _release(self) -> None:
        """Let go of the buffer folder's writer locks (the outbox's and the event log's)."""
        self._event_log.close()
        self.outbox.close()

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish(RunStatus.FAILED if exc_type else RunStatus.FINISHED)

    # ------------------------------------------------------------------ threads
    def _sender_loop(self) -> None:
        try:
            import mlflow.tracking  # noqa: F401 - imported here: only rank 0's sender needs MLflow
        except Exception as e:  # noqa: BLE001 - no MLflow: keep journaling, send never
            self.online, self.last_error = False, f"{type(e).__name__}: {e}"
            log.warning("lowprec tracking: MLflow cannot be imported (%s); records stay in %s",
                        self.last_error, self.run_dir)
            return
        client = None
        while not self._stop.is_set():
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            if not self.outbox.n_pending() or time.monotonic() < self._next_try:
                continue
            res, reached = None, False
            if server_answers(self.tracking_uri, self.probe_timeout_s):
                reached = True
                try:
                    # a new SQLite store is created under a file lock: other runs may open it now
                    client = client or mlflow_client(self.tracking_uri)
                    res = self.outbox.send(client)
                except Exception as e:  # noqa: BLE001 - the store could not be opened, the local disk
                    res = SendResult(0, 0, self.outbox.n_pending(), f"{type(e).__name__}: {e}")
            self._attempts, self._reached = self._attempts + 1, reached
            if res is not None and not res.error:
                self.online, self._backoff, self.last_error = True, 0.0, ""
                if self.system_metrics is not None and self.run_id:
                    self.system_metrics.start(self.run_id)
                continue
            if self.online is not False:
                log.warning("lowprec tracking: %s is not taking records (%s); buffering in %s",
                            self.tracking_uri, res.error if res else "no answer", self.run_dir)
            self.online, self.last_error = False, res.error if res else "no answer from /health"
            self._backoff = min(max(2 * self._backoff, 0.5), self.retry_max_s)
            self._next_try = time.monotonic() + self._backoff
