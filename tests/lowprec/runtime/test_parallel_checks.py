"""The checks `lowprec run` makes before a parallel job starts, and the merge of the ranks' events."""

from __future__ import annotations

import pytest

from lowprec.config import ConfigError, LowprecConfig
from lowprec.policy.events import Event, EventLog
from lowprec.runtime.parallel_run import check_launch, merge_rank_events, rank_env

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
