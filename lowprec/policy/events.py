"""Controller events: what was decided, when, about which sites, and on what evidence.

An `Event` is the unit of record for every precision decision: a stage promotion, a
site's fallback, a stage rollback, a rewind, a quarantine, a gate verdict. Events are
plain data (strings, ints, floats), written one JSON object per line to an append-only
`EventLog` (flushed and fsynced per event, so a killed run loses none it reported), and
handed to the tracker. Replaying the events over the initial precision map gives the map
at any step (`replay`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

from lowprec.base.writer_lock import WriterLock

__all__ = ["EventKind", "Event", "EventLog", "replay", "read_events", "describe", "site_list", "SHOWN_SITES"]


class EventKind:
    """The kinds of events (strings, so the JSONL log stays readable)."""

    PROMOTE = "promote"          # a stage's sites moved down to its target format
    FALLBACK = "fallback"        # one site moved one rung up its ladder (its own signals)
    ROLLBACK = "rollback"        # a stage's sites moved back up (a global signal)
    RETRY = "retry"              # a site re-promoted after its cooldown
    QUARANTINE = "quarantine"    # a site may no longer go below its current format
    REWIND = "rewind"            # training restarts from a checkpoint, skipping batches
    SKIP_STEP = "skip_step"      # the optimizer step was skipped (an anomalous step)
    GATE = "gate"                # an evaluation gate's verdict
    REPLAY = "replay"            # an anomalous step replayed with `sites` in high precision
    ACCEPT = "accept"            # a persistent anomaly accepted as the new normal (no rewind)
    HOLD = "hold"                # a promotion held back (the learning-rate sensitivity is rising)
    WINDOW = "window"            # a slow signal's window looked at / trained again with `sites` in high precision
    NOT_PRECISION = "not_precision"   # a slow signal that high precision did not close: nothing demoted
    INCONCLUSIVE = "inconclusive"     # precision suspected, but the replay is inside the noise margin: nothing demoted
    ROUTER_FAULT = "router_fault"     # a MoE layer's router collapsed: its experts not judged, nothing demoted
    ALL = (PROMOTE, FALLBACK, ROLLBACK, RETRY, QUARANTINE, REWIND, SKIP_STEP, GATE, REPLAY, ACCEPT, HOLD, WINDOW,
           NOT_PRECISION, INCONCLUSIVE, ROUTER_FAULT)
    CHANGES_FORMATS = (PROMOTE, FALLBACK, ROLLBACK, RETRY)


def _clean(v):
    """JSON-safe evidence: floats stay floats (NaN/Inf as strings), containers recurse."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


@dataclass(frozen=True)
class Event:
    step: int
    kind: str
    sites: tuple[str, ...] = ()
    from_format: dict[str, str] = field(default_factory=dict)   # site -> format before
    to_format: dict[str, str] = field(default_factory=dict)     # site -> format after
    reason: str = ""
    evidence: dict = field(default_factory=dict)
    stage: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in EventKind.ALL:
            raise ValueError(f"unknown event kind {self.kind!r}; known: {', '.join(EventKind.ALL)}")

    def to_json(self) -> str:
        d = asdict(self)
        d["sites"] = list(self.sites)
        d["evidence"] = _clean(self.evidence)
        return json.dumps(d, sort_keys=True, allow_nan=False)

    @classmethod
    def from_dict(cls, d: dict) -> "Event":
        return cls(step=int(d["step"]), kind=d["kind"], sites=tuple(d.get("sites", ())),
                   from_format=dict(d.get("from_format", {})), to_format=dict(d.get("to_format", {})),
                   reason=d.get("reason", ""), evidence=dict(d.get("evidence", {})), stage=d.get("stage"))

    def summary(self) -> str:
        """One line: `step 30 replay: blocks.0.mlp.fc, blocks.1.mlp.fc, blocks.2.mlp.fc +13 more
        [replayed with 16 site(s) in high precision: clean]` (`describe`)."""
        what = describe(self)
        return f"step {self.step} {self.kind}{' ' + self.stage if self.stage else ''}" + (f": {what}" if what else "")


SHOWN_SITES = 3   # an event's one-line summary names this many sites, then `+N more`


def site_list(sites, n: int = SHOWN_SITES) -> str:
    """`a, b, c +13 more`: the first `n` sites by name, then how many more."""
    sites = list(sites)
    more = f" +{len(sites) - n} more" if len(sites) > n else ""
    return ", ".join(sites[:n]) + more


def describe(e: Event, n: int = SHOWN_SITES) -> str:
    """What an event did, in one line: the sites it acted on (the first `n` by name, then
    `+N more`), the formats they moved between, and the reason in brackets. The one wording
    of an event everywhere it is shown (the run's summary and MLflow note, `lowprec report`)."""
    parts = []
    if e.sites:
        moves = {(e.from_format.get(s, "?"), e.to_format[s]) for s in e.sites if s in e.to_format}
        if not moves:                 # acted on the sites without moving them (replay, quarantine)
            parts.append(site_list(e.sites, n))
        elif len(moves) == 1 and all(s in e.to_format for s in e.sites):   # one move for all
            (frm, to), = moves
            parts.append(f"{site_list(e.sites, n)} {frm}->{to}")
        else:
            each = [f"{s} {e.from_format.get(s, '?')}->{e.to_format[s]}" if s in e.to_format else s
                    for s in e.sites]
            parts.append(site_list(each, n))
    if e.reason:
        parts.append(f"[{e.reason}]")
    return " ".join(parts)


class EventLog:
    """Append-only JSONL file of events; each append is flushed and fsynced.

    exclusive: this log is the file's one writer: an OS lock on `<file>.lock` is held from
    here until `close()` or the end of the process (`lowprec.base.writer_lock`); a second
    writer is refused with WriterBusyError naming the live one."""

    def __init__(self, path: str | os.PathLike, exclusive: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = (WriterLock.take(self.path.with_name(self.path.name + ".lock"), f"the event log {self.path}")
                      if exclusive else None)

    def close(self) -> None:
        """Let go of the writer lock (an exclusive log's; idempotent)."""
        if self._lock is not None:
            self._lock.release()

    def append(self, events: Iterable[Event]) -> None:
        lines = "".join(e.to_json() + "\n" for e in events)
        if not lines:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(lines)
            f.flush()
            os.fsync(f.fileno())

    def rewrite(self, events: Iterable[Event]) -> None:
        """Replace the file with exactly `events` (atomically: a temporary file, fsynced, renamed)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(e.to_json() + "\n" for e in events))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def read(self) -> list[Event]:
        return read_events(self.path)


def read_events(path: str | os.PathLike) -> list[Event]:
    """Events of a JSONL log; a torn last line (a process killed mid-write) is ignored."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    lines = p.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(Event.from_dict(json.loads(line)))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{p}: line {i + 1} is not a JSON event: {line[:80]!r}") from None
    return out


def replay(initial: dict[str, str], events: Iterable[Event], until_step: int | None = None) -> dict[str, str]:
    """The precision map (site -> format name) after the events up to `until_step` (inclusive)."""
    current = dict(initial)
    for e in events:
        if until_step is not None and e.step > until_step:
            break
        if e.kind in EventKind.CHANGES_FORMATS:
            for site, fmt in e.to_format.items():
                if site not in current:
                    raise KeyError(f"event at step {e.step} names site {site!r}, which the initial map lacks")
                current[site] = fmt
    return current
