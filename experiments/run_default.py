"""The README's main job: a BF16 baseline and the staged FP8/NVFP4 rollout, tracked in MLflow.

    python -m experiments.run_default [--config experiments/configs/default.yaml] [--steps N]

Trains the small GPT on Shakespeare twice with the same data and seed: once in BF16
(the baseline curve), once with the config's staged rollout (BF16 -> FP8 MLP -> FP8
attention -> NVFP4 middle MLPs) and the controller watching the loss gap to that
baseline. Both runs go to a local MLflow store (`sqlite:///mlflow.db` in the working
directory, artifacts beside it) with their events and precision timeline pictures.
Ends by printing where the runs are and how to open the UI.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

from experiments.train import load, train
from lowprec.tracking import Tracker


def baseline_config(cfg: dict) -> dict:
    """The same run with every switchable layer held in bf16 and no rollout."""
    base = copy.deepcopy(cfg)
    base.pop("rollout", None)
    for rule in base["precision"].get("rules", []):
        rule["format"], rule["ladder"] = "bf16", ["bf16"]
    return base


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="experiments/configs/default.yaml")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--out", default="runs/default")
    p.add_argument("--tracking-uri", default=None, help="default: sqlite:///<cwd>/mlflow.db")
    p.add_argument("--experiment", default="lowprec-default")
    args = p.parse_args(argv)
    uri = args.tracking_uri or f"sqlite:///{Path.cwd() / 'mlflow.db'}"
    cfg = load(args.config)
    out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    results = {}
    for name, run_cfg, base in (("bf16-baseline", baseline_config(cfg), None), ("staged-rollout", cfg, True)):
        tracker = Tracker(uri, args.experiment, name, buffer_dir=out / name / "tracking")
        curve = None
        if base:
            curve = dict(enumerate(results["bf16-baseline"][0].losses))
        print(f"training {name} ...", flush=True)
        try:
            res = train(run_cfg, out / name, steps=args.steps, baseline=curve, tracker=tracker)
        except BaseException:
            tracker.finish("FAILED")
            raise
        tracker.finish("FINISHED")
        results[name] = (res, tracker.run_id)

    (b, b_id), (r, r_id) = results["bf16-baseline"], results["staged-rollout"]
    tail = 50
    bl, rl = sum(b.losses[-tail:]) / tail, sum(r.losses[-tail:]) / tail
    share = r.flops_share[max(r.flops_share)]
    print()
    print(f"| run | loss (mean of last {tail} steps) | gap to BF16 | ms/step | events |")
    print("|---|---|---|---|---|")
    print(f"| bf16-baseline | {bl:.4f} | - | {b.seconds_per_step * 1e3:.0f} | 0 |")
    print(f"| staged-rollout | {rl:.4f} | {(rl - bl) / bl:+.2%} | {r.seconds_per_step * 1e3:.0f} | {len(r.events)} |")
    print()
    print("GEMM FLOPs by format at the end of the rollout (switchable layers): "
          + ", ".join(f"{k} {v:.0%}" for k, v in sorted(share.items())))
    for e in r.events:
        print("  " + e.summary())
    print()
    print(f"Runs are in the MLflow store {uri} (experiment {args.experiment!r}):")
    print(f"  bf16-baseline  run {b_id}")
    print(f"  staged-rollout run {r_id}")
    print(f"Local files (events.jsonl, checkpoints, report PNGs): {out}")
    print(f"Open the UI:  .venv/bin/lowprec ui --tracking-uri {uri}   (then http://127.0.0.1:5000)")
    print(f"Pictures:     .venv/bin/lowprec report {r_id} --tracking-uri {uri} --out report/")


if __name__ == "__main__":
    main()
