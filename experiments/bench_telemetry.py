"""What telemetry costs a training step: the bookkeeping alone, and whole runs with it on and off.

    python experiments/bench_telemetry.py [--config experiments/configs/default.yaml] [--steps 60] [--repeats 3]

Two measurements, one table each:

1. The bookkeeping alone: the clock laps, pass ends and log windows of one step (as the
   loop and the Session make them: 16 laps a step, a window every `train.log_every`
   steps, the energy meter read at each window) repeated many times without any training,
   against the step time of the same config: this is the overhead, free of run-to-run noise.
2. Whole runs of the config (no evals, no tracking, same seed) with telemetry off, on
   without energy, and on with energy and MFU, interleaved `--repeats` times: ms per step
   (median), which shows the overhead is below the machine's run-to-run noise.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import replace

from lowprec.config import LowprecConfig
from lowprec.runtime.trainer.run import execute, prepare_run
from lowprec.tracking.phases import PassOutcome, Phase
from lowprec.tracking.telemetry import Telemetry, TelemetryConfig

LAPS_PER_STEP = [Phase.OTHER, Phase.DATA, Phase.FORWARD, Phase.BACKWARD, Phase.BACKWARD, Phase.OPTIMIZER,
                 Phase.COLLECTIVE, Phase.MONITOR, Phase.OPTIMIZER, Phase.CHECKPOINT, Phase.LR_PROBE,
                 Phase.MONITOR, Phase.OTHER, Phase.TRACKING, Phase.MONITOR, Phase.OTHER]


def bookkeeping_seconds(cfg: TelemetryConfig, steps: int, log_every: int, model=None, state=None) -> float:
    """Seconds per step of telemetry's own calls, with no training in between."""
    tele = Telemetry(cfg, model=model, state=state)
    tele.begin()
    t0 = time.perf_counter()
    for step in range(steps):
        for phase in LAPS_PER_STEP:
            tele.clock.lap(phase)
        tele.end_pass(step, PassOutcome.APPLIED, 2048)
        if (step + 1) % log_every == 0:
            tele.window(step)
    per_step = (time.perf_counter() - t0) / steps
    tele.finish()
    return per_step


def run_ms_per_step(base: LowprecConfig, telemetry: TelemetryConfig, steps: int, out: str) -> float:
    cfg = replace(base, telemetry=telemetry)
    prepared = prepare_run(cfg)
    res = execute(prepared, out, steps=steps)
    return res.seconds_per_step * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="experiments/configs/default.yaml")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="runs/bench_telemetry")
    args = ap.parse_args()
    d = LowprecConfig.from_yaml(args.config).to_dict()
    d.pop("eval", None)
    if d.get("rollout"):
        d["rollout"].pop("baseline", None)   # no loss-gap baseline: no tracking store is read
        d["rollout"].get("thresholds", {}).pop("loss_gap", None)
    d["tracking"] = {"enabled": False}
    d["train"] = {**d.get("train", {}), "steps": args.steps, "ckpt_every": 10 ** 6}
    base = LowprecConfig.from_dict(copy.deepcopy(d), source=args.config)
    variants = {"off": TelemetryConfig(enabled=False),
                "on, no energy": TelemetryConfig(energy="off", mfu=False),
                "on, energy + MFU": TelemetryConfig()}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.repeats):
        for name, tc in variants.items():
            times[name].append(run_ms_per_step(base, tc, args.steps, f"{args.out}/{r}-{len(times[name])}"))
    step_ms = statistics.median(times["off"])
    prepared = prepare_run(base)
    print(f"config {args.config}, {args.steps} steps, log_every {base.train.log_every}, "
          f"{args.repeats} interleaved repeats\n")
    print("| telemetry | bookkeeping per step (us) | share of a step |")
    print("|---|---|---|")
    for name, tc in list(variants.items())[1:]:
        s = bookkeeping_seconds(tc, 2000, base.train.log_every, prepared.model, prepared.state)
        print(f"| {name} | {s * 1e6:.1f} | {s * 1e3 / step_ms:.3%} |")
    print("\n| telemetry | ms/step (median) | runs (ms/step) | vs off |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.1f} | {', '.join(f'{t:.1f}' for t in ts)} | {med / step_ms - 1:+.1%} |")


if __name__ == "__main__":
    main()
