"""Which MLflow run a torchtitan job tracks into: one run per job, continued when torchtitan resumes.

Rank 0 tracks through a buffer folder (`lowprec.tracking.tracker`) under
`<dump_folder>/lowprec/`. The job's run is named next to torchtitan's checkpoints, in
`<dump_folder>/lowprec/tracking.json` (`{"buffer": <folder name>}`; the folder's run.json has
the MLflow run id once the run exists), and in the rollout's entry of each checkpoint
(`LowprecTrainer`'s `Stateful`: the folder and the run id). The tracker opens when the
trainer is built, before torchtitan loads its checkpoint, so the decision is taken from what
torchtitan will load:

    torchtitan will load a checkpoint (its folder holds a step)  and  tracking.json names a
    run that did not finish (the job was killed or failed)       ->  that run, continued: the
                                                                     same MLflow run, and the
                                                                     points and events its
                                                                     journal holds are not
                                                                     logged again
    the named run finished (a finished job given more steps)     ->  a new run (a finished run
                                                                     is never reopened,
                                                                     `lowprec.tracking.resume`),
                                                                     tagged with the run it goes on from
    no checkpoint to load                                        ->  a new run

When torchtitan has loaded the checkpoint, `check_resumed_run` compares the run the checkpoint
names with the one being tracked and says so when they differ (the tracking folder was moved or
replaced).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from lowprec.state.durable import write_text_atomically
from lowprec.tracking.resume import RunState, buffered_run

__all__ = ["POINTER", "JobRun", "job_run", "torchtitan_resumes", "check_resumed_run"]

POINTER = "tracking.json"


class JobRun:
    """The buffer folder rank 0 tracks into, whether it continues the run there, and the run a
    finished job's continuation goes on from (its MLflow run id, or its buffer's uid when it never
    reached MLflow; None otherwise)."""

    def __init__(self, folder: Path, resume: bool, continues: str | None = None):
        self.folder, self.resume, self.continues = folder, resume, continues

    def record(self, run_id: str | None) -> dict:
        """What names this run in the checkpoint's rollout entry."""
        return {"buffer": self.folder.name, "run_id": run_id}


def torchtitan_resumes(checkpointer, load_step: int) -> bool:
    """Whether torchtitan's `checkpointer.load(load_step)` will load a checkpoint of this job (a
    `step-N` folder in its checkpoint folder), as torchtitan's own `_find_load_step` decides."""
    if not getattr(checkpointer, "enable", False):
        return False
    if load_step != -1:
        return True
    find = getattr(checkpointer, "_find_load_step", None)
    if callable(find):
        return find() != -1
    folder = Path(getattr(checkpointer, "folder", ""))
    return folder.is_dir() and any(p.name.startswith("step-") for p in folder.iterdir())


def job_run(root: Path, run_name: str, resumes: bool) -> JobRun:
    """The run rank 0 tracks into (see the module docstring); tracking.json names it from now on."""
    pointer = root / POINTER
    named = json.loads(pointer.read_text()) if resumes and pointer.is_file() else {}
    continues = None
    if named.get("buffer"):
        folder = root / named["buffer"]
        state, info = buffered_run(folder)
        if state in (RunState.UNFINISHED, RunState.FAILED):
            return JobRun(folder, True)
        continues = (info.get("run_id") or f"uid {info['uid']}") if state is RunState.FINISHED else None
    run = JobRun(root / f"{run_name}-{uuid.uuid4().hex[:8]}", False, continues)
    root.mkdir(parents=True, exist_ok=True)
    write_text_atomically(pointer, json.dumps({"buffer": run.folder.name}))
    return run


def check_resumed_run(saved: dict | None, run: JobRun, run_id: str | None) -> str | None:
    """A warning when the checkpoint torchtitan loaded names another run than the one tracked."""
    if not saved or saved.get("buffer") in (None, run.folder.name):
        return None
    return (f"lowprec: the checkpoint was written while tracking into MLflow run {saved.get('run_id')} "
            f"(buffer {saved['buffer']}), and this job tracks into {run_id} ({run.folder}): "
            f"{POINTER} in the dump folder's lowprec/ named another run")
