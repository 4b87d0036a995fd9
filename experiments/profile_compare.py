"""Does a profiled plan beat the hand-written one, and a random one? (issue 18)

    python -m experiments.profile_compare --seeds 0 1 2 [--jobs 2] [--work runs/profile_compare]

Per seed, on the reference model (experiments/configs/default.yaml, evals off, no MLflow):

1. `bf16`: the config's BF16 baseline (`lowprec run --as-baseline`); every other run's loss
   gap is measured against it (mean loss of the last 50 steps, relative).
2. `default`: the hand-written plan as it is (FP8 everywhere, NVFP4 in the middle MLPs, 3 stages).
3. `lowprec profile` once (60 BF16 warm-up steps, 4 held batches, formats fp8_tensorwise,
   nvfp4 and fp4_tensorwise at every site); from that one profile, plans written with the
   planner of `lowprec profile`:
   * `profiled_same`: FP8 everywhere, NVFP4 capped at the default's share (1/3): the profile
     chooses which third, and the stage order;
   * `pushedNN_profiled`: pushed further, `--push-format` (default fp4_tensorwise, plain FP4
     without NVFP4's scales and tricks) capped at each `--push-share` (NN percent), the rest FP8;
   * `pushedNN_random`: the same share of the same format on sites drawn at random (seeded
     by the seed), the same stage structure.
   Every written config passes the checks of `lowprec plan`, then runs with `lowprec run`
   (the controller on: it may fall back). The pushed plans also run as they are from step 0
   (`pushedNN_*_fixed`: `--no-controller`, rules starting in the final format): the plan's own
   loss gap.
Prints one Markdown table per seed and the mean over seeds: loss gap, final share of FP4
and FP8 FLOPs, controller events (sites fallen back on their own signals, rollbacks by the
loss-gap gate, rewinds), and whether the gate held: the gap within
`rollout.thresholds.loss_gap` (3%) and the loss-gap gate never tripped. Runs already in
`--work` are reused.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import yaml

from lowprec.config import LowprecConfig
from lowprec.numerics.formats import get_format
from lowprec.profile.measure import Profile, SiteCost
from lowprec.profile.planner import choose_formats, final_shares, order_stages
from lowprec.profile.written import check_written, write_config
from lowprec.runtime.trainer.run import prepare_run

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "experiments" / "configs" / "default.yaml"
GAP_STEPS = 50


def run_lowprec(cmd: list[str], log: Path, threads: int) -> None:
    """`lowprec CMD` as a subprocess from the repository root, its output in `log`; raises on failure."""
    env = {"OMP_NUM_THREADS": str(threads), "PATH": "/usr/bin:/bin"}
    with open(log, "w") as fh:
        r = subprocess.run([sys.executable, "-m", "lowprec.cli", *cmd], cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                           env=env)
    if r.returncode != 0:
        raise RuntimeError(f"`lowprec {' '.join(cmd)}` failed ({r.returncode}); see {log}")


def seed_config(work: Path, seed: int, steps: int | None) -> Path:
    raw = yaml.safe_load(DEFAULT.read_text())
    raw["train"]["seed"] = seed
    if steps:
        raw["train"]["steps"] = steps
    raw.pop("eval", None)
    raw["tracking"] = {"enabled": False}
    raw["rollout"]["baseline"] = {"losses": str(work / f"seed{seed}" / "bf16" / "losses.json")}
    path = work / f"seed{seed}" / "default.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def train(config: Path, out: Path, threads: int, *extra: str) -> dict:
    if not (out / "summary.json").is_file():
        run_lowprec(["run", str(config), "--out", str(out), *extra], out.with_suffix(".log"), threads)
    losses = json.loads((out / "losses.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    return {"losses": [float(v) for v in losses], "summary": summary}


def _random_profile(profile: Profile, seed: int) -> Profile:
    """The same pairs with a random ranking: each site one random sensitivity, every format."""
    rng = random.Random(seed)
    draw = {f: rng.random() for f in sorted({e.fqn for e in profile.entries})}
    entries = [SiteCost(e.fqn, e.format, e.flop_share, loss_delta=draw[e.fqn] * e.flop_share, grad_cosine=1.0)
               for e in profile.entries]
    return Profile(entries, profile.reference_loss, profile.batches, profile.tokens_per_batch,
                   profile.passes_per_rank, profile.world, profile.seconds)


def write_plan(name: str, cfg_path: Path, profile: Profile, caps: dict[str, float], formats: list[str],
               *, from_start: bool = False) -> Path:
    """A plan from `profile` restricted to `formats`, with `caps`; checked as `lowprec plan` checks."""
    cfg = LowprecConfig.from_yaml(cfg_path)
    prepared = prepare_run(replace(cfg, rollout=None, eval=None), controller=False, with_data=False)
    keep = Profile([e for e in profile.entries if e.format in formats], profile.reference_loss, profile.batches,
                   profile.tokens_per_batch, profile.passes_per_rank, profile.world, profile.seconds)
    ladders = {f: [x.name for x in s.ladder] for f, s in prepared.state.sites.items()}
    choices = choose_formats(keep, ladders, budget=float("inf"), max_share=caps)
    stages = order_stages(choices, keep, 3)
    order = [f for f, _ in prepared.model.named_modules() if f in choices]
    dest = cfg_path.parent / f"{name}.yaml"
    write_config(cfg_path, dest, choices, stages, order, header=[f"{name}: {final_shares(choices)}"])
    if from_start:   # the final formats from step 0, no rollout: the plan's own cost
        raw = yaml.safe_load(dest.read_text())
        for rule in raw["precision"]["rules"]:
            rule["format"] = rule["ladder"][0]
        raw.pop("rollout", None)
        dest.write_text(yaml.safe_dump(raw, sort_keys=False))
    check_written(dest)
    return dest


def gap(losses: list[float], base: list[float]) -> float:
    n = min(len(losses), len(base))
    a = sum(losses[n - GAP_STEPS:n]) / GAP_STEPS
    b = sum(base[n - GAP_STEPS:n]) / GAP_STEPS
    return (a - b) / b


def controller_actions(run_dir: Path) -> tuple[int, int]:
    """(sites fallen back on their own signals, rollbacks by the loss-gap gate) in a run's events.jsonl."""
    log = run_dir / "events.jsonl"
    events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []
    fallbacks = sum(len(e.get("sites", ())) for e in events if e.get("kind") == "fallback")
    trips = sum(1 for e in events if e.get("kind") == "rollback" and "loss_gap" in str(e.get("reason", "")))
    return fallbacks, trips


def one_seed(seed: int, work: Path, jobs: int, steps: int | None, push_format: str,
             push_shares: list[float], profile_steps: int = 60) -> list[dict]:
    threads = 1 if jobs > 1 else 2
    cfg = seed_config(work, seed, steps)
    d = cfg.parent
    bf16 = train(cfg, d / "bf16", threads, "--as-baseline")
    suffix = "" if profile_steps == 60 else f"_s{profile_steps}"   # another profile: only its fixed plans
    prof_dir = d / f"profile{suffix}"
    if not (prof_dir / "profile.json").is_file():
        run_lowprec(["profile", str(cfg), "--steps", str(profile_steps), "--batches", "4", "--formats",
              f"fp8_tensorwise,nvfp4,{push_format}", "--write", str(d / f"profiled_any{suffix}.yaml"),
              "--out", str(prof_dir), "--no-tracking"], d / f"profile{suffix}.log", threads)
    profile = Profile.from_dict(json.loads((prof_dir / "profile.json").read_text()))
    rand = _random_profile(profile, seed)
    plans = {"default": (cfg, ())}
    if not suffix:
        plans["profiled_same"] = (write_plan("profiled_same", cfg, profile, {"nvfp4": 1 / 3},
                                             ["fp8_tensorwise", "nvfp4"]), ())
    for share in push_shares:
        tag = f"pushed{round(share * 100)}"
        caps, fmts = {push_format: share}, ["fp8_tensorwise", push_format]
        if suffix:
            plans[f"{tag}_profiled{suffix}_fixed"] = (
                write_plan(f"{tag}_profiled{suffix}_fixed", cfg, profile, caps, fmts, from_start=True),
                ("--no-controller",))
            plans[f"{tag}_random_fixed"] = (write_plan(f"{tag}_random_fixed", cfg, rand, caps, fmts,
                                                       from_start=True), ("--no-controller",))
            continue
        plans[f"{tag}_profiled"] = (write_plan(f"{tag}_profiled", cfg, profile, caps, fmts), ())
        plans[f"{tag}_random"] = (write_plan(f"{tag}_random", cfg, rand, caps, fmts), ())
        plans[f"{tag}_profiled_fixed"] = (write_plan(f"{tag}_profiled_fixed", cfg, profile, caps, fmts,
                                                     from_start=True), ("--no-controller",))
        plans[f"{tag}_random_fixed"] = (write_plan(f"{tag}_random_fixed", cfg, rand, caps, fmts, from_start=True),
                                        ("--no-controller",))
    with ThreadPoolExecutor(jobs) as pool:
        futs = {k: pool.submit(train, path, d / k, threads, *extra) for k, (path, extra) in plans.items()}
        results = {k: f.result() for k, f in futs.items()}
    rows = []
    loss_gap = yaml.safe_load(DEFAULT.read_text())["rollout"]["thresholds"]["loss_gap"]
    for k, r in results.items():
        s = r["summary"]
        g = gap(r["losses"], bf16["losses"])
        fallbacks, trips = controller_actions(d / k)
        fm = s.get("formats") or {}
        fm = fm if isinstance(fm, dict) else {}
        rows.append({"seed": seed, "plan": k, "gap": g, "fallbacks": fallbacks, "gate_trips": trips,
                     "rewinds": s.get("rewinds", 0), "events": s.get("events", 0), "final_formats": fm,
                     "held": g <= loss_gap and trips == 0})
    return rows


def flops_by_format(formats: dict[str, str], state) -> dict[str, float]:
    """Share of the sites' GEMM FLOPs per final format: `state` (a prepared reference GPT) in `formats`."""
    for f, s in state.sites.items():
        s.module.set_format(get_format(formats.get(f, "bf16")))
    return state.flops_share()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--work", default="runs/profile_compare")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="override train.steps (a quick look)")
    ap.add_argument("--push-format", default="fp4_tensorwise")
    ap.add_argument("--profile-steps", type=int, default=60,
                    help="BF16 steps before the profile; other than 60: only the pushed plans from step 0 are run")
    ap.add_argument("--push-share", type=float, nargs="+", default=[1 / 3])
    args = ap.parse_args()
    work = Path(args.work).resolve()
    rows = []
    for seed in args.seeds:
        rows += one_seed(seed, work, args.jobs, args.steps, args.push_format, args.push_share, args.profile_steps)
    (work / "results.json").write_text(json.dumps(rows, indent=1))
    cfg0 = LowprecConfig.from_yaml(work / f"seed{args.seeds[0]}" / "default.yaml")
    state = prepare_run(replace(cfg0, rollout=None, eval=None), controller=False, with_data=False).state
    print("| seed | plan | loss gap to BF16 | final FLOPs | sites fallen back | loss-gap gate trips | rewinds | "
          "gate held |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        fl = flops_by_format(r["final_formats"], state) if r["final_formats"] else {}
        fl = ", ".join(f"{k} {v:.0%}" for k, v in sorted(fl.items(), key=lambda kv: -kv[1]))
        print(f"| {r['seed']} | {r['plan']} | {r['gap']:+.2%} | {fl} | {r['fallbacks']} | {r['gate_trips']} | {r['rewinds']} | "
              f"{'yes' if r['held'] else 'no'} |")
    print("\n| plan | mean gap | worst gap | seeds where the gate held |")
    print("|---|---|---|---|")
    for plan in dict.fromkeys(r["plan"] for r in rows):
        rs = [r for r in rows if r["plan"] == plan]
        print(f"| {plan} | {sum(r['gap'] for r in rs) / len(rs):+.2%} | {max(r['gap'] for r in rs):+.2%} | "
              f"{sum(r['held'] for r in rs)}/{len(rs)} |")


if __name__ == "__main__":
    main()
