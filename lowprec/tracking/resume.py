"""Whether a tracker's buffer folder may be continued, and what a continued run must not log twice.

A buffer folder (`Tracker(buffer_dir=...)`, `lowprec run`'s `<out>/tracking`) holds exactly one
MLflow run. What the folder holds decides what a new `Tracker` on it does:

    nothing                       -> a new run
    a run that never ended        -> continued with resume=True (the process was killed);
      (killed), or ended FAILED      otherwise an error
    a run that ended FINISHED     -> never continued: an error, with or without resume=True

A folder that a live process writes (its writer lock is held: `lowprec.tracking.outbox`) is
refused whatever it holds, naming that process. Nothing is continued by accident: without
`resume=True` a folder that holds a run is an error
(`BufferInUseError`, a ValueError) that says which run it holds and what to do, and a finished
run is never reopened. The state is read from the journal (its last record is `terminate` when
the run ended, `lowprec.tracking.outbox`), so it is right even when the process died right
after ending the run.

A continued run redoes the steps since its newest checkpoint; `ResumeFilter` drops, once, each
metric point and event that the journal already holds, until the run passes the step where it
stopped (after that, a rewind's redone steps are logged as in a run that never stopped), and each
line of an appended log (`evals.jsonl`: a redone eval) that the buffer's file already holds.
"""

from __future__ import annotations

import enum
import json
import os
from pathlib import Path

from lowprec.base.writer_lock import holder
from lowprec.tracking.outbox import OUTBOX, RUN_INFO, WRITER_LOCK, Outbox
from lowprec.tracking.records import RunStatus

__all__ = ["RunState", "BufferInUseError", "buffered_run", "check_buffer", "ResumeFilter"]


class RunState(enum.Enum):
    NONE = "none"               # no run in the folder
    UNFINISHED = "unfinished"   # created, never ended: the process was killed
    FAILED = "failed"           # ended FAILED or KILLED
    FINISHED = "finished"       # ended FINISHED


class BufferInUseError(ValueError):
    """The buffer folder holds a run that this tracker may not continue."""


def _last_record(path: Path) -> dict | None:
    """The journal's last complete record (read from its tail; a torn last line is skipped)."""
    if not path.exists():
        return None
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        tail = 1 << 16
        while True:
            f.seek(max(size - tail, 0))
            data = f.read()
            lines = data[:data.rfind(b"\n") + 1].splitlines()
            if len(lines) >= 2 or tail >= size:
                break
            tail *= 4
    return json.loads(lines[-1]) if lines and lines[-1].strip() else None


def buffered_run(buffer_dir: str | os.PathLike) -> tuple[RunState, dict]:
    """What the folder holds and its run.json (reads only; creates nothing)."""
    d = Path(buffer_dir)
    p = d / RUN_INFO
    info = json.loads(p.read_text()) if p.is_file() else {}
    if not info.get("uid"):
        return RunState.NONE, info
    last = _last_record(d / OUTBOX)
    if last is None or last.get("op") != "terminate":
        return RunState.UNFINISHED, info
    return (RunState.FINISHED if last.get("status") == RunStatus.FINISHED else RunState.FAILED), info


def check_buffer(buffer_dir: str | os.PathLike, resume: bool, held: bool = False) -> RunState:
    """The folder's state when a tracker may use it as asked (see the module doc); else
    BufferInUseError naming the run and the fix. held: this process holds the folder's writer
    lock (a Tracker); otherwise a live writer (a running run, a `lowprec sync`) is refused first."""
    who = None if held else holder(Path(buffer_dir) / WRITER_LOCK)
    if who is not None:
        raise BufferInUseError(f"{buffer_dir} is being written by a live process ({who.describe()}); a buffer "
                               f"folder has one writer: wait for it to end, or track in another buffer folder "
                               f"(`lowprec run`: another --out)")
    state, info = buffered_run(buffer_dir)
    if state is RunState.NONE:
        return state
    run = f"the MLflow run {info.get('run_id') or '(not sent yet, uid ' + info['uid'] + ')'}"
    run += f" named {info['run_name']!r}" if info.get("run_name") else ""
    run += f" in {info['tracking_uri']}" if info.get("tracking_uri") else ""
    if state is RunState.FINISHED:
        raise BufferInUseError(
            f"{buffer_dir} holds {run}, which finished; a finished run is never continued. Track a new run "
            f"in another buffer folder (`lowprec run`: another --out)")
    if not resume:
        how = "ended FAILED" if state is RunState.FAILED else "stopped without finishing (its process is gone)"
        raise BufferInUseError(
            f"{buffer_dir} holds {run}, which {how}; continue it with resume=True "
            f"(`lowprec run CONFIG --out DIR --resume`), or track a new run in another buffer folder "
            f"(another --out)")
    return state


class ResumeFilter:
    """Drops the metric points and events a continued run logs again (see the module doc)."""

    def __init__(self, steps: dict[str, set[int]], events: dict[tuple, int], files: Path | None = None):
        self._steps = steps     # metric key -> steps in the journal, until the run passes them
        self._top = {k: max(v) for k, v in steps.items() if v}
        self._events = events   # (step, kind, sites, stage) -> how many the journal holds
        self._files = files     # the buffer's files/ (appended logs such as evals.jsonl)
        self._lines: dict[str, dict] = {}   # file name -> line key -> how many the file holds

    @classmethod
    def from_journal(cls, outbox: Outbox, events) -> "ResumeFilter":
        steps: dict[str, set[int]] = {}
        if outbox.path.exists():
            with open(outbox.path, "rb") as f:
                for line in f:
                    if not line.endswith(b"\n"):
                        break
                    rec = json.loads(line)
                    if rec.get("op") == "metrics":
                        for key, _, _, step in rec["metrics"]:
                            steps.setdefault(key, set()).add(int(step))
        counts: dict[tuple, int] = {}
        for e in events:
            counts[_event_key(e)] = counts.get(_event_key(e), 0) + 1
        return cls(steps, counts, outbox.dir / "files")

    def records(self, recs: list[dict]) -> list[dict]:
        """The records with metric points the journal already holds taken out."""
        out = []
        for r in recs:
            if r.get("op") == "metrics" and self._steps:
                rows = [m for m in r["metrics"] if self._keep(m[0], int(m[3]))]
                if not rows:
                    continue
                r = {**r, "metrics": rows}
            out.append(r)
        return out

    def _keep(self, key: str, step: int) -> bool:
        seen = self._steps.get(key)
        if seen is None:
            return True
        if step > self._top[key]:  # past where the run stopped: no more filtering of this key
            del self._steps[key]
            return True
        if step in seen:
            seen.discard(step)
            return False
        return True

    def line(self, name: str, line: str) -> bool:
        """Whether a line for the appended file `name` (e.g. evals.jsonl) is new: a line with the
        same step and prefix that the file already holds is dropped, once (a redone eval)."""
        if name not in self._lines:
            p = self._files / name if self._files is not None else None
            counts: dict = {}
            if p is not None and p.is_file():
                for old in p.read_text().splitlines():
                    if old.strip():
                        counts[_line_key(old)] = counts.get(_line_key(old), 0) + 1
            self._lines[name] = counts
        counts, k = self._lines[name], _line_key(line)
        if counts.get(k):
            counts[k] -= 1
            return False
        return True

    def events(self, events: list) -> list:
        out = []
        for e in events:
            k = _event_key(e)
            if self._events.get(k):
                self._events[k] -= 1
                continue
            out.append(e)
        return out


def _event_key(e) -> tuple:
    return (int(e.step), e.kind, tuple(e.sites), e.stage)


def _line_key(line: str):
    try:
        d = json.loads(line)
    except ValueError:
        return line
    return (d.get("step"), d.get("prefix")) if isinstance(d, dict) and "step" in d else line
