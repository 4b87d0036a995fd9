"""What lowprec's work inside someone else's training loop may print: only lowprec's lines.

Under the Hugging Face Trainer (or Lightning) lowprec runs eval checkpoints (lm-eval over local
text, through `datasets`) and tracks into MLflow from inside the framework's callbacks. Those
libraries print their own lines into the user's console: lm-eval's "bootstrapping for stddev"
and its per-task progress bars, datasets' "Generating test split" bars, MLflow's INFO records.
`lowprec run` sends them to its log file (`lowprec.runtime.trainer.console.Console`); a host does the
same for each block of lowprec's own work (the rollout's start, each step's after-step work,
the end), and only for that block, so the framework's own lines are untouched:

    console = HostConsole("hf", Path(args.output_dir) / "lowprec" / "lowprec.log")
    with console.routed():
        hosted.after_optimizer_step()

Inside the block the routing is `Console`'s: what other libraries write to stdout/stderr and
log records of level INFO and up go to the log file (appended; one per rank); lowprec's own
progress lines, the warnings that concern the user's run (a Python warning not raised by one
of `lowprec.runtime.trainer.console.BACKGROUND`'s libraries, a WARNING record of a logger not theirs)
still reach the terminal, as `lowprec hf: ...` lines.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from lowprec.runtime.trainer.console import Console

__all__ = ["HostConsole", "host_log_path"]


def host_log_path(folder: str | Path, rank: int = 0) -> Path:
    """The log file of a host's rank under `folder`: `lowprec.log`, `lowprec.rank<r>.log` off rank 0."""
    return Path(folder) / ("lowprec.log" if rank == 0 else f"lowprec.rank{rank}.log")


class HostConsole:
    """Blocks of lowprec's work in a framework's loop, their chatter routed to `log` (None: dropped)."""

    def __init__(self, name: str, log: Path | None):
        self.name, self.log = name, log

    @contextlib.contextmanager
    def routed(self) -> Iterator[None]:
        with Console(self.name) as console:
            if self.log is not None:
                console.log_to(self.log)
            yield
