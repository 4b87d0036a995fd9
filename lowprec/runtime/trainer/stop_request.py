"""Stopping `lowprec run` at a step on SIGINT (Ctrl-C) or SIGTERM (a scheduler's notice).

Without this, Ctrl-C ended a run with a Python traceback and SIGTERM (what Slurm and Kubernetes
send before they kill a job) ended it at once: both lost every step since the last periodic
checkpoint, and the MLflow run said nothing of why it stopped. Now a run told to stop:

- finishes the step it is in and, at the next step boundary, writes a checkpoint there (every
  rank of a job at the same step: the ranks agree on the request once a step, `agreed`); an
  eval checkpoint in the loop finishes first, as part of its step;
- during the final eval (after the last step's checkpoint) it stops at once in one process
  (`interrupting`): `--resume` redoes only that eval. A job's ranks evaluate collectively and are
  not interrupted there (a rank leaving a collective would leave the others waiting): the eval
  finishes and the run with it, or torchrun's timeout kills the ranks, the checkpoint at the last
  step kept;
- marks its MLflow run KILLED with the reason, runs (or finishes) no final eval, writes no summary;
- says one line: the signal, the step, and the command that continues the run;
- exits 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), the shell's convention.

`--resume` then continues from that checkpoint exactly, as from any other.

A second Ctrl-C in one process stops at once (the run is then as after a kill: its newest
periodic checkpoint is where `--resume` starts). Under torchrun a repeated signal changes nothing:
torchrun's agent passes on the signal it got to ranks that the terminal's Ctrl-C reached already,
and it kills ranks that have not ended `shutdown_timeout` seconds after (30 by default; `lowprec
run --nproc-per-node` gives them `LAUNCH_SHUTDOWN_TIMEOUT_S`). A scheduler's grace period between
SIGTERM and SIGKILL bounds the time too (Slurm's `KillWait`, 30 s by default,
https://slurm.schedmd.com/slurm.conf.html#OPT_KillWait): a step or an eval longer than what is
left ends as a kill does.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["StopRequest", "RunStopped", "STOP_SIGNALS", "STOPPED_EXITS", "LAUNCH_SHUTDOWN_TIMEOUT_S", "stopped_exit"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
LAUNCH_SHUTDOWN_TIMEOUT_S = 120   # `lowprec run --nproc-per-node`: a stopping rank's time to checkpoint


def stopped_exit(signum: int) -> int:
    """The exit status of a process `signum` stopped: 128 + its number, the shell's convention."""
    return 128 + int(signum)


STOPPED_EXITS = tuple(stopped_exit(s) for s in STOP_SIGNALS)   # 130, 143


class RunStopped(Exception):
    """The run stopped at `step` on `signum`, its checkpoint there written."""

    def __init__(self, signum: int, step: int):
        self.signum, self.step = int(signum), int(step)
        super().__init__(f"stopped by {self.signal_name} at step {self.step}")

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return stopped_exit(self.signum)


class _Interrupted(BaseException):
    """Raised by the handler within `interrupting`: a BaseException (as KeyboardInterrupt is), so
    that no `except Exception` in the interrupted code (lm-eval's, a user's evaluator) holds it."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signum)


class StopRequest:
    """SIGINT and SIGTERM handlers for the time of a `lowprec run` (`with StopRequest(say):`);
    `requested` says which signal came first (None: none). say: told one line on the first
    signal (by rank 0 only, in a job). rank: this process's rank in a torchrun job, None in one
    process (in a job repeated signals change nothing, see the module doc). Installs nothing
    outside the main thread (signal handlers live there only)."""

    def __init__(self, say=None, *, rank: int | None = None):
        self.requested: int | None = None
        self._in_job = rank is not None
        self._say = say if not rank else None
        self._previous: dict[int, object] = {}
        self._interrupting = False   # within `interrupting`: the first signal stops at once

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _tell(self, text: str) -> None:
        """Say `text` from the handler. The signal may have come while the main thread was writing
        to the same stream, and Python's buffered streams refuse a reentrant write (RuntimeError):
        the line is then left out, never the stop."""
        if self._say is not None:
            with contextlib.suppress(RuntimeError):
                self._say(text)

    def _handle(self, signum: int, frame) -> None:
        if self.requested is None and self._interrupting:
            self.requested = signum
            self._tell(f"{signal.Signals(signum).name}: stopping now, during the final eval; --resume redoes it")
            raise _Interrupted(signum)
        if self.requested is None:
            self.requested = signum
            if not self._in_job:   # a job's rank 0 says it once the ranks agree
                self._tell(f"{signal.Signals(signum).name}: stopping at the next step, with a checkpoint there; "
                           f"Ctrl-C again stops at once, without one")
            return
        if signum == signal.SIGINT and not self._in_job:   # a second Ctrl-C: at once, as before
            self._restore()
            raise KeyboardInterrupt

    def agreed(self, step: int) -> int | None:
        """The signal that stops the run at `step` on every rank (the largest number any rank
        got), or None: the same answer on every rank. A collective under torch.distributed:
        every rank calls it at the same step. In a job, rank 0 says where the ranks stop (only
        now: a signal torchrun sends because a rank died meets the dead rank here instead)."""
        from lowprec.state.ranks import largest_on_any_rank
        got = largest_on_any_rank(self.requested or 0) or None
        if got is not None and self._in_job and self._say is not None:
            self._say(f"{signal.Signals(got).name}: every rank stops at step {step}, with a checkpoint there")
        return got

    @contextlib.contextmanager
    def interrupting(self, step: int) -> Iterator[None]:
        """Within: a signal stops the run at once (RunStopped at `step`), for work after the
        checkpoint at `step` that a resume can redo (the final eval). One process only: in a job,
        or where no handler is installed (not the main thread), nothing changes."""
        if self._in_job or not self._previous:
            yield
            return
        if self.requested is not None:   # came before: stop without starting
            raise RunStopped(self.requested, step)
        self._interrupting = True
        try:
            yield
        except _Interrupted as e:
            raise RunStopped(e.signum, step) from None
        finally:
            self._interrupting = False

