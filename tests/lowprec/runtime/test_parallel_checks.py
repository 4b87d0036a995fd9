"""The checks `lowprec run` makes before a parallel job starts, and the merge of the ranks' events."""

from __future__ import annotations

import pytest

from lowprec.config import ConfigError, LowprecConfig
from lowprec.policy.events import Event, EventLog
from lowprec.runtime.trainer.parallel_run import check_launch, merge_rank_events, rank_env

BASE = {"model": {"factory": "experiments.model:build_gpt"}, "precision": {"default": "bf16"},
        "train": {"batch_size": 8}}
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400",
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}


def config(**parallel) -> LowprecConfig:
    return LowprecConfig.from_dict({**BASE, "parallel": parallel} if parallel else BASE)


def test_rank_env_reads_torchrun_s_variables():
    env = rank_env(TORCHRUN)
    assert (env.rank, env.world, env.master_addr, env.master_port, env.agent_store) == (1, 4, "10.0.0.1", 29400, True)
    assert rank_env({}) is None


def test_the_processes_must_be_the_product_of_the_degrees():
    check_launch(config(dp_shard=2, tp=2), 4, None)
    check_launch(config(dp_shard=2, tp=2), None, rank_env(TORCHRUN))
    check_launch(config(), None, None)
    with pytest.raises(ConfigError, match=r"dp_shard2xtp2 needs 4 processes .*--nproc-per-node 2: start 4"):
        check_launch(config(dp_shard=2, tp=2), 2, None)
    with pytest.raises(ConfigError, match="torchrun started 4: add a parallel: section"):
        check_launch(config(), None, rank_env(TORCHRUN))
    with pytest.raises(ConfigError, match=r"needs 4 processes .*one process: start 4 \(lowprec run --nproc-per-node 4"):
        check_launch(config(dp_shard=2, tp=2), None, None)
    with pytest.raises(ConfigError, match="under torchrun .*drop --nproc-per-node"):
        check_launch(config(dp_shard=2, tp=2), 4, rank_env(TORCHRUN))


def _log(path, events) -> None:
    EventLog(path).append(events)


def test_events_of_ranks_that_decided_alike_merge_into_nothing_more(tmp_path):
    a = Event(3, "promote", ("blocks.0.mlp.fc",), stage="mlp", reason="stable")
    b = Event(5, "skip_step", reason="nan")
    for r in range(3):
        _log(tmp_path / f"events.rank{r}.jsonl", [a, b])
    assert merge_rank_events(tmp_path, 3) == []


def test_an_event_only_some_ranks_recorded_is_merged_once_naming_them(tmp_path):
    a = Event(3, "promote", ("blocks.0.mlp.fc",), stage="mlp", reason="stable")
    odd = Event(7, "fallback", ("blocks.1.mlp.fc",), reason="saturated")
    _log(tmp_path / "events.rank0.jsonl", [a])
    _log(tmp_path / "events.rank1.jsonl", [a, odd])
    _log(tmp_path / "events.rank2.jsonl", [a, odd])
    merged = merge_rank_events(tmp_path, 3)
    assert [(e.step, e.kind, e.sites, e.evidence["ranks"]) for e in merged] == [(7, "fallback", ("blocks.1.mlp.fc",),
                                                                                  [1, 2])]


# ----------------------------------------------------------------------------- found trying it as a user

def test_a_surviving_rank_s_stopped_line_is_never_cut_mid_word():
    from lowprec.runtime.trainer.parallel_run import peer_lost_line
    words = "Connection closed by peer [127.0.0.1]:60504 while all_reduce on ranks 0, 1, 2, 3 waited for rank 2 " * 3
    line = peer_lost_line(1, RuntimeError("[../gloo/transport/tcp/pair.cc:534] " + words))
    assert line.startswith("rank 1: stopped: Connection closed by peer") and "pair.cc" not in line
    why = line.removeprefix("rank 1: stopped: ").removesuffix(" (another rank died or stopped)")
    assert why.endswith(" ...") and words.startswith(why.removesuffix(" ...") + " "), why   # ends at a whole word
    short = peer_lost_line(0, RuntimeError("Connection reset by peer"))
    assert short == "rank 0: stopped: Connection reset by peer (another rank died or stopped)"


def test_every_suggested_command_of_a_job_carries_its_process_count(tmp_path):
    import yaml
    from lowprec.runtime.trainer.resume_check import record_config, resume_mismatch
    from lowprec.runtime.trainer.run_folder import FolderState, FolderStatus, refusal
    stopped = FolderStatus(tmp_path, FolderState.STOPPED, step=10)
    line = refusal(stopped, resume=False, config="job.yaml", tracked=False, nproc=4)
    assert f"`lowprec run --nproc-per-node 4 job.yaml --out {tmp_path} --resume`" in line, line
    assert "--nproc-per-node" not in refusal(stopped, resume=False, config="one.yaml", tracked=False)
    job = config(dp_shard=2, tp=2)
    record_config(tmp_path, job)
    changed = LowprecConfig.from_dict({**BASE, "train": {"batch_size": 8, "lr": 1e-4}, "parallel": {"dp_shard": 2,
                                                                                                    "tp": 2}})
    line = resume_mismatch(tmp_path, changed, "new.yaml")
    assert (f"`lowprec run --nproc-per-node 4 {tmp_path / 'config.yaml'} --out {tmp_path} --resume`" in line
            and "`lowprec run --nproc-per-node 4 new.yaml --out NEW_DIR`" in line), line
    # another dp_shard: refused, saying that the layout stays, with the command that resumes it
    reshard = config(dp_shard=4, tp=2)
    line = resume_mismatch(tmp_path, reshard, "reshard.yaml")
    assert line.startswith("--resume: parallel.dp_shard is 4 in reshard.yaml but 2 in the run") and (
        "a resume keeps the parallel layout" in line and "--nproc-per-node 4 " in line
        and "`lowprec run --nproc-per-node 8 reshard.yaml --out NEW_DIR`" in line), line
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["parallel"]["dp_shard"] == 2


def test_the_launcher_holds_the_run_folder_until_its_ranks_are_done(tmp_path, tiny_lm, monkeypatch):
    """`lowprec run --nproc-per-node 2`: the launcher's checks pass and it is about to start the
    ranks (the Launch is not called here): the folder is still locked by the launcher, so a
    one-process run on the same --out is refused; its ranks' rank 0 is let in (held_by)."""
    import os
    import yaml
    from lowprec.base.writer_lock import holder
    from lowprec.cli import build_parser
    from lowprec.runtime.trainer.cli import _run
    from lowprec.runtime.trainer.console import Console
    from lowprec.runtime.trainer.run_folder import RUN_LOCK, RunFolder, RunFolderBusyError
    tiny_lm(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"factory": "tinylm:build", "args": {"vocab": 64, "width": 32}},
        "data": {"factory": "tinylm:tokens", "block_size": 16}, "train": {"steps": 2, "batch_size": 4},
        "precision": {"backend": "emulated", "default": "bf16"}, "tracking": {"enabled": False},
        "parallel": {"dp_shard": 2}}))
    out = tmp_path / "out"
    args = build_parser().parse_args(["run", str(cfg), "--out", str(out), "--nproc-per-node", "2"])
    with Console("run") as console:
        launch = _run(args, console, 0.0)
    assert callable(launch) and launch.argv[-2:] == ["--launcher-pid", str(os.getpid())]
    try:
        assert holder(out / RUN_LOCK).pid == os.getpid()   # held past the checks and config.yaml
        with pytest.raises(RunFolderBusyError):
            RunFolder.take(out)   # a one-process `lowprec run` on the same --out
        with pytest.raises(RunFolderBusyError):
            RunFolder.take(out, held_by=os.getpid() + 1)   # a rank of some other launcher
        assert not RunFolder.take(out, held_by=os.getpid()).held   # this launcher's rank 0: in, holding nothing
    finally:
        launch.folder.release()
    assert holder(out / RUN_LOCK) is None
