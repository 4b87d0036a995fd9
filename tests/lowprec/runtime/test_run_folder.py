"""What a run folder holds, in words (`lowprec.runtime.trainer.run_folder`): the state each refusal
names, its advice, and a refused new run that leaves no folder behind."""

from __future__ import annotations

import os
import time

import pytest

from lowprec.runtime.trainer.run_folder import (RUN_LOCK, FolderState, RunFolder, RunFolderBusyError, inspect_folder,
                                        refusal)


def _checkpoint(folder, step: int):
    (folder / "checkpoints").mkdir(parents=True, exist_ok=True)
    p = folder / "checkpoints" / f"step_{step:08d}.pt"
    p.write_bytes(b"not read here")
    return p


def test_each_state_and_its_advice(tmp_path):
    out = tmp_path / "out"
    new = inspect_folder(out)
    assert new.state is FolderState.NEW and refusal(new, resume=False, config="c.yaml", tracked=True) is None

    _checkpoint(out, 8)   # killed after its checkpoint at step 8
    stopped = inspect_folder(out)
    assert (stopped.state, stopped.step) == (FolderState.STOPPED, 8)
    line = refusal(stopped, resume=False, config="c.yaml", tracked=False)
    assert "stopped without finishing" in line and "step 8" in line and \
        f"`lowprec run c.yaml --out {out} --resume`" in line
    assert refusal(stopped, resume=True, config="c.yaml", tracked=False) is None   # resumed as it is

    time.sleep(0.01)
    (out / "summary.json").write_text("{}")   # written at a run's end, after its last checkpoint
    done = inspect_folder(out)
    assert done.state is FolderState.FINISHED
    assert "which finished" in refusal(done, resume=False, config="c.yaml", tracked=False)
    assert refusal(done, resume=True, config="c.yaml", tracked=False) is None   # untracked: --steps trains further
    assert "is not continued" in refusal(done, resume=True, config="c.yaml", tracked=True)

    with RunFolder.take(out) as held:
        assert held.held and held.status().state is FolderState.FINISHED   # its holder sees the past, not itself
        alive = inspect_folder(out)   # anyone else: alive, named
        assert alive.state is FolderState.ALIVE and alive.holder.pid == os.getpid()
        line = refusal(alive, resume=True, config="c.yaml", tracked=True)
        assert f"a live run writes it (pid {os.getpid()}" in line and f"kill {os.getpid()}" in line
        with pytest.raises(RunFolderBusyError, match="is in use"):
            RunFolder.take(out)
    assert inspect_folder(out).state is FolderState.FINISHED


def test_a_refused_new_run_leaves_no_folder(tmp_path):
    out = tmp_path / "runs" / "a"
    folder = RunFolder.take(out)
    assert (out / RUN_LOCK).is_file()
    folder.release()   # nothing else was written: the folder and the runs/ made for it go
    assert not (tmp_path / "runs").exists()
    with RunFolder.take(out):
        (out / "losses.json").write_text("[]")
    assert (out / RUN_LOCK).is_file() and (out / "losses.json").is_file()   # a run's folder stays


def test_other_ranks_hold_nothing(tmp_path):
    with RunFolder.take(tmp_path / "out", rank=1) as f:
        assert not f.held and not (tmp_path / "out").exists()


def test_a_folder_without_a_config_copy_is_checked_against_its_checkpoint(tmp_path):
    import torch

    from lowprec.runtime.trainer.resume_check import resume_mismatch
    from lowprec.state.checkpoint import checkpoint_mismatch, save_checkpoint
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    path = save_checkpoint(tmp_path / "out" / "checkpoints", 4, model=model,
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert checkpoint_mismatch(path, model) is None
    wider = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 2))
    assert checkpoint_mismatch(path, wider) == \
        "0.weight is (16, 4) in this model but (8, 4) in the checkpoint step_00000004.pt"
    line = resume_mismatch(tmp_path / "out", None, "c.yaml", model=wider)
    assert line.startswith("--resume: 0.weight is (16, 4) in this model") and "--out NEW_DIR" in line
    assert resume_mismatch(tmp_path / "out", None, "c.yaml", model=model) is None
