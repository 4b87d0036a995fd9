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
Agreement: how many of the k rescued sites are among the profile's k most sensitive (and
the chance of that for k sites drawn at random: k*k/n), and where each rescued site ranks.
Prints a Markdown table; runs already in `--work` are reused.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

from lowprec.profile.measure import Profile

ROOT = Path(__file__).resolve().parents[1]
AGGRESSIVE = ROOT / "experiments" / "configs" / "aggressive_fp4.yaml"
FP4 = "fp4_tensorwise"


def _lowprec(args: list[str], log: Path) -> None:
    with open(log, "w") as fh:
        r = subprocess.run([sys.executable, "-m", "lowprec.cli", *args], cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                           env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    if r.returncode != 0:
        raise RuntimeError(f"`lowprec {' '.join(args)}` failed ({r.returncode}); see {log}")


def rescued_sites(events_file: Path) -> list[str]:
    """The sites the controller moved up their ladder, in the order it first did."""
    out: list[str] = []
    for line in events_file.read_text().splitlines() if events_file.is_file() else []:
        e = json.loads(line)
        if e.get("kind") in ("fallback", "rollback"):
            out += [s for s in e.get("sites", ()) if s not in out]
    return out


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
            _lowprec(["run", str(cfg), "--out", str(d / name), *args], d / f"{name}.log")
    rescued = rescued_sites(d / "aggressive" / "events.jsonl")
    rows = []
    for steps in (0, 60):
        prof = d / f"profile_{steps}"
        if not (prof / "profile.json").is_file():
            _lowprec(["profile", str(cfg), "--steps", str(steps), "--formats", FP4, "--write",
                      str(d / f"profiled_{steps}.yaml"), "--out", str(prof), "--no-tracking"], d / f"profile_{steps}.log")
        profile = Profile.from_dict(json.loads((prof / "profile.json").read_text()))
        ranked = [e.fqn for e in sorted(profile.entries, key=lambda e: -e.sensitivity) if e.format == FP4]
        k, n = len(rescued), len(ranked)
        top = set(ranked[:k])
        rows.append({"seed": seed, "warmup": steps, "rescued": rescued, "n_sites": n,
                     "top_k": ranked[:k], "overlap": len(top & set(rescued)),
                     "chance": k * k / n if n else 0.0,
                     "ranks": {s: ranked.index(s) + 1 for s in rescued if s in ranked}})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--work", default="runs/profile_vs_rescue")
    args = ap.parse_args()
    work = Path(args.work).resolve()
    rows = [r for seed in args.seeds for r in one_seed(seed, work)]
    (work / "results.json").write_text(json.dumps(rows, indent=1))
    print("| seed | profiled after | rescued by the controller (k) | in the profile's top k | chance | "
          "their profile ranks (of n) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ranks = ", ".join(f"{s} {i}" for s, i in r["ranks"].items())
        print(f"| {r['seed']} | {r['warmup']} BF16 steps | {len(r['rescued'])} | {r['overlap']}/{len(r['rescued'])} | "
              f"{r['chance']:.1f} | {ranks} (n={r['n_sites']}) |")


if __name__ == "__main__":
    main()
