"""Telemetry through the one loop on a real small transformer: a data loader slowed on
purpose shows as the data-wait share, and a forced rewind's wasted time equals the time of
the passes it threw away, both measured independently of the telemetry (the batch source
times itself)."""

from __future__ import annotations

import copy
import time

import pytest

from lowprec.config import LowprecConfig
from lowprec.runtime import Injection
from lowprec.runtime.engines.engine import SingleProcess
from lowprec.runtime.trainer.loop import train
from lowprec.runtime.trainer.run import prepare_run
from lowprec.policy.events import EventKind
from lowprec.tracking.report_sources import from_run_dir
from lowprec.tracking.telemetry import Telemetry
from lowprec.tracking.tracker import Tracker

pytestmark = pytest.mark.slow   # three short training runs

BASE = {
    "model": {"factory": "experiments.model:build_gpt",
              "args": {"vocab_size": 256, "block_size": 64, "n_layer": 2, "n_head": 2, "d_model": 64}},
    "data": {"factory": "experiments.data:shakespeare_tokens", "args": {"max_bytes": 400_000}, "block_size": 64},
    "train": {"steps": 60, "batch_size": 8, "lr": 3e-3, "warmup": 10, "seed": 0, "log_every": 5},
    "precision": {"backend": "emulated", "keep_high_precision": [{"fqns": ["lm_head"]}],
                  "rules": [{"name": "blocks", "select": {"glob": "blocks.*"}, "format": "bf16",
                             "ladder": ["fp8_tensorwise", "bf16"]}]},
    "tracking": {"enabled": False},
    "telemetry": {"energy": "off", "mfu": False},
}
ROLLOUT = {"check_every": 10, "min_steps": 0, "cooldown_steps": 1000,
           "rewind": {"enabled": True, "skip_batches": 5},
           "thresholds": {"max_saturated_frac": 1e-3, "site_patience": 2, "large_warmup": 20,
                          "spike_min_history": 30, "spike_window": 32},
           "stages": [{"name": "mlp_fp8", "select": {"glob": "blocks.*.mlp.*"}, "format": "fp8_tensorwise"}]}


class TimedBatches:
    """The run's batch source, timing itself: when each batch was asked for (a loop pass
    starts there), and how long it slept on purpose before answering."""

    def __init__(self, inner, delay: float = 0.0):
        self.inner, self.delay = inner, delay
        self.asked: list[float] = []
        self.slept = 0.0

    def next(self):
        self.asked.append(time.perf_counter())
        if self.delay:
            t = time.perf_counter()
            time.sleep(self.delay)
            self.slept += time.perf_counter() - t
        return self.inner.next()

    def skip(self, n):
        self.inner.skip(n)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, s):
        self.inner.load_state_dict(s)


def run(tmp_path, cfg_dict, *, delay=0.0, faults=(), tracker=None):
    cfg = LowprecConfig.from_dict(copy.deepcopy(cfg_dict))
    prepared = prepare_run(cfg)
    data = TimedBatches(prepared.data, delay)
    tele = Telemetry(cfg.telemetry, model=prepared.model, state=prepared.state)
    t0 = time.perf_counter()
    res = train(cfg.train, SingleProcess(prepared.model), prepared.state, data, out_dir=tmp_path,
                controller=prepared.controller, rollout=cfg.rollout, tracker=tracker, faults=faults,
                checkpoints=False, telemetry=tele)
    return res, data, time.perf_counter() - t0


def test_a_slowed_data_loader_shows_as_its_share_of_the_wall_time(tmp_path):
    # without a delay the share is small: the telemetry does not invent data wait
    fast, fast_data, fast_wall = run(tmp_path / "fast", BASE)
    assert fast.telemetry["telemetry/phase/data_s"] / fast.telemetry["telemetry/wall_s"] < 0.05
    # a wait per batch as long as a step takes on this machine now (a busy machine slows the
    # steps, not a sleep): about half of the wall time, whatever the machine's load
    delay = min(0.5, max(0.02, fast.telemetry["telemetry/wall_s"] / res_passes(fast)))
    res, data, wall = run(tmp_path, BASE, delay=delay)
    t = res.telemetry
    injected = data.slept / wall
    seen = t["telemetry/phase/data_s"] / t["telemetry/wall_s"]
    assert injected > 0.1, injected   # the planted wait is a large share: the check below can fail
    assert abs(seen - injected) < 0.05, (seen, injected)
    assert t["telemetry/wall_s"] == pytest.approx(wall, rel=0.02)


def res_passes(res) -> int:
    return max(1, getattr(res, "passes", 0) or int(res.telemetry.get("telemetry/steps", 0)) or BASE["train"]["steps"])


def test_a_forced_rewind_wastes_exactly_the_passes_it_threw_away(tmp_path, free_port):
    cfg = {**BASE, "rollout": ROLLOUT}
    tracker = Tracker(f"http://127.0.0.1:{free_port()}", "lowprec-tests", "rewind", buffer_dir=tmp_path / "track",
                      flush_interval_s=0.2, retry_max_s=1.0, probe_timeout_s=1.0)
    res, data, wall = run(tmp_path / "out", cfg, faults=[Injection("lr_spike", 30, 34, factor=100.0)],
                          tracker=tracker)
    tracker.finish("FINISHED", timeout=2, report=False)
    assert res.rewinds >= 1
    back_of = {s: int(v) for s, v in from_run_dir(tmp_path / "track").metrics["train/rewound_to"]}
    assert len(back_of) == res.rewinds   # one rewind per step: each one's target is known

    # Which step each pass ran, from the events in the order they happened: a pass whose
    # events hold a REWIND goes back to its target, a SKIP_STEP leaves the step unapplied.
    events = list(res.events)
    step, kept, wasted_passes = 0, {}, []
    for i in range(res.passes):
        mine = []
        while events and events[0].step == step:
            mine.append(events.pop(0).kind)
        if EventKind.REWIND in mine:
            wasted_passes.append(i)
            for s in [s for s in kept if s >= back_of[step]]:
                wasted_passes.append(kept.pop(s))
            step = back_of[step]
            continue
        if EventKind.SKIP_STEP in mine:
            wasted_passes.append(i)
        else:
            kept[step] = i
        step += 1
    assert step == 60 and len(kept) + sum(1 for i in wasted_passes) == res.passes
    ends = data.asked[1:] + [data.asked[0] + wall]   # a pass runs from its batch to the next one's
    seconds = [e - s for s, e in zip(data.asked, ends)]
    thrown_away = sum(seconds[i] for i in wasted_passes)
    t = res.telemetry
    booked = sum(t[f"telemetry/bucket/{b}_s"] for b in ("redone", "skipped", "recovery"))
    assert thrown_away > 0.1 * t["telemetry/wall_s"]   # a large share: the check can fail
    assert booked == pytest.approx(thrown_away, rel=0.10), (booked, thrown_away)
    assert t["telemetry/trained_tokens"] == 60 * 8 * 64 - 8 * 64 * sum(
        1 for s in range(60) if s not in kept)


GATE_FILE = """\
defaults: {statistic: paired_bootstrap, confidence: 0.95, bootstrap_samples: 200, seed: 0, min_samples: 8}
gates:
  - metric: eval/heldout_shakespeare/bits_per_byte
    direction: lower_is_better
    max_regression: {relative: 0.5}
"""


def test_phases_add_up_to_the_wall_time_and_the_gate_evaluation_is_eval_time(tmp_path, monkeypatch):
    from lowprec.runtime.session.evals import EvalCheckpoints
    """`lowprec run`'s path (prepare_run, execute) with a stage promoted behind the in-loop gate:
    the gate's evaluations (timed here, around the gate the controller calls) are `eval`, not the
    check's `monitor`; the phases and the start-up add up to the wall time measured outside."""
    from lowprec.runtime.trainer.run import execute
    (tmp_path / "inloop.yaml").write_text(GATE_FILE)
    rollout = {**ROLLOUT, "check_every": 5, "rewind": {"enabled": False}}
    cfg = LowprecConfig.from_dict(copy.deepcopy({
        **BASE, "train": {**BASE["train"], "steps": 20}, "rollout": rollout,
        "eval": {"suite": "shakespeare", "every": 0, "mode": "fast", "final_mode": "fast", "batch_size": 64,
                 "gates": str(tmp_path / "inloop.yaml")}}))
    t0 = time.perf_counter()
    prepared = prepare_run(cfg)
    spent = {"gate": 0.0, "final": 0.0}

    def timed(name, fn):
        def call(self, step):
            t = time.perf_counter()
            try:
                return fn(self, step)
            finally:
                spent[name] += time.perf_counter() - t
        return call
    for name in ("gate", "final"):   # the run's checkpoints (execute builds them from the checked ones)
        monkeypatch.setattr(EvalCheckpoints, name, timed(name, getattr(EvalCheckpoints, name)))
    res = execute(prepared, tmp_path / "out", started=t0)
    wall = time.perf_counter() - t0
    t = res.telemetry
    gates = [e for e in res.events if e.kind == EventKind.GATE]
    assert gates and gates[0].stage == "mlp_fp8" and any(e.kind == EventKind.PROMOTE for e in res.events)
    assert spent["gate"] > 0.2   # large enough that booking it as monitor time would show
    assert t["telemetry/phase/eval_s"] == pytest.approx(spent["gate"] + spent["final"], rel=0.02, abs=0.02)
    assert t["telemetry/phase/monitor_s"] < 0.25 * spent["gate"], (t["telemetry/phase/monitor_s"], spent)
    phases = sum(v for k, v in t.items() if k.startswith("telemetry/phase/"))
    assert phases + t["telemetry/bucket/startup_s"] == pytest.approx(t["telemetry/wall_s"], rel=1e-6)
    assert t["telemetry/wall_s"] == pytest.approx(wall, rel=0.01), (t["telemetry/wall_s"], wall)
    assert sum(v for k, v in t.items() if k.startswith("telemetry/bucket/")) == pytest.approx(wall, rel=0.01)
