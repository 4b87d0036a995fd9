"""The README's main job: a BF16 baseline and the staged FP8/NVFP4 rollout, tracked in MLflow.

    python -m experiments.run_default [--config experiments/configs/default.yaml] [--steps N]
    python -m experiments.run_default --config experiments/configs/aggressive_fp4.yaml \
        --name aggressive-fp4 --controller-off --experiment lowprec-aggressive

Trains the small GPT on Shakespeare twice with the same data and seed: once in BF16
(the baseline curve), once with the config's staged rollout (BF16 -> FP8 MLP -> FP8
attention -> NVFP4 middle MLPs) and the controller watching the loss gap to that
baseline. Both are evaluated (the config's `eval:` section: periodic fast evals, the in-loop
gate before each promotion, a full eval at the end), then the CI gate (`gates/default.yaml`,
what `lowprec gate` runs) compares the two runs' final evals. Both runs go to a local MLflow
store (`sqlite:///mlflow.db` in the working directory, artifacts beside it) with their events,
evals and precision timeline pictures. Ends by printing where the runs are and how to open
the UI.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

from experiments.train import load, train
from lowprec.tracking.tracker import Tracker


def baseline_config(cfg: dict) -> dict:
    """The same run with every switchable layer held in bf16 and no rollout."""
    base = copy.deepcopy(cfg)
    base.pop("rollout", None)
    if base.get("eval"):   # the same final eval; nothing below high precision to compare with
        base["eval"] = {**base["eval"], "every": 0, "high_precision": False, "gates": None}
    for rule in base["precision"].get("rules", []):
        rule["format"], rule["ladder"] = "bf16", ["bf16"]
    return base


def _train_tracked(name: str, run_cfg: dict, out: Path, uri: str, experiment: str, **kw):
    tracker = Tracker(uri, experiment, name, buffer_dir=out / name / "tracking")
    print(f"training {name} ...", flush=True)
    try:
        res = train(run_cfg, out / name, tracker=tracker, **kw)
    except BaseException:
        tracker.finish("FAILED")
        raise
    tracker.finish("FINISHED")
    return res, tracker.run_id


def _bpb(res) -> str:
    ev = res.final_eval
    if ev is None or "heldout_shakespeare" not in ev.results:
        return "-"
    return f"{ev.results['heldout_shakespeare']['bits_per_byte']:.4f}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="experiments/configs/default.yaml")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--out", default="runs/default")
    p.add_argument("--tracking-uri", default=None, help="default: sqlite:///<cwd>/mlflow.db")
    p.add_argument("--experiment", default="lowprec-default")
    p.add_argument("--name", default="staged-rollout", help="run name of the candidate")
    p.add_argument("--controller-off", action="store_true",
                   help="also train the candidate plan with the controller off (no promotions, no fallbacks)")
    p.add_argument("--gates", default="gates/default.yaml", help="the CI gate between baseline and candidates")
    args = p.parse_args(argv)
    uri = args.tracking_uri or f"sqlite:///{Path.cwd() / 'mlflow.db'}"
    cfg = load(args.config)
    out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    b, b_id = _train_tracked("bf16-baseline", baseline_config(cfg), out, uri, args.experiment, steps=args.steps)
    curve = dict(enumerate(b.losses))
    runs = {args.name: _train_tracked(args.name, cfg, out, uri, args.experiment, steps=args.steps, baseline=curve)}
    if args.controller_off:
        runs[f"{args.name}-controller-off"] = _train_tracked(f"{args.name}-controller-off", cfg, out, uri,
                                                             args.experiment, steps=args.steps, controller=False)

    tail = 50
    mean = lambda r: sum(r.losses[-tail:]) / len(r.losses[-tail:])  # noqa: E731
    bl = mean(b)
    print()
    print(f"| run | loss (mean of last {tail} steps) | gap to BF16 | held-out bits/byte | ms/step | events | "
          f"GEMM FLOPs at the end |")
    print("|---|---|---|---|---|---|---|")
    print(f"| bf16-baseline | {bl:.4f} | - | {_bpb(b)} | {b.seconds_per_step * 1e3:.0f} | 0 | bf16 100% |")
    for name, (r, _) in runs.items():
        share = r.flops_share[max(r.flops_share)]
        shares = ", ".join(f"{k} {v:.0%}" for k, v in sorted(share.items(), key=lambda kv: -kv[1]))
        print(f"| {name} | {mean(r):.4f} | {(mean(r) - bl) / bl:+.2%} | {_bpb(r)} | "
              f"{r.seconds_per_step * 1e3:.0f} | {len(r.events)} | {shares} |")
    r, r_id = runs[args.name]
    print()
    for e in r.events:
        print("  " + e.summary())
    print()
    verdicts = {}
    if cfg.get("eval"):
        from gates.cli import GateArgs, run as run_gate
        for name, (_, run_id) in runs.items():
            print(f"The CI gate ({args.gates}) on the final evals: {name} against bf16-baseline")
            code = run_gate(GateArgs(b_id, run_id, args.gates, tracking_uri=uri,
                                     markdown=str(out / f"gate-{name}.md"), junit=str(out / f"gate-{name}.xml")))
            verdicts[name] = {0: "pass (or inconclusive: see above)", 1: "REGRESSION", 2: "unusable input"}[code]
            print()
    for name, v in verdicts.items():
        print(f"Gate verdict, {name}: {v}")
    print(f"Runs are in the MLflow store {uri} (experiment {args.experiment!r}):")
    print(f"  bf16-baseline  run {b_id}")
    for name, (_, run_id) in runs.items():
        print(f"  {name}  run {run_id}")
    print(f"Local files (events.jsonl, checkpoints, report PNGs, gate reports): {out}")
    print(f"Open the UI:  .venv/bin/lowprec ui --tracking-uri {uri}   (then http://127.0.0.1:5000)")
    print(f"Pictures:     .venv/bin/lowprec report {r_id} --tracking-uri {uri} --out report/")
    print(f"The gate:     .venv/bin/lowprec gate --baseline {b_id} --candidate {r_id} --gates {args.gates} "
          f"--tracking-uri {uri}")


if __name__ == "__main__":
    main()
