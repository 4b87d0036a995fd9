"""A time limit for reads from a tracking store that may never answer.

MLflow's client waits up to two minutes per request and retries several times, so a server
that answers `/health` but not the API would hold a command for many minutes. The commands
(`lowprec gate`, `report`, `sync`) run their reads through one `Deadline`: each call runs in
a daemon thread, and when the time (shared by every call) is up, `NoAnswer` says which store
did not answer and what was being read. The abandoned thread dies with the process.

    dl = Deadline(60.0, "the tracking server http://host:5000")
    client = dl.run("listing experiments", open_client, uri)
    scores = dl.run("reading run abc's metrics", load_scores, uri, "abc", client=client)
"""

from __future__ import annotations

import threading
import time
from typing import Callable, TypeVar

__all__ = ["Deadline", "NoAnswer", "DEFAULT_TIMEOUT_S"]

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 60.0


class NoAnswer(TimeoutError):
    """The store did not answer in time (the message names it, the read, and `--timeout`)."""


class Deadline:
    """`seconds` in all for the calls made through `run` (see the module doc)."""

    def __init__(self, seconds: float, store: str):
        if not seconds > 0:
            raise ValueError(f"--timeout must be > 0 seconds, got {seconds}")
        self.seconds, self.store = float(seconds), store
        self._end = time.monotonic() + self.seconds

    def left(self) -> float:
        return max(self._end - time.monotonic(), 0.0)

    def run(self, doing: str, fn: Callable[..., T], *args, **kwargs) -> T:
        """`fn(*args, **kwargs)` if it returns (or raises) in the time left; else NoAnswer."""
        box: dict = {}

        def work():
            try:
                box["value"] = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                box["error"] = e

        t = threading.Thread(target=work, name="lowprec-deadline", daemon=True)
        t.start()
        t.join(self.left())
        if t.is_alive():
            raise NoAnswer(f"{self.store} did not answer in {self.seconds:g} s (while {doing}); check that the "
                           f"server is up and serving, or allow longer with --timeout SECONDS")
        if "error" in box:
            raise box["error"]
        return box["value"]
