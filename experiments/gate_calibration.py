"""How often does the gate cry wolf, and how often does it catch a real drop?

    python -m experiments.gate_calibration --pairs 50 --threads 1          # train (cached) and compare

Trains a small config (experiments/configs/gate_calibration.yaml: every linear layer in BF16,
no rollout) twice per seed 0..N-1: once as it is (`bf16`) and once with every linear layer
kept in FP32 (`fp32`: the same seed, initialisation and batch order, only the rounding of the
matmul operands differs - a harmless numerical difference). Each run is evaluated once on the
full eval sets of the gated tasks and kept, with its per-example scores, under `--out`
(`<kind>_seed<N>.json`; a run already there is reused, so the campaign can be stopped and
resumed, and adding pairs only trains the new seeds). `--limit N` evaluates the first N documents
of each task instead (a smoke run; the gates still need their `min_samples`); a cached run
evaluated with another limit is trained again. Then two kinds of comparison are put
through the gate file, N pairs each, no run used twice within a kind:

- (a) same seed, harmless difference (what `make run` compares: a BF16 baseline and a
  candidate of the same seed whose numerics differ): pair s is bf16_s -> fp32_s for even s
  and fp32_s -> bf16_s for odd s (baseline -> candidate), so a systematic effect of FP32
  shows in both directions;
- (b) different seeds: pair s is bf16_s -> fp32_{s+1} (even s) or fp32_{s+1} -> bf16_s
  (odd s), seeds modulo N.

Every `regress` is a false alarm; rates come with Clopper-Pearson 95% intervals. Detection:
the candidate's per-example scores of one metric made worse by a planted regression of
1/2/4/8% (bits per byte times 1 + d; for accuracies, d of all examples turned from right to
wrong), and the share of pairs that then `regress` on that metric (the power curve). For
setting tolerances it also prints, per gate, the false alarms at other tolerances and the
noise that `lowprec gate --power` uses (`noise:` in the gate file). Output is Markdown
(docs/gates.md records it with the command); `--json FILE` keeps the numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

from lowprec.gates import GateSpec, Scores, check_all
from lowprec.gates.gate import HIGHER_IS_BETTER
from lowprec.gates.power import clopper_pearson
from lowprec.policy.verdicts import Verdict

KINDS = ("bf16", "fp32")
TASKS = ("heldout_shakespeare", "cloze_shakespeare", "shift_milton")
DROPS = (0.01, 0.02, 0.04, 0.08)


def kind_config(cfg, kind: str, seed: int):
    """The calibration config at one seed, in BF16 or with every linear layer kept in FP32."""
    from lowprec.sites.plan import PrecisionPlan
    run = replace(cfg, train=replace(cfg.train, seed=seed), rollout=None, eval=None)
    if kind == "fp32":
        d = cfg.precision.to_dict()
        d["keep_high_precision"] = list(d.get("keep_high_precision") or []) + [{"module_type": "Linear"}]
        run = replace(run, precision=PrecisionPlan.from_dict(d))
    return run


def train_eval(cfg, kind: str, seed: int, out: Path, steps: int | None, limit: int | None = None) -> dict:
    """Train and evaluate one run (or read what an earlier call with the same `limit` left in `out`)."""
    path = out / f"{kind}_seed{seed}.json"
    if path.is_file():
        data = json.loads(path.read_text())
        if data.get("limit") == limit:
            return data
    from lowprec.evals import ByteTokenizer, EvalSuite, run_suite
    from lowprec.runtime.trainer.run import execute, prepare_run
    t0 = time.perf_counter()
    prepared = prepare_run(kind_config(cfg, kind, seed), controller=False)
    res = execute(prepared, out / f"{kind}_seed{seed}", steps=steps)
    t1 = time.perf_counter()
    prepared.model.eval()
    ev = run_suite(EvalSuite("gated", TASKS), prepared.model, ByteTokenizer(), cfg.data.block_size, mode="full",
                   model=prepared.model, limit=limit)
    tail = res.losses[-20:]
    data = {"kind": kind, "seed": seed, "final_loss": sum(tail) / len(tail), "results": ev.results,
            "samples": ev.samples, "limit": limit, "train_s": t1 - t0, "eval_s": time.perf_counter() - t1}
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


def planted_run(run: dict, metric: str, drop: float, direction: str, seed: int) -> tuple[dict, dict]:
    """(results, samples) of a run with one metric made worse by `drop`, the aggregate value too."""
    task, name = metric.split("/")[1:3]
    samples = planted(run["samples"], metric, drop, direction, seed)
    results = json.loads(json.dumps(run["results"]))
    if direction == HIGHER_IS_BETTER:
        v = samples[task][name]
        results[task][name] = sum(v.values()) / len(v)
    else:
        results[task][name] *= 1.0 + drop
    return results, samples


def pairs_of(n: int) -> dict[str, list[tuple[tuple[str, int], tuple[str, int]]]]:
    """(baseline, candidate) run keys of the two comparisons; no run twice within one."""
    same = [(("bf16", s), ("fp32", s)) if s % 2 == 0 else (("fp32", s), ("bf16", s)) for s in range(n)]
    seeds = [(("bf16", s), ("fp32", (s + 1) % n)) if s % 2 == 0 else (("fp32", (s + 1) % n), ("bf16", s))
             for s in range(n)]
    return {"same seed, BF16 vs FP32": same, "different seeds": seeds}


def rate(k: int, n: int) -> str:
    lo, hi = clopper_pearson(k, n)
    return f"{k}/{n} ({k / n:.0%}, {lo:.1%}-{hi:.1%})"


def regressions(result, baseline_value: float, relative: bool) -> tuple[float, float, float]:
    """(delta, lower end, half width) of a result, relative to |baseline| for relative tolerances."""
    scale = abs(baseline_value) if relative else 1.0
    lo, hi = result.interval
    return result.delta / scale, lo / scale, (hi - lo) / 2 / scale


def compare(spec: GateSpec, runs: dict, pairs: list, drops) -> dict:
    scores = {k: Scores.from_eval(r["results"], r["samples"], source=f"{k[0]} seed {k[1]}") for k, r in runs.items()}
    out = {"pairs": [], "alarms": {g.metric: 0 for g in spec.gates}, "any": 0,
           "detect": {g.metric: {d: 0 for d in drops} for g in spec.gates}}
    for i, (b, c) in enumerate(pairs):
        res = check_all(spec, scores[b], scores[c])
        row = {"baseline": list(b), "candidate": list(c), "gates": {}}
        for g, r in zip(spec.gates, res):
            out["alarms"][g.metric] += r.verdict is Verdict.REGRESS
            rel = g.max_regression.kind == "relative"
            row["gates"][g.metric] = dict(zip(("delta", "lo", "half"), regressions(r, r.baseline_value, rel))) \
                if r.interval else None
            row["gates"][g.metric]["verdict"] = str(r.verdict.value) if r.interval else None
            for d in drops:
                bad = planted(runs[c]["samples"], g.metric, d, g.direction, seed=i)
                cand = Scores.from_eval(runs[c]["results"], bad, source="with a drop")
                out["detect"][g.metric][d] += g.check(scores[b], cand).verdict is Verdict.REGRESS
        out["any"] += any(r.verdict is Verdict.REGRESS for r in res)
        out["pairs"].append(row)
    return out


def spread(spec: GateSpec, runs: dict, n: int, k: int, drops) -> dict:
    """Seed-aware baselines: candidate fp32_s against the k BF16 runs of seeds s+1..s+k (mod n)."""
    from lowprec.gates.gate import check_spread
    scores = {key: Scores.from_eval(r["results"], r["samples"]) for key, r in runs.items()}
    out = {"alarms": {g.metric: 0 for g in spec.gates}, "any": 0, "detect": {g.metric: {d: 0 for d in drops}
                                                                              for g in spec.gates}}
    for s in range(n):
        bases = [scores[("bf16", (s + j) % n)] for j in range(1, k + 1)]
        res = [check_spread(g, bases, scores[("fp32", s)]) for g in spec.gates]
        for g, r in zip(spec.gates, res):
            out["alarms"][g.metric] += r.verdict is Verdict.REGRESS
            for d in drops:
                cand = Scores.from_eval(*planted_run(runs[("fp32", s)], g.metric, d, g.direction, seed=s))
                out["detect"][g.metric][d] += check_spread(g, bases, cand).verdict is Verdict.REGRESS
        out["any"] += any(r.verdict is Verdict.REGRESS for r in res)
    return out


def noise(rows: list, metric: str) -> dict:
    """The noise `lowprec gate --power` uses: sd of the harmless regressions beyond the eval's own."""
    cells = [r["gates"][metric] for r in rows if r["gates"].get(metric)]
    deltas = [c["delta"] for c in cells]
    se2 = statistics.fmean((c["half"] / 1.96) ** 2 for c in cells)
    sd = statistics.stdev(deltas)
    return {"mean": statistics.fmean(deltas), "sd": sd, "between_runs_sd": math.sqrt(max(sd * sd - se2, 0.0)),
            "eval_se": math.sqrt(se2), "max": max(deltas), "max_lo": max(c["lo"] for c in cells)}


FIXTURE_RUNS = (("bf16", 0), ("bf16", 1), ("bf16", 2), ("bf16", 3), ("fp32", 0), ("fp32", 4))


def export_fixture(runs: dict, path: Path) -> None:
    """A few recorded runs, gated metrics only, rounded (tests/lowprec/gates/data/calibrated_runs.json)."""
    keep = {"heldout_shakespeare": ("bits_per_byte",), "cloze_shakespeare": ("acc",), "shift_milton": ("bits_per_byte",)}
    out = {}
    for kind, seed in FIXTURE_RUNS:
        r = runs[(kind, seed)]
        out[f"{kind}_seed{seed}"] = {
            "results": {t: {k: v for k, v in r["results"][t].items() if k.split("_stderr")[0] in ms}
                        for t, ms in keep.items()},
            "samples": {t: {m: {k: round(v, 6) for k, v in r["samples"][t][m].items()} for m in ms}
                        for t, ms in keep.items()}}
    path.write_text(json.dumps({"config": "experiments/configs/gate_calibration.yaml", "runs": out},
                               separators=(",", ":")))


def main(argv=None) -> None:
    from lowprec.config import LowprecConfig
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="experiments/configs/gate_calibration.yaml")
    p.add_argument("--gates", default="gates/default.yaml")
    p.add_argument("--pairs", type=int, default=50, help="pairs per comparison (seeds 0..N-1, two runs each)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--limit", type=int, default=None,
                   help="documents per task in each eval (default: the full sets; a smoke run's few: the gates "
                        "need their min_samples)")
    p.add_argument("--drops", type=float, nargs="+", default=list(DROPS),
                   help="planted regressions: relative for bits per byte, a share of examples for accuracies")
    p.add_argument("--tolerances", type=float, nargs="+", default=[0.005, 0.01, 0.015, 0.02, 0.03, 0.05],
                   help="relative tolerances at which to count false alarms (for choosing one)")
    p.add_argument("--spread-k", type=int, nargs="*", default=[4, 8],
                   help="numbers of baselines for the seed-aware comparisons")
    p.add_argument("--out", default="runs/gate_calibration")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 on a shared machine)")
    p.add_argument("--train-only", action="store_true", help="train and cache the runs, compare nothing")
    p.add_argument("--json", default=None, help="also write the numbers to this file")
    p.add_argument("--fixture", default=None, help="write the recorded runs the tests use to this file")
    args = p.parse_args(argv)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = LowprecConfig.from_yaml(args.config)
    started = time.perf_counter()
    runs = {}
    for s in range(args.pairs):
        for k in KINDS:
            runs[(k, s)] = train_eval(cfg, k, s, out, args.steps, args.limit)
            r = runs[(k, s)]
            print(f"[{time.perf_counter() - started:7.0f}s] {k} seed {s}: loss {r['final_loss']:.4f}, "
                  f"train {r['train_s']:.1f}s, eval {r['eval_s']:.1f}s", flush=True)
    if args.fixture:
        export_fixture(runs, Path(args.fixture))
    if args.train_only:
        return
    spec = GateSpec.from_yaml(args.gates)
    report = {"config": args.config, "gates": args.gates, "pairs": args.pairs, "comparisons": {}}
    secs = sum(r["train_s"] + r["eval_s"] for r in runs.values())
    print(f"\n{len(runs)} runs of {args.config} ({secs / 60:.1f} min of training and eval in all, "
          f"{secs / len(runs):.1f} s per run); gate file {args.gates}\n")
    for name, pairs in pairs_of(args.pairs).items():
        res = compare(spec, runs, pairs, args.drops)
        report["comparisons"][name] = res
        print(f"## {name}: {len(pairs)} pairs\n")
        print("| gate | tolerance | false alarms (95% CI) |")
        print("|---|---|---|")
        for g in spec.gates:
            print(f"| {g.metric} | {g.max_regression.describe()} | {rate(res['alarms'][g.metric], len(pairs))} |")
        print(f"| any gate | | {rate(res['any'], len(pairs))} |\n")
        print("Detection of a planted regression (pairs whose verdict on that metric is regress):\n")
        print("| gate | " + " | ".join(f"{d:.0%}" for d in args.drops) + " |")
        print("|---|" + "---|" * len(args.drops))
        for g in spec.gates:
            print(f"| {g.metric} | " + " | ".join(rate(res["detect"][g.metric][d], len(pairs)) for d in args.drops)
                  + " |")
        print("\nNoise of the regression (relative to the baseline for relative tolerances) and false alarms at "
              "other relative tolerances (pairs whose interval's lower end exceeds it):\n")
        print("| gate | mean | sd | eval se | sd between runs | largest | "
              + " | ".join(f"{t:g}" for t in args.tolerances) + " |")
        print("|---|---|---|---|---|---|" + "---|" * len(args.tolerances))
        res["noise"] = {}
        for g in spec.gates:
            nz = noise(res["pairs"], g.metric)
            res["noise"][g.metric] = nz
            los = [r["gates"][g.metric]["lo"] for r in res["pairs"] if r["gates"].get(g.metric)]
            print(f"| {g.metric} | {nz['mean']:+.4f} | {nz['sd']:.4f} | {nz['eval_se']:.4f} | "
                  f"{nz['between_runs_sd']:.4f} | {nz['max']:+.4f} | "
                  + " | ".join(f"{sum(lo > t for lo in los)}" for t in args.tolerances) + " |")
        print()
    for k in args.spread_k:
        res = spread(spec, runs, args.pairs, k, args.drops)
        report["comparisons"][f"seed spread, k={k}"] = res
        n = args.pairs
        print(f"## Seed-aware baselines: FP32 seed s against the {k} BF16 runs of seeds s+1..s+{k}, {n} comparisons\n")
        print("| gate | tolerance | false alarms (95% CI) | " + " | ".join(f"{d:.0%}" for d in args.drops) + " |")
        print("|---|---|---|" + "---|" * len(args.drops))
        for g in spec.gates:
            print(f"| {g.metric} | {g.max_regression.describe()} | {rate(res['alarms'][g.metric], n)} | "
                  + " | ".join(rate(res["detect"][g.metric][d], n) for d in args.drops) + " |")
        print(f"| any gate | | {rate(res['any'], n)} |" + " |" * len(args.drops) + "\n")
    print("Final training loss (mean of the last 20 steps): "
          + ", ".join(f"{k}: {statistics.fmean(r['final_loss'] for (kk, _), r in runs.items() if kk == k):.4f}"
                      for k in KINDS))
    if args.json:
        Path(args.json).write_text(json.dumps(report, default=str, indent=1))


if __name__ == "__main__":
    main()
