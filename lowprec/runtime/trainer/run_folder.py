"""A `lowprec run` folder: one writer (an OS lock on `run.lock`), and what the folder holds, in words.

    with RunFolder.take(out, rank=rank):      # RunFolderBusyError: a live run writes it
        status = inspect_folder(out)         # NEW, FINISHED, STOPPED (resumable) ...
        line = refusal(status, resume=..., config=...)   # the one line when the request cannot go on
        ... train ...

The lock is taken before anything is written to the folder and held until the run ends;
the operating system drops it when the process dies, however it dies, so a SIGKILLed
run's folder can be resumed at once (`lowprec.base.writer_lock`). Under torchrun, rank 0
takes it for the whole job (`take(out, rank=r)` holds nothing on the other ranks): the
launcher shares rank 0's outcome, so that every rank stops when rank 0 is refused.

What the folder holds is read from its files, never guessed: ALIVE when a process holds its
lock (its pid and host are named); FINISHED when the tracked MLflow run ended FINISHED, or
(untracked) when `summary.json`, written at a run's end, is newer than its newest
checkpoint; STOPPED when it holds checkpoints or a tracked run that did not finish and no
process writes it (it was killed: `--resume` continues it); NEW otherwise.
"""

from __future__ import annotations

import enum
import shlex
from dataclasses import dataclass
from pathlib import Path

from lowprec.base.writer_lock import Holder, WriterBusyError, WriterLock, holder

__all__ = ["RUN_LOCK", "FolderState", "FolderStatus", "RunFolder", "RunFolderBusyError", "inspect_folder",
           "refusal", "alive_line", "run_command"]

RUN_LOCK = "run.lock"


class FolderState(enum.Enum):
    NEW = "new"              # nothing of a run: a run starts here
    ALIVE = "alive"          # a live process writes it
    FINISHED = "finished"    # a run ended here
    STOPPED = "stopped"      # a run that did not finish, and no process writes it: resumable


@dataclass(frozen=True)
class FolderStatus:
    folder: Path
    state: FolderState
    holder: Holder | None = None     # ALIVE: who
    step: int | None = None          # the newest checkpoint's step (where --resume starts)
    run_id: str | None = None        # the tracked MLflow run


def alive_line(folder: Path, who: Holder, what: str = "run") -> str:
    """What a refusal says of a live writer: who it is and what to do."""
    stop = f"`kill {who.pid}` on {who.host}" if who.pid is not None and who.host else "stop it"
    return (f"{folder} is in use: a live {what} writes it ({who.describe()}); a run folder has one writer. "
            f"Wait for it to end, or {stop} and continue it with --resume, or give a new --out")


class RunFolderBusyError(RuntimeError):
    """A live process writes the run folder; the message names it and what to do."""

    def __init__(self, folder: Path, who: Holder):
        self.folder, self.holder = folder, who
        super().__init__(alive_line(folder, who))


class RunFolder:
    """The run folder's lock for this process (rank 0's for a job); `take` makes one."""

    def __init__(self, folder: Path, lock: WriterLock | None, created: list[Path]):
        self.folder, self._lock, self._created = folder, lock, created   # created: folders made, deepest first

    @classmethod
    def take(cls, folder: str | Path, *, rank: int = 0, held_by: int | None = None) -> "RunFolder":
        """Lock `folder` (made if absent) for this run, or RunFolderBusyError naming the live
        writer. Ranks other than 0 get a RunFolder that holds nothing, and so does rank 0 when
        the process `held_by` (the `lowprec run --nproc-per-node` launcher that started it)
        holds the lock: the launcher holds it from its first check until the last rank exits."""
        folder = Path(folder)
        if rank != 0:
            return cls(folder, None, [])
        if held_by is not None:
            who = holder(folder / RUN_LOCK)
            if who is not None and who.pid == held_by:
                return cls(folder, None, [])
        created = [p for p in (folder, *folder.parents) if not p.exists()]
        folder.mkdir(parents=True, exist_ok=True)
        try:
            lock = WriterLock.take(folder / RUN_LOCK, f"the run folder {folder}")
        except WriterBusyError as e:
            raise RunFolderBusyError(folder, e.holder) from None
        return cls(folder, lock, created)

    @property
    def held(self) -> bool:
        return self._lock is not None and self._lock.held

    def status(self) -> FolderStatus:
        """What the folder holds, seen by its lock holder (never ALIVE: the writer is this run)."""
        return inspect_folder(self.folder, mine=True)

    def release(self) -> None:
        """Let go of the folder. A folder this process made and left holding nothing but the
        lock (a refused run) is removed: a refusal leaves nothing behind."""
        if self._lock is None:
            return
        bare = bool(self._created) and [p.name for p in self.folder.iterdir()] == [RUN_LOCK]
        self._lock.release(remove=bare)
        if bare:
            for p in self._created:   # the run folder, then the parents made for it (runs/)
                try:
                    p.rmdir()
                except OSError:   # something else is in it: it stays
                    break

    def __enter__(self) -> "RunFolder":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _newest_checkpoint(folder: Path) -> tuple[int | None, float]:
    from lowprec.state.checkpoint import list_checkpoints
    ckpts = list_checkpoints(folder / "checkpoints") if (folder / "checkpoints").is_dir() else []
    if not ckpts:
        return None, 0.0
    step, path = ckpts[-1]
    return step, path.stat().st_mtime


def inspect_folder(folder: str | Path, *, mine: bool = False) -> FolderStatus:
    """What the run folder holds now (reads only; see the module doc). mine: this process holds
    the folder's lock (`RunFolder.status()`), so what is there is another run's past, not alive."""
    from lowprec.tracking.resume import RunState, buffered_run
    folder = Path(folder)
    if not folder.is_dir():
        return FolderStatus(folder, FolderState.NEW)
    who = None if mine else holder(folder / RUN_LOCK)
    step, ckpt_time = _newest_checkpoint(folder)
    tracked, info = buffered_run(folder / "tracking")
    run_id = info.get("run_id")
    if who is not None:
        return FolderStatus(folder, FolderState.ALIVE, who, step, run_id)
    summary = folder / "summary.json"
    if tracked is RunState.FINISHED or (tracked is RunState.NONE and summary.is_file()
                                        and summary.stat().st_mtime >= ckpt_time):
        return FolderStatus(folder, FolderState.FINISHED, None, step, run_id)
    if step is not None or tracked is not RunState.NONE:
        return FolderStatus(folder, FolderState.STOPPED, None, step, run_id)
    return FolderStatus(folder, FolderState.NEW)


def run_command(config: str | Path, out: str | Path, *, nproc: int = 1, resume: bool = False) -> str:
    """The `lowprec run` command line (in backquotes) for `config` on `out`; a config that trains
    on `nproc` > 1 processes starts them with --nproc-per-node, as it must."""
    launch = f" --nproc-per-node {nproc}" if nproc > 1 else ""
    return (f"`lowprec run{launch} {shlex.quote(str(config))} --out {shlex.quote(str(out))}"
            f"{' --resume' if resume else ''}`")


def refusal(status: FolderStatus, *, resume: bool, config: str, tracked: bool, nproc: int = 1) -> str | None:
    """The one line that refuses `lowprec run` (with `resume`) on this folder, or None when it
    may go on: a new run on NEW, a resume of STOPPED (and of an untracked FINISHED run, which
    trains the steps a larger --steps adds). nproc: the processes the config trains on (the
    commands it suggests start that many)."""
    f, st = status.folder, status.state
    run = f"the MLflow run {status.run_id}" if status.run_id else "a run"
    if st is FolderState.ALIVE:
        return alive_line(f, status.holder)
    if st is FolderState.FINISHED and tracked:
        return f"{f} holds {run}, which finished; a finished run is not continued: give a new --out to train again"
    if st is FolderState.FINISHED and not resume:   # untracked: no MLflow run to keep closed
        return (f"{f} holds {run}, which finished: give a new --out to train again, or train it further with "
                f"--resume and a larger --steps")
    if st is FolderState.STOPPED and not resume:
        where = (f"from its checkpoint at step {status.step}" if status.step is not None
                 else "from step 0 (it has no checkpoint)")
        return (f"{f} holds {run}, which stopped without finishing; no process writes it (it was killed). "
                f"Continue it {where} with {run_command(config, f, nproc=nproc, resume=True)}, or give a new --out")
    return None
