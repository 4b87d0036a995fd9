"""How often does the gate cry wolf, and how often does it catch a real drop?

    python -m experiments.gate_calibration --seeds 0 1 2 3 4 5 --gates gates/default.yaml

Trains the BF16 baseline of a config (default: experiments/configs/default.yaml with every
layer held in BF16, no rollout) once per seed, evaluates each on the full `default` suite,
and keeps the results with their per-example scores under `--out` (a run already there is
reused). Then every ordered pair of different seeds is put through the gate file:

- false alarms: the share of pairs whose verdict is `regress`. The two runs differ only in
  seed, so every `regress` is a false alarm (the issue asks for at most 5%);
- detection: the candidate's per-example scores of one metric made worse by a planted drop
  of a stated size (bits per byte times (1 + d); for accuracies, d of the examples the
  candidate got right turned wrong, chosen with a seeded generator), and the share of
  pairs that then `regress` on that metric.

Seeds can be trained side by side (`--seeds 0 1 --threads 1 &` and `--seeds 2 3 --threads 1`);
a last call with every seed reads them all back and compares. Prints the per-pair table of each gate's regression and interval, and the rates, as
Markdown (docs/gates.md records them with this command).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

from dataclasses import replace

from lowprec.config import LowprecConfig
from lowprec.runtime.run import high_precision_baseline, run_config
from gates import GateSpec, Scores, check_all
from gates.gate import HIGHER_IS_BETTER
from lowprec.verdicts import Verdict


def seed_run(cfg: LowprecConfig, seed: int, out: Path, steps: int | None) -> dict:
    """Train and evaluate one seed (or read what an earlier call left in `out`)."""
    path = out / f"seed{seed}.json"
    if path.is_file():
        return json.loads(path.read_text())
    base = high_precision_baseline(cfg)
    run_cfg = replace(base, train=replace(base.train, seed=seed), eval=replace(base.eval, final_mode="full"),
                      tracking=replace(base.tracking, enabled=False))
    res = run_config(run_cfg, out / f"seed{seed}", steps=steps)
    ev = res.final_eval
    n = {task: len(next(iter(per.values()), {})) for task, per in ev.samples.items()}
    data = {"seed": seed, "final_loss": sum(res.losses[-50:]) / len(res.losses[-50:]),
            "results": ev.results, "samples": ev.samples, "n": n}
    path.write_text(json.dumps(data))
    return data


def planted(samples: dict, metric: str, drop: float, direction: str, seed: int) -> dict:
    """`samples` with one metric ({task: {metric: {key: score}}}) made worse by `drop`."""
    task, name = metric.split("/")[1:3]
    out = json.loads(json.dumps(samples))
    scores = out[task][name]
    if direction == HIGHER_IS_BETTER:   # accuracies: turn `drop` of all examples from right to wrong
        right = sorted(k for k, v in scores.items() if v > 0.5)
        rng = random.Random(seed)
        for k in rng.sample(right, min(len(right), round(drop * len(scores)))):
            scores[k] = 0.0
    else:
        for k in scores:
            scores[k] *= 1.0 + drop
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="experiments/configs/default.yaml")
    p.add_argument("--gates", default="gates/default.yaml")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--drops", type=float, nargs="+", default=[0.01, 0.02, 0.03, 0.05],
                   help="planted drops: relative for bits per byte, absolute share of examples for accuracies")
    p.add_argument("--out", default="runs/gate_calibration")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (e.g. 1 when seeds run side by side)")
    args = p.parse_args(argv)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = LowprecConfig.from_yaml(args.config)
    spec = GateSpec.from_yaml(args.gates)
    runs = {s: seed_run(cfg, s, out, args.steps) for s in args.seeds}
    scores = {s: Scores.from_eval(r["results"], r["samples"], source=f"seed {s}") for s, r in runs.items()}
    pairs = list(itertools.permutations(args.seeds, 2))

    print(f"## Seed-to-seed pairs ({len(pairs)} ordered pairs of {len(args.seeds)} BF16 runs), {args.gates}\n")
    print("| seeds | " + " | ".join(g.metric for g in spec.gates) + " |")
    print("|---|" + "---|" * len(spec.gates))
    alarms = {g.metric: 0 for g in spec.gates}
    any_alarm = 0
    for b, c in pairs:
        res = check_all(spec, scores[b], scores[c])
        cells = []
        for r in res:
            alarms[r.metric] += r.verdict is Verdict.REGRESS
            cells.append(f"{r.delta:+.4f} [{r.interval[0]:+.4f}, {r.interval[1]:+.4f}] {r.verdict}"
                         if r.interval else r.verdict.value)
        any_alarm += any(r.verdict is Verdict.REGRESS for r in res)
        print(f"| {b} -> {c} | " + " | ".join(cells) + " |")
    print()
    print("| gate | tolerance | false alarms |")
    print("|---|---|---|")
    for g in spec.gates:
        print(f"| {g.metric} | {g.max_regression.describe()} | {alarms[g.metric]}/{len(pairs)} "
              f"({alarms[g.metric] / len(pairs):.1%}) |")
    print(f"| any gate | | {any_alarm}/{len(pairs)} ({any_alarm / len(pairs):.1%}) |")

    print("\n## Detection of a planted drop (pairs whose verdict on that metric is regress)\n")
    print("| gate | " + " | ".join(f"drop {d:g}" for d in args.drops) + " |")
    print("|---|" + "---|" * len(args.drops))
    for g in spec.gates:
        cells = []
        for d in args.drops:
            hit = 0
            for i, (b, c) in enumerate(pairs):
                bad = planted(runs[c]["samples"], g.metric, d, g.direction, seed=i)
                cand = Scores.from_eval(runs[c]["results"], bad, source=f"seed {c} with a drop")
                hit += g.check(scores[b], cand).verdict is Verdict.REGRESS
            cells.append(f"{hit}/{len(pairs)} ({hit / len(pairs):.0%})")
        print(f"| {g.metric} | " + " | ".join(cells) + " |")
    print("\nFinal training loss (mean of the last 50 steps) per seed: "
          + ", ".join(f"{s}: {r['final_loss']:.4f}" for s, r in runs.items()))


if __name__ == "__main__":
    main()
