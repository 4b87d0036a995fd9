"""One writer per file or folder: an exclusive OS lock, held for the life of the writer.

    lock = WriterLock.take(folder / "run.lock", "the run folder")   # WriterBusyError: a live process has it
    ...                                                              # write
    lock.release()                                                   # or the process ends

The lock is `fcntl.flock(LOCK_EX)` on a small lock file. The operating system drops it when
the holding process ends in any way (exit, exception, SIGKILL, OOM killer), so a killed
writer's file or folder is free again at once: there is no stale lock to clean up and no
pid to guess about. The holder writes who it is into the lock file (pid, host, start time,
command line) after it has the lock; `holder(path)` tells another process whether the lock
is held right now (it asks the OS, never trusts the file alone) and, when it is, by whom.

flock locks belong to an open file description: a second `take` in the same process
conflicts with the first as one in another process does (one writer, full stop), and a
child made by fork without exec shares the parent's lock until it ends. Python opens files
non-inheritable, so a program the writer starts (exec) does not hold it. Lock files stay
in place after release (removing one could let two writers lock two different files),
except by `release(remove=True)` of a holder that made the folder and is refusing before
anything else was written; `take` then checks that the file it locked is still the one
at that path.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Holder", "WriterBusyError", "WriterLock", "holder"]


@dataclass(frozen=True)
class Holder:
    """Who holds a lock (what the holder wrote into the lock file); pid None: not written yet."""
    pid: int | None
    host: str = ""
    since: str = ""          # UTC, "2026-11-27 16:50:01"
    command: str = ""

    def describe(self) -> str:
        if self.pid is None:
            return "a process that is starting (it has not written its pid yet)"
        text = f"pid {self.pid} on host {self.host or '?'}"
        return text + (f", since {self.since} UTC" if self.since else "")


class WriterBusyError(RuntimeError):
    """The lock is held by a live process (`holder` says which)."""

    def __init__(self, path: Path, what: str, who: Holder):
        self.path, self.what, self.holder = path, what, who
        super().__init__(f"{what} is being written by a live process ({who.describe()}; lock {path})")


def _read_holder(fd: int) -> Holder:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 1 << 16)
    try:
        d = json.loads(raw.decode()) if raw.strip() else {}
    except ValueError:
        d = {}
    pid = d.get("pid")
    return Holder(int(pid) if isinstance(pid, int) else None, str(d.get("host", "")), str(d.get("since", "")),
                  str(d.get("command", "")))


def _busy(fd: int, shared: bool = False, tries: int = 5) -> bool:
    """Whether another open file description holds the lock. Retried briefly: a reader's own
    short shared lock (`holder`) must not make a writer think the file is taken."""
    for i in range(tries):
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            if i + 1 < tries:
                time.sleep(0.02)
    return True


class WriterLock:
    """An exclusive lock held on `path` (see the module doc); `take` makes one."""

    def __init__(self, path: Path, fd: int, what: str):
        self.path, self.what, self._fd = path, what, fd

    @classmethod
    def take(cls, path: str | os.PathLike, what: str) -> "WriterLock":
        """Lock `path` (created if absent; its folder must exist) for this process, or raise
        WriterBusyError naming the live holder. `what` names the thing guarded in messages."""
        path = Path(path)
        for _ in range(10):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                if _busy(fd):
                    raise WriterBusyError(path, what, _read_holder(fd))
                try:   # the path still names the file locked (a holder may have removed it meanwhile)
                    same = os.stat(path).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
            except BaseException:
                os.close(fd)
                raise
            if same:
                lock = cls(path, fd, what)
                lock._write_holder()
                return lock
            os.close(fd)
        raise WriterBusyError(path, what, Holder(None))

    def _write_holder(self) -> None:
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "since": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "command": " ".join(sys.argv)[:2000]}
        os.ftruncate(self._fd, 0)
        os.lseek(self._fd, 0, os.SEEK_SET)
        os.write(self._fd, (json.dumps(me) + "\n").encode())

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self, remove: bool = False) -> None:
        """Let go of the lock (idempotent); `remove`: delete the lock file first."""
        if self._fd is None:
            return
        if remove:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "WriterLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):   # an abandoned holder object (never released) lets go when collected
        if getattr(self, "_fd", None) is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass


def holder(path: str | os.PathLike) -> Holder | None:
    """Who holds the lock on `path` now; None when nobody does (or there is no lock file).
    Reads only: creates nothing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        if not _busy(fd, shared=True, tries=1):
            return None
        return _read_holder(fd)
    finally:
        os.close(fd)
