"""The tracker's journal: what the training thread queues (records, files, events, the
precision map) drained by one background thread, turned into outbox records (writing the
files they upload) and appended to the outbox, one append (one fsync) per batch; `flush`
items are set once everything queued before them is in the journal. A mixin of
`lowprec.tracking.tracker.Tracker`, whose queue, outbox and files it uses."""

from __future__ import annotations

import json
import logging
import queue
import threading

from lowprec.state.durable import write_text_atomically
from lowprec.tracking.records import MAX_TAG_VALUE, fit_value
from lowprec.tracking.report_sources import events_table, events_tags

__all__ = ["Journal"]

log = logging.getLogger("lowprec.tracking")


def _artifact(name: str) -> dict:
    """The outbox record uploading files/NAME: `evals/x.json` becomes the artifact `evals/x.json`."""
    return {"op": "artifact", "file": f"files/{name}", "artifact_path": name.rpartition("/")[0] or None}


class Journal:
    """Queue -> outbox records -> outbox, on the journal thread (module docstring)."""

    def _put(self, item) -> None:
        if self._finished:
            raise RuntimeError("the tracker is finished; a new run needs a new Tracker with another buffer_dir")
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            log.warning("lowprec tracking: queue full (local disk slow?); waiting for the journal")
            self._queue.put(item)

    def _journal_flush(self, timeout: float) -> bool:
        if not self._journal.is_alive():
            return True
        done = threading.Event()
        self._put(("flush", done))
        return done.wait(timeout)

    def _journal_loop(self) -> None:
        """Drain the queue in batches: one journal append (one fsync) per batch."""
        while True:
            items = [self._queue.get()]
            while len(items) < 1000 and items[-1] is not None:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            recs, flushed = [], []
            for item in items:
                if item is None:
                    continue
                if item[0] == "flush":
                    flushed.append(item[1])
                    continue
                try:
                    recs += self._records(item)
                except Exception as e:  # noqa: BLE001
                    log.warning("lowprec tracking: could not journal a %s record (%s: %s)", item[0],
                                type(e).__name__, e)
            try:
                if self._resume is not None:
                    recs = self._resume.records(recs)
                self.outbox.append(recs)
            except Exception as e:  # noqa: BLE001 - the disk: nothing to do but say so
                log.warning("lowprec tracking: could not write %s (%s: %s)", self.outbox.path, type(e).__name__, e)
            for done in flushed:  # set only once what came before them is in the journal
                done.set()
            if items[-1] is None:
                return

    def _write(self, name: str, text: str) -> None:
        p = self.files / name
        p.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(p, text)   # the sender reads the old or the new file, never half of one

    def _records(self, item) -> list[dict]:
        """The outbox records of one queued item (writing the files they upload)."""
        kind = item[0]
        if kind == "records":
            return item[1]
        if kind == "file":
            _, name, text, recs = item
            self._write(name, text)
            return recs + [_artifact(name)]
        if kind == "json":
            _, name, obj = item
            return self._records(("file", name, json.dumps(obj, default=str), []))
        if kind == "append":
            _, name, line = item
            if self._resume is None or self._resume.line(name, line):   # a redone eval's line is there
                with open(self.files / name, "a") as f:
                    f.write(line + "\n")
            return [_artifact(name)]
        if kind == "events":
            events = self._resume.events(item[1]) if self._resume is not None else item[1]
            if not events:
                return []
            self._event_log.append(events)
            self._events.extend(events)
            self._write("events.jsonl", "".join(e.to_json() + "\n" for e in self._events))
            self._write("events.json", json.dumps(events_table(self._events)))
            return [_artifact("events.jsonl"), _artifact("events.json"), {"op": "tags", "tags": self._events_tags()}]
        if kind == "precision":
            return self._precision_records(*item[1:])
        raise ValueError(f"unknown journal item {kind!r}")

    def _snapshot_records(self) -> list[dict]:
        """On resume: every snapshot in the buffer's files/ uploaded again, with the tags made from
        the events and the precision map. A kill can fall after a snapshot (events.jsonl,
        precision_map.json, an eval's file) was written and before its upload was journaled; the
        resumed run does not write it again (its events and its map are already there), so without
        this nothing would ever send it."""
        recs = [_artifact(p.relative_to(self.files).as_posix()) for p in sorted(self.files.rglob("*"))
                if p.is_file() and not p.name.endswith(".tmp")]
        tags = {**(self._events_tags() if self._events else {}), **self._precision.tags()}
        return recs + ([{"op": "tags", "tags": tags}] if tags else [])

    def _events_tags(self) -> dict[str, str]:
        """The `lowprec.*` tags and the run note of the events so far, each cut to MLflow's limit."""
        tags = events_tags(self._events, self.run_name)
        return {k: fit_value(v, MAX_TAG_VALUE, "events.json") for k, v in tags.items()}

    def _precision_records(self, step: int, formats: dict, share: dict, ts: int) -> list[dict]:
        rows, tags = self._precision.update(step, formats, share)
        recs: list[dict] = [{"op": "metrics", "metrics": [[k, v, ts, st] for k, v, st in rows]}]
        if tags is not None:  # the map changed: its file and its tags
            self._write("precision_map.json", json.dumps(self._precision.data, indent=1))
            recs += [_artifact("precision_map.json"), {"op": "tags", "tags": tags}]
        return recs
