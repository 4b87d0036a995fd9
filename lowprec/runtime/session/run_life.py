"""One run's life, the same in every host: its tracker, its eval checkpoints' wiring, its end.

`lowprec run` in one process (`lowprec.runtime.trainer.run`), each rank of `lowprec run` under torchrun
(`lowprec.runtime.trainer.parallel_run`), `HostedRollout` (the HF and Lightning callbacks) and
torchtitan's `LowprecTrainer` (through its `HostedRollout`) all build one `RunLife` before the
first step and end the run through it:

    life = RunLife(cfg, name, buffer_dir, resume=..., logged=..., tags=...)   # the tracker, opened
    evals = life.evals(checked, share=..., formats=...)   # the eval checkpoints, tracked by it
    ... train ...
    life.end(RunStatus.FINISHED, losses=out / "losses.json")   # or FAILED, or KILLED with a reason

* The tracker (`lowprec.tracking.tracker.Tracker`) is built here and only here: the store
  `tracking.uri` names (`lowprec.runtime.session.host.tracking_uri`) or the framework's run it attaches
  to, one per job (rank 0's; None when tracking is off or on another rank), with the config and
  the host's tags logged at once.
* `evals` hands that tracker to the eval checkpoints: ones `lowprec run` checked before step 0
  (`EvalCheckpoints.for_run`) or, for a framework, the `eval:` section's built now.
* `end` ends the run once, whichever host and however training ended: `on_end(status)` (a
  framework host's final eval) first, a finished run's loss curve uploaded (`losses.json`, the
  next run's `rollout.baseline`), a KILLED run tagged with why (`lowprec.stopped`) and drawn no
  report (a full disk has no room for pictures; nor is one drawn with `tracking.report: false`),
  the MLflow run given its status. `running()` ends it FAILED when the training raises, FINISHED
  when it returns.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable

from lowprec.tracking.records import RunStatus

__all__ = ["RunLife", "STOPPED_TAG"]

STOPPED_TAG = "lowprec.stopped"   # the MLflow tag saying why a run was stopped (KILLED)


class RunLife:
    """A run's tracker, its evals' wiring and its end (see the module docstring)."""

    def __init__(self, cfg, name: str, buffer_dir: str | Path | None, *, lead: bool = True, resume: bool = False,
                 attach=None, rank: int = 0, logged: dict | None = None, tags: dict[str, str] | None = None,
                 system_metrics: bool = False, on_end: Callable[[RunStatus], None] | None = None,
                 warn_unsent: bool = True):
        """cfg: the LowprecConfig; name: the MLflow run's name; buffer_dir: the tracker's buffer
        folder. lead: this process tracks (rank 0 of `lowprec run` under torchrun); rank: the
        process's rank (a framework's: the tracker records on rank 0 only); resume: continue the
        unfinished MLflow run the folder holds; attach: an `Attach` (the framework's open MLflow
        run); logged: the config as logged (default `cfg.to_dict()`); tags: the host's tags;
        system_metrics: MLflow's system metrics at `telemetry.system_metrics_s`; on_end(status):
        what the host does first when the run ends; warn_unsent: the tracker warns of records
        left unsent at the end (False: the host says it itself, last, as `lowprec run` does)."""
        self.config, self.on_end, self.status, self.warn_unsent = cfg, on_end, None, warn_unsent
        self.tracker = None
        if lead and (cfg.tracking.enabled or attach is not None):
            self.tracker = self._open(name, buffer_dir, resume, attach, rank, system_metrics)
            self.tracker.log_config(cfg.to_dict() if logged is None else logged)
            if tags:
                self.tracker.log_tags(tags)

    def _open(self, name: str, buffer_dir, resume: bool, attach, rank: int, system_metrics: bool):
        from lowprec.runtime.session.host import tracking_uri
        from lowprec.tracking.tracker import Tracker
        tel = self.config.telemetry
        seconds = tel.system_metrics_s if system_metrics and tel is not None and tel.enabled else None
        return Tracker(attach.tracking_uri if attach is not None else tracking_uri(self.config),
                       attach.experiment if attach is not None else self.config.tracking.experiment, name, rank=rank, buffer_dir=buffer_dir, resume=resume,
                       run_id=attach.run_id if attach is not None else None, system_metrics_s=seconds)

    @classmethod
    def around(cls, cfg, tracker) -> "RunLife":
        """The life of a run whose tracker a caller made (`run_config(..., tracker=)`)."""
        life = cls(cfg, "", None, lead=False)
        life.tracker = tracker
        return life

    def evals(self, checked=None, *, tracker=None, **kwargs):
        """The eval checkpoints of this run, tracked by its tracker (or by `tracker`, the host's
        view of it: a framework host's records its framework's steps): `checked` (the ones
        `lowprec run` checked before step 0) for this run (`for_run(share=, formats=, forward=)`),
        or without it the `eval:` section's built now (`eval_checkpoints(config, model, state, ...)`);
        None without an `eval:` section."""
        tracker = self.tracker if tracker is None else tracker
        if checked is not None:
            return checked.for_run(tracker=tracker, **kwargs)
        if self.config.eval is None:
            return None
        from lowprec.runtime.session.baseline import baseline_evals
        from lowprec.runtime.session.evals import eval_checkpoints
        return eval_checkpoints(self.config.eval, tracker=tracker, baseline=baseline_evals(self.config), **kwargs)

    def end(self, status: RunStatus = RunStatus.FINISHED, *, losses: Path | list | None = None,
            reason: str | None = None) -> None:
        """End the run once (see the module docstring). losses: a FINISHED run's loss curve, a
        file or the list to write into the tracker's folder; reason: why a run was KILLED."""
        if self.status is not None:
            return
        self.status = status
        if self.on_end is not None:
            self.on_end(status)
        t = self.tracker
        if t is None:
            return
        if status is RunStatus.FINISHED and losses is not None and t.enabled:
            if not isinstance(losses, Path):
                from lowprec.runtime.session.baseline import LOSSES_ARTIFACT
                path = Path(t.run_dir) / "files" / LOSSES_ARTIFACT
                path.write_text(json.dumps(list(losses)))
                losses = path
            t.log_artifact(losses)
        if status is RunStatus.KILLED and reason:
            t.log_tags({STOPPED_TAG: reason})
        t.finish(status, warn_unsent=self.warn_unsent,
                 report=status is not RunStatus.KILLED and self.config.tracking.report)

    @contextlib.contextmanager
    def running(self, losses: Callable[[], Path | list | None] = lambda: None):
        """The training inside: the run ends FAILED if it raises, else FINISHED with `losses()`."""
        try:
            yield self
        except BaseException:
            self.end(RunStatus.FAILED)
            raise
        self.end(RunStatus.FINISHED, losses=losses())
