"""Does the profile name the sites the controller had to rescue? (issue 18, the aggressive plan)

    python -m experiments.profile_vs_rescue --seeds 0 1 2 [--work runs/profile_vs_rescue]

Per seed, on experiments/configs/aggressive_fp4.yaml (every linear layer, lm_head included,
in plain FP4 from step 0; evals off, no MLflow, the loss-gap baseline a BF16 run of the
same seed):

1. `lowprec run` with the controller: the sites it moved up their ladder (fallback and
   rollback events), in the order it first moved them;
2. `lowprec profile` of the same config, twice: on the model as built (`--steps 0`, what the
   run starts from) and after 60 BF16 warm-up steps; each ranks the sites by their FP4
   sensitivity.
Agreement: how many of the first 5 sites the controller rescued are among the profile's 5
most sensitive (chance for 5 drawn at random: 25/n), and the rank correlation (Spearman)
between each site's profiled score and how early it was rescued, for two scores: the
sensitivity and the underflow energy (the signal the aggressive config's thresholds act on).
Prints a Markdown table; runs already in `--work` are reused.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from experiments.profile_compare import run_lowprec
from lowprec.profile.measure import Profile

ROOT = Path(__file__).resolve().parents[1]
AGGRESSIVE = ROOT / "experiments" / "configs" / "aggressive_fp4.yaml"
FP4 = "fp4_tensorwise"
TOP = 5


def rescue_steps(events_file: Path) -> dict[str, int]:
    """{site: the step the controller first moved it up its ladder}, in that order."""
    out: dict[str, int] = {}
    for line in events_file.read_text().splitlines() if events_file.is_file() else []:
        e = json.loads(line)
        if e.get("kind") in ("fallback", "rollback"):
            for s in e.get("sites", ()):
                out.setdefault(s, int(e["step"]))
    return dict(sorted(out.items(), key=lambda kv: kv[1]))


def _ranks(values: dict[str, float]) -> dict[str, float]:
    """1 for the smallest value; ties share their mean rank."""
    order = sorted(values, key=lambda k: values[k])
    ranks: dict[str, float] = {}
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in order[i:j + 1]:
            ranks[k] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: dict[str, float], b: dict[str, float]) -> float:
    """Rank correlation of two scores over their common keys."""
    keys = sorted(set(a) & set(b))
    ra, rb = _ranks({k: a[k] for k in keys}), _ranks({k: b[k] for k in keys})
    ma, mb = sum(ra.values()) / len(keys), sum(rb.values()) / len(keys)
    cov = sum((ra[k] - ma) * (rb[k] - mb) for k in keys)
    va = sum((ra[k] - ma) ** 2 for k in keys) ** 0.5
    vb = sum((rb[k] - mb) ** 2 for k in keys) ** 0.5
    return cov / (va * vb) if va and vb else float("nan")


def one_seed(seed: int, work: Path) -> list[dict]:
    d = work / f"seed{seed}"
    d.mkdir(parents=True, exist_ok=True)
    raw = yaml.safe_load(AGGRESSIVE.read_text())
    raw["train"]["seed"] = seed
    raw.pop("eval", None)
    raw["tracking"] = {"enabled": False}
    raw["rollout"]["baseline"] = {"losses": str(d / "bf16" / "losses.json")}
    cfg = d / "aggressive.yaml"
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
    for name, args in (("bf16", ["--as-baseline"]), ("aggressive", [])):
        if not (d / name / "summary.json").is_file():
            run_lowprec(["run", str(cfg), "--out", str(d / name), *args], d / f"{name}.log", 1)
    steps = rescue_steps(d / "aggressive" / "events.jsonl")
    first = list(steps)[:TOP]
    rows = []
    for warmup in (0, 60):
        prof = d / f"profile_{warmup}"
        if not (prof / "profile.json").is_file():
            run_lowprec(["profile", str(cfg), "--steps", str(warmup), "--formats", FP4, "--write",
                         str(d / f"profiled_{warmup}.yaml"), "--out", str(prof), "--no-tracking"],
                        d / f"profile_{warmup}.log", 1)
        profile = Profile.from_dict(json.loads((prof / "profile.json").read_text()))
        entries = [e for e in profile.entries if e.format == FP4]
        for by, score in (("sensitivity", lambda e: e.sensitivity), ("underflow energy", lambda e: e.underflow_energy)):
            ranked = [e.fqn for e in sorted(entries, key=lambda e: -score(e))]
            # earlier rescue = more sensitive: correlate the score with minus the rescue step
            # (a site never rescued counts as rescued after the last step)
            late = max(steps.values(), default=0) + 1
            rho = spearman({e.fqn: score(e) for e in entries}, {e.fqn: -steps.get(e.fqn, late) for e in entries})
            rows.append({"seed": seed, "warmup": warmup, "by": by, "rescued": len(steps), "n_sites": len(entries),
                         "first": first, "top": ranked[:TOP], "overlap": len(set(first) & set(ranked[:TOP])),
                         "chance": TOP * TOP / len(entries), "spearman": rho})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--work", default="runs/profile_vs_rescue")
    args = ap.parse_args()
    work = Path(args.work).resolve()
    rows = [r for seed in args.seeds for r in one_seed(seed, work)]
    (work / "results.json").write_text(json.dumps(rows, indent=1))
    print(f"| seed | profile after | ranked by | sites rescued | first {TOP} rescued in the profile's top {TOP} | "
          f"chance | rank correlation with rescue order |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['warmup']} BF16 steps | {r['by']} | {r['rescued']}/{r['n_sites']} | "
              f"{r['overlap']}/{TOP} | {r['chance']:.1f} | {r['spearman']:+.2f} |")
    for seed in args.seeds:
        r = next(r for r in rows if r["seed"] == seed)
        print(f"\nseed {seed}: first rescued {', '.join(r['first'])}")
        for q in (q for q in rows if q["seed"] == seed):
            print(f"  profile after {q['warmup']} steps, top {TOP} by {q['by']}: {', '.join(q['top'])}")

if __name__ == "__main__":
    main()
