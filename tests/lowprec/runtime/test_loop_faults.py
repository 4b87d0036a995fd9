"""Fault injection on a real small transformer training on Shakespeare, through the one loop.

Each fault is acted on at the step it occurs (per-step detection) and attributed by
replaying the step with sites in high precision: the NaN and the overflow (faults of low
precision) demote exactly the site they were injected into; the learning-rate spike
(not precision's) demotes nothing, rewinds, and the loss comes back to within 5% of the
uninjected run's. No NaN reaches the weights.
"""

import copy

import pytest

from lowprec.runtime import Injection
from lowprec.runtime.trainer.run import run_config
from lowprec.policy.events import EventKind

pytestmark = pytest.mark.slow   # four 120-step training runs: minutes on 2 cores

CHECK = 10
SITE = "blocks.1.mlp.fc"
BASE = {
    "model": {"factory": "experiments.model:build_gpt",
              "args": {"vocab_size": 256, "block_size": 64, "n_layer": 2, "n_head": 2, "d_model": 64}},
    "data": {"factory": "experiments.data:shakespeare_tokens", "args": {"max_bytes": 400_000}, "block_size": 64},
    "train": {"steps": 120, "batch_size": 8, "lr": 3e-3, "warmup": 10, "ckpt_every": 10, "seed": 0},
    "precision": {"backend": "emulated", "keep_high_precision": [{"fqns": ["lm_head"]}],
                  "rules": [{"name": "blocks", "select": {"glob": "blocks.*"}, "format": "bf16",
                             "ladder": ["fp8_tensorwise", "bf16"]}]},
    "rollout": {"check_every": CHECK, "min_steps": 0, "cooldown_steps": 1000, "quarantine_after": 2,
                "thresholds": {"max_saturated_frac": 1e-3, "site_patience": 2, "large_warmup": 20,
                               "spike_min_history": 30},  # the first steps' grad norms swing widely
                "stages": [{"name": "mlp_fp8", "select": {"glob": "blocks.*.mlp.*"}, "format": "fp8_tensorwise"},
                           {"name": "attn_fp8", "select": {"glob": "blocks.*.attn.*"}, "format": "fp8_tensorwise"}]},
    "tracking": {"enabled": False},
}


def config(**changes):
    cfg = copy.deepcopy(BASE)
    for path, value in changes.items():
        node = cfg
        *head, last = path.split(".")
        for k in head:
            node = node[k]
        node[last] = value
    return cfg


def changes(res):
    return [e for e in res.events if e.kind in (EventKind.FALLBACK, EventKind.ROLLBACK, EventKind.QUARANTINE)]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return run_config(config(), tmp_path_factory.mktemp("clean"))


def test_clean_run_promotes_both_stages_and_falls_back_nowhere(clean):
    kinds = [e.kind for e in clean.events]
    assert kinds.count(EventKind.PROMOTE) == 2 and not changes(clean)
    assert clean.losses[-1] < clean.losses[0] - 1.0  # it learns


def test_nan_in_one_site_output_demotes_exactly_that_site(tmp_path):
    res = run_config(config(), tmp_path, faults=[Injection("nan", 40, 200, SITE)])
    falls = changes(res)
    assert falls, "no fallback"
    first = falls[0]
    assert first.kind == EventKind.FALLBACK and first.sites == (SITE,)
    assert first.to_format == {SITE: "bf16"}
    assert first.step == 40                      # the step it occurs: no waiting for a check
    assert first.evidence["precision_to_blame"] and first.evidence["replays"] <= 8
    assert len(falls) == 1
    replays = [e for e in res.events if e.kind == EventKind.REPLAY and e.step == 40]
    assert replays and all(e.evidence["anomalous"] == (SITE not in e.sites) for e in replays)
    assert any(e.kind == EventKind.SKIP_STEP for e in res.events)
    assert not res.nonfinite_params
    assert res.formats[max(res.formats)][SITE] == "bf16"


def test_overflow_in_one_site_demotes_exactly_that_site(tmp_path):
    # Delayed scaling adapts one step after an overflow (the amax enters its history), so
    # the saturation lives in that one step: statistics must be collected on every step.
    # Delayed-scaling E5M2 gradients saturate ~0.4% of values now and then in this small
    # run (gradients grow faster than the history's max); 1% separates that from the fault.
    cfg = config(**{"rollout.stats_every_step": True, "rollout.thresholds.max_saturated_frac": 1e-2,"precision.rules": [{"name": "blocks", "select": {"glob": "blocks.*"}, "format": "bf16",
                                         "ladder": ["fp8_delayed", "bf16"]}],
                    "rollout.stages": [{"name": "all_fp8", "select": {"glob": "blocks.*"}, "format": "fp8_delayed"}]})
    res = run_config(cfg, tmp_path, faults=[Injection("overflow", 40, 200, SITE, factor=1e4, every=3)])
    falls = changes(res)
    assert falls and falls[0].kind == EventKind.FALLBACK and falls[0].sites == (SITE,)
    assert falls[0].step <= 40 + 2 * CHECK
    assert falls[0].evidence.get("precision_to_blame") or any(k.endswith("saturated_frac")
                                                              for k in falls[0].evidence)
    assert [e.sites for e in falls] == [(SITE,)]
    assert not res.nonfinite_params


def test_lr_spike_demotes_nothing_rewinds_and_recovers(tmp_path, clean):
    # A 32-value window: the default 128 still holds the steep early descent of this short
    # run, whose spread hides a spike; OLMo's 128 is meant for long runs.
    cfg = config(**{"rollout.rewind": {"enabled": True, "skip_batches": 5},
                    "rollout.thresholds.spike_window": 32})
    res = run_config(cfg, tmp_path, faults=[Injection("lr_spike", 60, 64, factor=100.0)])
    kinds = [e.kind for e in res.events]
    assert not changes(res), [(e.step, e.kind, e.sites) for e in changes(res)]   # precision is not to blame
    assert EventKind.REWIND in kinds and res.rewinds >= 1
    first = next(e for e in res.events if e.kind == EventKind.SKIP_STEP)
    assert 60 < first.step <= 64 and "not precision" in first.reason   # the step after the first bad update
    rw = next(e for e in res.events if e.kind == EventKind.REWIND)
    assert rw.step <= first.step + 2
    recovered_by = 119
    tail = sum(res.losses[recovered_by - 9:recovered_by + 1]) / 10
    ref = sum(clean.losses[recovered_by - 9:recovered_by + 1]) / 10
    assert abs(tail - ref) / ref < 0.05, (tail, ref)
    assert not res.nonfinite_params


def test_four_random_token_batches_are_each_skipped_and_rebase_nothing(tmp_path):
    """Issue 54: four consecutive random-token batches (a corrupted shard) from iteration 60,
    rewind off. Each is flagged, replayed (not precision's) and skipped; none is accepted as a
    new level (the detectors would then miss the next one) and nothing is demoted."""
    res = run_config(config(), tmp_path, faults=[Injection("random_tokens", 60, 64)], steps=66)
    at = {e.step: e for e in res.events if 60 <= e.step < 64 and e.kind == EventKind.SKIP_STEP}
    assert sorted(at) == [60, 61, 62, 63], [(e.step, e.kind, e.reason) for e in res.events if e.step >= 60]
    assert all("not precision" in e.reason for e in at.values())
    assert EventKind.ACCEPT not in [e.kind for e in res.events] and not changes(res)
    assert not [e for e in res.events if e.step >= 64 and e.kind == EventKind.SKIP_STEP]   # good batches again
