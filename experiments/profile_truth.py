"""What does each site cost when it trains in plain FP4, and which profile column predicts it? (issue 18)

    python -m experiments.profile_truth --seeds 0 [--jobs 2] [--work runs/profile_truth]
                                        [--profiles runs/profile_compare]

Per seed, on the reference model (experiments/configs/default.yaml, evals off, no MLflow): 16
runs of 300 steps, each with one site in plain FP4 (`fp4_tensorwise`) from step 0 and every
other block site in FP8, no controller. A site's cost is its run's loss gap to the BF16 run of
the same seed (mean loss of the last 50 steps, relative): what training with that site
quantized does, the ground truth a profile should rank.

Then, for every profile of that seed found under `--profiles` (the ones
`experiments.profile_compare` wrote: `seedN/profile` after 60 BF16 steps, `seedN/profile_s0`
on the model as built), the rank correlation (Spearman) between each of the profile's
columns for `fp4_tensorwise` and the cost. Runs already in `--work` are reused.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from experiments.profile_compare import gap, seed_config, train
from experiments.profile_vs_rescue import spearman
from lowprec.profile.measure import Profile, SiteCost

FORMAT = "fp4_tensorwise"
SITES = [f"blocks.{b}.{r}" for b in range(4) for r in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]
COLUMNS = {
    "sensitivity": lambda e: e.sensitivity,
    "forward noise": lambda e: e.forward_noise,
    "loss change": lambda e: e.loss_delta,
    "1 - per-tensor cosine": lambda e: 1 - e.grad_cosine_tensors,
    "loss change + (1 - per-tensor cosine)": lambda e: max(e.loss_delta, 0) + 1 - e.grad_cosine_tensors,
    "underflow energy": lambda e: e.underflow_energy,
}


def one_site_config(base: Path, site: str, dest: Path) -> Path:
    """`base` with `site` in plain FP4 and every other block site in FP8 from step 0, no rollout."""
    raw = yaml.safe_load(base.read_text())
    raw.pop("rollout", None)
    raw["precision"]["rules"] = [
        {"name": "fp8", "select": {"fqns": [s for s in SITES if s != site]}, "format": "fp8_tensorwise",
         "ladder": ["fp8_tensorwise", "bf16"]},
        {"name": "fp4", "select": {"fqns": [site]}, "format": FORMAT, "ladder": [FORMAT, "fp8_tensorwise", "bf16"]}]
    dest.write_text(yaml.safe_dump(raw, sort_keys=False))
    return dest


def costs(seed: int, work: Path, jobs: int) -> dict[str, float]:
    cfg = seed_config(work, seed, None)
    d = cfg.parent
    threads = 1 if jobs > 1 else 2
    base = train(cfg, d / "bf16", threads, "--as-baseline")["losses"]

    def one(site: str) -> tuple[str, float]:
        r = train(one_site_config(cfg, site, d / f"{site}.yaml"), d / site, threads, "--no-controller")
        return site, gap(r["losses"], base)
    with ThreadPoolExecutor(jobs) as pool:
        return dict(pool.map(one, SITES))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--work", default="runs/profile_truth")
    ap.add_argument("--profiles", default="runs/profile_compare")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    work = Path(args.work).resolve()
    for seed in args.seeds:
        cost = costs(seed, work, args.jobs)
        (work / f"seed{seed}" / "costs.json").write_text(json.dumps(cost, indent=1))
        profiles = {}
        for name, label in (("profile_s0", "model as built"), ("profile", "after 60 BF16 steps")):
            f = Path(args.profiles) / f"seed{seed}" / name / "profile.json"
            if f.is_file():
                profiles[label] = Profile.from_dict(json.loads(f.read_text()))
        print(f"\nseed {seed}: each site alone in {FORMAT} from step 0 (the rest FP8), loss gap to BF16\n")
        print("| site | loss gap | " + " | ".join(f"sensitivity, {p}" for p in profiles) + " |")
        print("|---|---|" + "---|" * len(profiles))
        for site in sorted(SITES, key=lambda s: -cost[s]):
            cells = [f"{p.entry(site, FORMAT).sensitivity:.3f}" for p in profiles.values()]
            print(f"| {site} | {cost[site]:+.2%} | " + " | ".join(cells) + " |")
        print("\n| profile column | " + " | ".join(f"rank correlation, {p}" for p in profiles) + " |")
        print("|---|" + "---|" * len(profiles))
        for col, score in COLUMNS.items():
            rhos = []
            for p in profiles.values():
                entries: list[SiteCost] = [p.entry(s, FORMAT) for s in SITES]
                rhos.append(spearman({e.fqn: score(e) for e in entries}, cost))
            print(f"| {col} | " + " | ".join(f"{r:+.2f}" for r in rhos) + " |")


if __name__ == "__main__":
    main()
