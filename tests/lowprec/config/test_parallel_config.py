"""The `parallel:` section: its degrees, what it asks of the other sections, its errors."""

from __future__ import annotations

import pytest

from lowprec.config import ConfigError, LowprecConfig, ParallelConfig

BASE = {"model": {"factory": "experiments.model:build_gpt"}, "precision": {"default": "bf16"},
        "train": {"batch_size": 8}}


def config(**parallel) -> LowprecConfig:
    return LowprecConfig.from_dict({**BASE, "parallel": parallel})


def test_no_section_is_one_process():
    cfg = LowprecConfig.from_dict(BASE)
    assert cfg.parallel == ParallelConfig() and cfg.parallel.world == 1 and cfg.parallel.mode == "single"


def test_the_degrees_multiply_to_the_processes():
    par = config(dp_shard=2, tp=2).parallel
    assert (par.world, par.data_ranks, par.mode) == (4, 2, "dp_shard2xtp2")
    assert config(pp=2).parallel.mode == "pp2"
    assert config(dp_replicate=2, dp_shard=2).parallel.mode == "dp_replicate2xdp_shard2"
    assert config(dp_replicate=2, tp=2).to_dict()["parallel"]["dp_replicate"] == 2
    hsdp_tp = config(dp_replicate=2, dp_shard=2, tp=2).parallel   # HSDP x TP: a 3-D mesh
    assert (hsdp_tp.world, hsdp_tp.data_ranks, hsdp_tp.mode) == (8, 4, "dp_replicate2xdp_shard2xtp2")


def test_it_round_trips():
    cfg = config(dp_shard=2, tp=2, peer_timeout_s=5)
    assert LowprecConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("section, path, words", [
    ({"pp": 2, "dp_shard": 2}, "parallel.pp", "pipeline stages run alone here"),
    ({"tp": 0}, "parallel.tp", "expected a number of ranks >= 1, found 0"),
    ({"peer_timeout_s": 0}, "parallel.peer_timeout_s", "expected seconds > 0"),
    ({"dp_replicate": 2, "fp8_all_gather": True}, "parallel.fp8_all_gather", "only FSDP2 all-gathers weights"),
    ({"tp": 2, "fp8_all_gather": True}, "parallel.fp8_all_gather", "true with dp_shard 1"),
    ({"dp_replicate": 2, "dp_shard": 2, "tp": 2, "fp8_all_gather": True}, "parallel.fp8_all_gather",
     "not yet on the 3-D mesh of HSDP x TP"),
    ({"tp_size": 2}, "parallel.tp_size", "tp"),                                 # did you mean
    ({"dp_shard": 3}, "train.batch_size", "8 does not split into 3 data-parallel ranks x 1 microbatches"),
])
def test_bad_sections_are_refused_at_load(section, path, words):
    with pytest.raises(ConfigError) as e:
        config(**section)
    assert e.value.path == path and words in e.value.message, str(e.value)


def test_evals_load_under_every_parallel_mode():
    """pp included: its evals run through every stage (tests/experiments/test_parallel_parity.py)."""
    for par in ({"pp": 2}, {"tp": 2}, {"dp_shard": 2}):
        cfg = LowprecConfig.from_dict({**BASE, "eval": {"every": 0}, "parallel": par})
        assert cfg.eval is not None and cfg.parallel.world == 2


def test_fp8_all_gather_reaches_the_fsdp2_engine():
    """`parallel.fp8_all_gather` is read from the config and handed to FSDP2's engine (the
    engine's own FP8 gather is tested under torchrun: tests/lowprec/sites/fast_path)."""
    import inspect
    from lowprec.runtime.engines.parallel import data_parallel
    assert config(dp_shard=2, fp8_all_gather=True).parallel.fp8_all_gather
    assert not config(dp_shard=2).parallel.fp8_all_gather
    # FSDP2 x TP and HSDP gather FP8 too
    assert config(dp_shard=2, tp=2, fp8_all_gather=True).parallel.fp8_all_gather
    assert config(dp_replicate=2, dp_shard=2, fp8_all_gather=True).parallel.fp8_all_gather
    assert "fp8_all_gather" in inspect.signature(data_parallel).parameters
