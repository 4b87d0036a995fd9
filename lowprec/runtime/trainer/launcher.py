"""The launcher of `lowprec run --nproc-per-node N`: torchrun's agent started in this process.

`lowprec run --nproc-per-node N CONFIG --out DIR` checks everything it can (the config, the
folder, the degrees against N) and then, holding the run folder for its ranks, starts N ranks
of `python -m lowprec.cli run` under torchrun's elastic agent (standalone, this machine), each
of which runs `lowprec.runtime.trainer.parallel_run`. What it says when the job ends badly:

- a rank that died: which rank, its pid, its exit code or signal, and the command that continues
  the run (exit 1); the ranks torchrun stopped after it, and those that lost their peers, are
  not the news;
- a refusal: rank 0 said why (exit 2);
- a signal (Ctrl-C, SIGTERM): the ranks stopped at one step with a checkpoint and rank 0 said
  where (`lowprec.runtime.trainer.stop_request`); the launcher exits 128 + the signal's number,
  having given the ranks `LAUNCH_SHUTDOWN_TIMEOUT_S` to get there.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from lowprec.runtime.trainer.parallel_run import EXIT_PEER_LOST, EXIT_UNUSABLE
from lowprec.runtime.trainer.stop_request import LAUNCH_SHUTDOWN_TIMEOUT_S, STOPPED_EXITS, stopped_exit

__all__ = ["Launch", "launch_argv", "EXIT_RANK_DIED"]

EXIT_RANK_DIED = 1     # the launcher's, when a rank died


@dataclass
class Launch:
    """`lowprec run --nproc-per-node N`: what to start once every check passed."""
    nproc: int
    argv: list[str]                  # `lowprec.cli run ...` for every rank
    resume_hint: str                 # the command that continues the run
    folder: object = None            # the RunFolder this launcher holds, released once the last rank exited

    def __call__(self) -> int:
        """Start the ranks under torchrun's agent (standalone, this machine); the exit status."""
        try:
            return self._start()
        finally:
            if self.folder is not None:
                self.folder.release()

    def _start(self) -> int:
        import dataclasses
        import logging
        import uuid
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:   # its lines: said below
            if name.startswith("torch.distributed.elastic"):   # (each module's logger has a level of its own)
                logging.getLogger(name).setLevel(logging.CRITICAL)
        # a signal the agent gets reaches the ranks, which stop at a step with a checkpoint: time for that
        grace = ({"shutdown_timeout": LAUNCH_SHUTDOWN_TIMEOUT_S}
                 if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)} else {})
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=self.nproc, run_id=str(uuid.uuid4()),
                              rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                              monitor_interval=0.5, **grace)
        try:
            elastic_launch(config, sys.executable)("-m", "lowprec.cli", *self.argv)
        except ChildFailedError as e:
            return self._failed(e.failures)
        except SignalException as e:   # Ctrl-C or SIGTERM: rank 0 said where the ranks stopped
            return stopped_exit(e.sigval)
        return 0

    def _failed(self, failures: dict) -> int:
        # the cause: not a rank torchrun stopped (SIGTERM) nor one that lost its peers (EXIT_PEER_LOST)
        rank, f = min(failures.items(), key=lambda kv: (kv[1].exitcode in (-signal.SIGTERM, EXIT_PEER_LOST),
                                                        kv[1].timestamp, kv[0]))
        if f.exitcode == EXIT_UNUSABLE:
            return EXIT_UNUSABLE   # refused: rank 0 said why
        if f.exitcode in STOPPED_EXITS:   # a signal stopped the ranks at a step: rank 0 said where
            return f.exitcode
        how = f"signal {f.signal_name()}" if f.exitcode < 0 else f"exit {f.exitcode}"
        print(f"lowprec run: rank {rank} (pid {f.pid}) died ({how}); torchrun stopped the other ranks. "
              f"Continue the run with `{self.resume_hint}`", file=sys.stderr, flush=True)
        return EXIT_RANK_DIED


def launch_argv(args, out: Path) -> tuple[list[str], str]:
    """(the ranks' `run` arguments, the resume command) from the launcher's own arguments; the
    ranks learn that this process holds the run folder for them (`RunFolder.take(held_by=)`)."""
    from lowprec.runtime.trainer.run_folder import run_command
    argv = ["run", str(args.config), "--out", str(out), "--launcher-pid", str(os.getpid())]
    argv += ["--resume"] if args.resume else []
    argv += ["--steps", str(args.steps)] if args.steps is not None else []
    argv += ["--run-name", args.run_name] if args.run_name else []
    for flag in ("as_baseline", "no_controller", "tracking_optional", "verbose"):
        if getattr(args, flag):
            argv.append("--" + flag.replace("_", "-"))
    for spec in args.inject:
        argv += ["--inject", spec]
    hint = run_command(args.config, out, nproc=args.nproc_per_node, resume=True).strip("`")
    return argv, hint
