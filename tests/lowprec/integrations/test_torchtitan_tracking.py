"""Which MLflow run a torchtitan job tracks into (`lowprec.integrations.torchtitan_tracking`), on
real tracker buffer folders: a resumed job continues its run unless that run finished. The
whole path (a killed torchtitan job resumed in the same MLflow run) runs in
test_torchtitan_trainer.py.
"""

from __future__ import annotations

import json

from lowprec.integrations.torchtitan_tracking import POINTER, JobRun, check_resumed_run, job_run
from lowprec.tracking.records import RunStatus
from lowprec.tracking.resume import RunState, buffered_run
from lowprec.tracking.tracker import Tracker

NOWHERE = "http://127.0.0.1:9"   # no server: the journal is all there is, as on a machine offline


def _ended(run: JobRun, status: RunStatus) -> None:
    """A run tracked in `run.folder` that ended with `status` (its journal says so)."""
    tracker = Tracker(NOWHERE, "titan", "job", buffer_dir=run.folder, resume=run.resume)
    tracker.finish(status, timeout=1.0, report=False, warn_unsent=False)


def test_a_resumed_job_continues_its_run_unless_it_finished(tmp_path):
    root = tmp_path / "lowprec"
    first = job_run(root, "llama3-debugmodel", resumes=False)
    assert not first.resume and first.folder.parent == root and first.folder.name.startswith("llama3-debugmodel-")
    assert json.loads((root / POINTER).read_text())["buffer"] == first.folder.name
    _ended(first, RunStatus.FAILED)   # killed or failed: torchtitan resumes it

    again = job_run(root, "llama3-debugmodel", resumes=True)
    assert again.resume and again.folder == first.folder and again.continues is None
    _ended(again, RunStatus.FINISHED)
    assert buffered_run(first.folder)[0] is RunState.FINISHED

    # a finished job given more steps: a new run (a finished one is never reopened), which names it
    more = job_run(root, "llama3-debugmodel", resumes=True)
    assert not more.resume and more.folder != first.folder
    assert more.continues == f"uid {buffered_run(first.folder)[1]['uid']}"   # never sent: no run id yet
    assert json.loads((root / POINTER).read_text())["buffer"] == more.folder.name

    # a job that starts afresh (no checkpoint to load) never continues what the folder names
    fresh = job_run(root, "llama3-debugmodel", resumes=False)
    assert not fresh.resume and fresh.folder not in (first.folder, more.folder)


def test_a_checkpoint_of_another_run_is_said(tmp_path):
    run = JobRun(tmp_path / "llama3-debugmodel-0000aaaa", resume=True)
    assert check_resumed_run(run.record("r1"), run, "r1") is None
    assert check_resumed_run(None, run, "r1") is None   # written without tracking
    said = check_resumed_run({"buffer": "llama3-debugmodel-1111bbbb", "run_id": "r0"}, run, "r1")
    assert "MLflow run r0" in said and "into r1" in said and POINTER in said
