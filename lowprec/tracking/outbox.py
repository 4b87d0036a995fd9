"""The tracker's durable outbox: an append-only journal of MLflow records and their sender.

Every record the `Tracker` produces is first appended to `outbox.jsonl` in the run's
buffer directory (flushed and fsynced), then sent to MLflow; `outbox.ack` says how far the
journal has been sent (sequence number and byte offset, replaced atomically). A server
that is slow or away therefore never loses data: what was not sent stays in the journal
and goes out later, from the tracker's sender thread when the server answers again, from
`Tracker.sync()`, or from another process (`lowprec sync RUN_DIR`, `sync_run_dir`).

Records are plain JSON, one per line, `{"seq": n, "op": ...}`:

    create_run  {"experiment", "run_name", "uid", "start_time", "tags"}
    params      {"params": {key: value}}
    tags        {"tags": {key: value}}
    metrics     {"metrics": [[key, value, timestamp_ms, step], ...]}
    artifact    {"file": path relative to the run dir, "artifact_path": dir in the run or null}
    terminate   {"status", "end_time"}
    reopen      {}   (a FAILED run continued with resume=True: RUNNING again)

The journal is kept after sending: it is the run's complete local record (the report that
`Tracker.finish` draws is read from it). Sending twice does no harm and is avoided: a metric point carries the timestamp it was
recorded with, so a resend is the identical row (MLflow's SQL store keeps one); params are
re-sent with the same value; tags and artifacts overwrite; a run is created once (it is
looked up by its `lowprec.run_uid` tag before creating). Records the server refuses as
invalid (a bad name, a changed param value) are moved to `rejected.jsonl` with the error
instead of blocking everything behind them. MLflow is imported only when sending.

One writer: an `Outbox(writer=True)` holds an exclusive OS lock on `writer.lock` in the
folder (`lowprec.base.writer_lock`) from before it reads the journal until `close()` (or
its process ends, however it ends); a second writer, in this process or another, is
refused with `WriterBusyError` naming the live one. `sync_run_dir` takes the same lock
while it sends, so it never sends beside a live run's own sender (that run sends its
records itself) and a `--resume` never starts while a sync is sending.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from lowprec.base.writer_lock import WriterLock
from lowprec.state.durable import write_text_atomically

__all__ = ["Outbox", "SendResult", "SendError", "server_answers", "sync_run_dir", "local_artifact_location",
           "ensure_experiment", "WRITER_LOCK"]

OUTBOX, ACK, RUN_INFO, REJECTED = "outbox.jsonl", "outbox.ack", "run.json", "rejected.jsonl"
WRITER_LOCK = "writer.lock"
MAX_METRICS, MAX_PARAMS_TAGS, MAX_ENTITIES, MAX_REQUEST_BYTES = 1000, 100, 1000, 900_000
# MLflow error codes that mean "this record will never be accepted", not "try again later".
PERMANENT = {"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "RESOURCE_DOES_NOT_EXIST", "INVALID_STATE",
             "MALFORMED_REQUEST", "PERMISSION_DENIED"}


class SendError(RuntimeError):
    """The server could not be reached or failed transiently; the records stay buffered."""


@dataclass
class SendResult:
    sent: int          # records acknowledged in this call
    rejected: int      # records the server refused as invalid (in rejected.jsonl)
    pending: int       # records still buffered
    error: str = ""    # why sending stopped early ("" when everything went out)


def server_answers(tracking_uri: str, timeout: float = 2.0) -> bool:
    """True unless `tracking_uri` is an HTTP server that does not answer `/health` in time."""
    if not tracking_uri.startswith(("http://", "https://")):
        return True
    try:
        with urllib.request.urlopen(tracking_uri.rstrip("/") + "/health", timeout=timeout) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001 - any failure means "not now"
        return False


def _dumps(rec: dict) -> str:
    return json.dumps(rec, sort_keys=True, separators=(",", ":"))  # NaN/Inf stay (Python reads them)


class Outbox:
    """Journal + ack pointer of one run directory. Thread-safe within a process."""

    def __init__(self, run_dir: str | os.PathLike, writer: bool = False):
        """`writer`: this process appends (the tracker); it holds the folder's writer lock until
        `close()` (WriterBusyError when a live process holds it). Only a writer cuts a torn last
        line (left by a killed writer), a reader (`lowprec sync`) just stops before it."""
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.writer_lock = (WriterLock.take(self.dir / WRITER_LOCK, f"the tracking outbox {self.dir}")
                            if writer else None)
        self.path, self.ack_path = self.dir / OUTBOX, self.dir / ACK
        self._lock = threading.Lock()        # journal appends
        self._send_lock = threading.Lock()   # one sender at a time
        self._seq, self._end = self._scan(writer)
        self.info = self.read_info()

    def close(self) -> None:
        """Let go of the writer lock (a writer's; idempotent)."""
        if self.writer_lock is not None:
            self.writer_lock.release()

    # ------------------------------------------------------------------ journal
    def _scan(self, writer: bool) -> tuple[int, int]:
        """Last sequence number and the byte offset after the last complete line (reads the tail)."""
        if not self.path.exists():
            return 0, 0
        size, tail = self.path.stat().st_size, 1 << 16
        with open(self.path, "rb") as f:
            while True:  # grow the tail until it holds the last complete line
                f.seek(max(size - tail, 0))
                data, start = f.read(), max(size - tail, 0)
                end = data.rfind(b"\n") + 1
                prev = data.rfind(b"\n", 0, max(end - 1, 0))
                if prev >= 0 or start == 0:
                    break
                tail *= 4
        if writer and start + end < size:  # a torn last line (killed mid-write): drop it
            with open(self.path, "r+b") as f:
                f.truncate(start + end)
        last = data[prev + 1:end].strip()
        return (json.loads(last)["seq"] if last else 0), start + end

    def append(self, records: list[dict]) -> int:
        """Give the records sequence numbers, append and fsync them; returns the last seq."""
        if not records:
            return self._seq
        with self._lock:
            lines = []
            for r in records:
                self._seq += 1
                lines.append(_dumps({**r, "seq": self._seq}) + "\n")
            data = "".join(lines).encode()
            with open(self.path, "ab") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            self._end += len(data)
            return self._seq

    def acked(self) -> tuple[int, int]:
        try:
            a = json.loads(self.ack_path.read_text())
            return int(a["seq"]), int(a["offset"])
        except (FileNotFoundError, ValueError, KeyError):
            return 0, 0

    def _ack(self, seq: int, offset: int) -> None:
        tmp = self.ack_path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.write(json.dumps({"seq": seq, "offset": offset}))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.ack_path)

    def pending(self, max_bytes: int = 8 << 20) -> list[tuple[dict, int]]:
        """The oldest unsent records (about `max_bytes` of them), each with the byte offset after it."""
        _, offset = self.acked()
        with self._lock:
            end = self._end
        if end <= offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(offset)
            data = f.read(min(end - offset, max_bytes))
        if offset + len(data) < end:  # cut at the last whole record (one longer than max_bytes: read it all)
            cut = data.rfind(b"\n") + 1
            if cut:
                data = data[:cut]
            else:
                with open(self.path, "rb") as f:
                    f.seek(offset)
                    data = f.readline()
        out, pos = [], offset
        for line in data.splitlines(keepends=True):
            pos += len(line)
            out.append((json.loads(line), pos))
        return out

    def n_pending(self) -> int:
        return self._seq - self.acked()[0]

    # ------------------------------------------------------------------ run info
    def read_info(self) -> dict:
        p = self.dir / RUN_INFO
        return json.loads(p.read_text()) if p.exists() else {}

    def write_info(self, **kw) -> None:
        self.info = {**self.read_info(), **kw}
        write_text_atomically(self.dir / RUN_INFO, json.dumps(self.info, indent=1, sort_keys=True))

    # ------------------------------------------------------------------ sending
    def send(self, client, deadline: float | None = None) -> SendResult:
        """Send what is pending, in order, batched; stop at the first transient failure."""
        with self._send_lock:
            sent = rejected = 0
            try:
                while batch := self.pending():
                    for group in _groups(batch):
                        if deadline is not None and time.monotonic() > deadline:
                            return SendResult(sent, rejected, self.n_pending(), "deadline reached")
                        rejected += self._send_group(client, group)
                        self._ack(group[-1][0]["seq"], group[-1][1])
                        sent += len(group)
            except SendError as e:
                return SendResult(sent, rejected, self.n_pending(), str(e))
            return SendResult(sent, rejected, self.n_pending())

    def _send_group(self, client, group: list[tuple[dict, int]]) -> int:
        """Send one group; a permanently refused batch is retried record by record."""
        try:
            _apply(client, self, [r for r, _ in group])
            return 0
        except Exception as e:  # noqa: BLE001
            if not _permanent(e):
                raise SendError(f"{type(e).__name__}: {str(e)[:300]}") from None
            if len(group) > 1 or len(_split(group[0][0])) > 1:
                return sum(self._send_one(client, piece) for r, _ in group for piece in _split(r))
            self._reject(group[0][0], e)
            return 1

    def _send_one(self, client, rec: dict) -> int:
        try:
            _apply(client, self, [rec])
            return 0
        except Exception as e:  # noqa: BLE001
            if not _permanent(e):
                raise SendError(f"{type(e).__name__}: {str(e)[:300]}") from None
            self._reject(rec, e)
            return 1

    def _reject(self, rec: dict, err: Exception) -> None:
        with open(self.dir / REJECTED, "a") as f:
            f.write(_dumps({"record": rec, "error": f"{type(err).__name__}: {str(err)[:2000]}"}) + "\n")


def _permanent(e: Exception) -> bool:
    return getattr(e, "error_code", None) in PERMANENT or isinstance(e, (FileNotFoundError, ValueError))


def _split(rec: dict) -> list[dict]:
    """A batch record cut into single entries (to isolate the one the server refuses)."""
    if rec["op"] == "params":
        return [{**rec, "params": {k: v}} for k, v in rec["params"].items()]
    if rec["op"] == "tags":
        return [{**rec, "tags": {k: v}} for k, v in rec["tags"].items()]
    if rec["op"] == "metrics":
        return [{**rec, "metrics": [m]} for m in rec["metrics"]]
    return [rec]


_BATCHABLE = ("params", "tags", "metrics")


def _size(rec: dict) -> tuple[int, int, int]:
    if rec["op"] == "metrics":
        return len(rec["metrics"]), 0, len(_dumps(rec))
    if rec["op"] in ("params", "tags"):
        return 0, len(rec[rec["op"]]), len(_dumps(rec))
    return 0, 0, 0


def _groups(pending: list[tuple[dict, int]]):
    """Consecutive batchable records merged up to MLflow's log_batch limits; others alone."""
    group, m, pt, nbytes = [], 0, 0, 0
    for item in pending:
        rec = item[0]
        if rec["op"] not in _BATCHABLE:
            if group:
                yield group
            group, m, pt, nbytes = [], 0, 0, 0
            yield [item]
            continue
        dm, dpt, db = _size(rec)
        if group and (m + dm > MAX_METRICS or pt + dpt > MAX_PARAMS_TAGS or m + pt + dm + dpt > MAX_ENTITIES
                      or nbytes + db > MAX_REQUEST_BYTES):
            yield group
            group, m, pt, nbytes = [], 0, 0, 0
        group.append(item)
        m, pt, nbytes = m + dm, pt + dpt, nbytes + db
    if group:
        yield group


def _chunks(items: list, n: int):
    for i in range(0, len(items), n):
        yield items[i:i + n]


def _apply(client, box: Outbox, records: list[dict]) -> None:
    """Perform the records against MLflow (the client of `mlflow.tracking.MlflowClient`)."""
    from mlflow.entities import Metric, Param, RunTag

    op = records[0]["op"]
    if op == "create_run":
        _create_run(client, box, records[0])
        return
    run_id = box.info.get("run_id")
    if not run_id:
        raise SendError("the run has not been created yet")
    if op in _BATCHABLE:
        params, tags, metrics = {}, {}, []
        for r in records:
            params.update(r.get("params", {}))
            tags.update(r.get("tags", {}))  # a later value of a tag wins
            metrics.extend(r.get("metrics", []))
        ms = [Metric(k, float(v), int(ts), int(step)) for k, v, ts, step in metrics]
        pt = [Param(k, v) for k, v in params.items()] + [RunTag(k, v) for k, v in tags.items()]
        if len(ms) <= MAX_METRICS and len(pt) <= MAX_PARAMS_TAGS:
            client.log_batch(run_id, metrics=ms, params=[x for x in pt if isinstance(x, Param)],
                             tags=[x for x in pt if isinstance(x, RunTag)])
        else:  # a single oversized record (a huge config): several requests
            for c in _chunks(ms, MAX_METRICS):
                client.log_batch(run_id, metrics=c)
            for c in _chunks(pt, MAX_PARAMS_TAGS):
                client.log_batch(run_id, params=[x for x in c if isinstance(x, Param)],
                                 tags=[x for x in c if isinstance(x, RunTag)])
    elif op == "artifact":
        rec = records[0]
        path = box.dir / rec["file"]
        if path.is_dir():
            client.log_artifacts(run_id, str(path), rec.get("artifact_path"))
        else:
            client.log_artifact(run_id, str(path), rec.get("artifact_path"))
    elif op == "terminate":
        client.set_terminated(run_id, records[0]["status"], end_time=records[0]["end_time"])
    elif op == "reopen":
        client.update_run(run_id, status="RUNNING")
    else:
        raise ValueError(f"unknown outbox record op {op!r}")


def local_artifact_location(tracking_uri: str, experiment: str) -> str | None:
    """For a SQLite store, artifacts next to the database file (`<db dir>/mlruns/<name>`),
    not in MLflow's default `./mlruns` under whatever the working directory happens to be."""
    if not tracking_uri.startswith("sqlite:///") or tracking_uri.endswith(":memory:"):
        return None
    db = Path(tracking_uri[len("sqlite:///"):]).resolve()
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in experiment)
    return (db.parent / "mlruns" / name).as_uri()


def ensure_experiment(client, name: str) -> str:
    """The id of experiment `name`, created where it is missing the way every lowprec run
    creates it: artifacts beside a SQLite store's database (`local_artifact_location`), and
    shown by the UI as training runs (a "custom model development" experiment, not GenAI)."""
    exp = client.get_experiment_by_name(name)
    return exp.experiment_id if exp is not None else client.create_experiment(
        name, local_artifact_location(client.tracking_uri, name),
        tags={"mlflow.experimentKind": "custom_model_development"})


def _create_run(client, box: Outbox, rec: dict) -> None:
    if box.info.get("run_id"):
        return
    exp_id = ensure_experiment(client, rec["experiment"])
    found = client.search_runs([exp_id], filter_string=f"tags.`lowprec.run_uid` = '{rec['uid']}'",
                               max_results=1)
    if found:  # created before, the answer was lost
        run = found[0]
    else:
        run = client.create_run(exp_id, start_time=rec["start_time"], run_name=rec["run_name"],
                                tags={**rec.get("tags", {}), "lowprec.run_uid": rec["uid"]})
    box.write_info(run_id=run.info.run_id, experiment_id=exp_id)


def sync_run_dir(run_dir: str | os.PathLike, tracking_uri: str | None = None,
                 timeout: float | None = None) -> SendResult:
    """Send what a run directory's outbox still holds (`lowprec sync RUN_DIR`), holding its writer
    lock meanwhile: WriterBusyError when a live run (or another sync) writes it."""
    from lowprec.tracking.store import mlflow_client

    d = Path(run_dir)
    if not (d / OUTBOX).exists() or not (d / RUN_INFO).exists():
        raise FileNotFoundError(f"{d} holds no {OUTBOX} and {RUN_INFO}: pass the buffer_dir a Tracker wrote")
    with WriterLock.take(d / WRITER_LOCK, f"the tracking outbox {d}"):
        box = Outbox(d)
        uri = tracking_uri or box.info.get("tracking_uri")
        if not uri:
            raise ValueError(f"{d / RUN_INFO} names no tracking URI; pass one (--tracking-uri)")
        if not server_answers(uri):
            return SendResult(0, 0, box.n_pending(), f"the tracking server {uri} does not answer")
        deadline = None if timeout is None else time.monotonic() + timeout
        return box.send(mlflow_client(uri), deadline)
