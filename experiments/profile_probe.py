"""Would a short training probe rank plain-FP4 sites better than the one-step profile? (issue 18)

    python -m experiments.profile_probe --seeds 0 1 2 --push-share 0.15 0.25 [--steps 30]

The one-step sensitivity of `lowprec profile` did not choose plain-FP4 sites better than
chance (docs/profile.md). This experiment tries the first remedy listed there, outside the
package: per seed, from the same 60-step BF16 warm-up `lowprec profile` uses, train `--steps`
more steps with a fresh AdamW once in all-BF16 and once per site with only that site in plain
FP4 (the same batches), then measure the held batches' loss in BF16. A site's probe score
is its held-loss change against the BF16 continuation. From the scores, plans with the same
planner and caps as experiments/profile_compare.py (`probeNN`), run the same way (controller
on, and `_fixed` from step 0 with no controller). Needs profile_compare's runs of the same
seeds in `--work` (the BF16 baselines; its random and profiled plans are the comparison).
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from experiments.profile_compare import GAP_STEPS, controller_actions, gap, train, write_plan
from lowprec.config import LowprecConfig
from lowprec.profile.measure import Profile, SiteCost
from lowprec.runtime.engine import loss_of
from lowprec.runtime.run import prepare_run

FP4 = "fp4_tensorwise"


def probe_scores(cfg_path: Path, steps: int, warmup: int = 60, batches: int = 4) -> dict[str, float]:
    """{site: relative held-loss change after `steps` steps with only that site in plain FP4}."""
    from lowprec.profile.cli import _warm_up
    cfg = LowprecConfig.from_yaml(cfg_path)
    torch.set_num_threads(1)
    prepared = prepare_run(replace(cfg, rollout=None, eval=None), controller=False)
    model, state = prepared.model, prepared.state
    _warm_up(cfg, prepared, warmup)
    held = [prepared.data.next() for _ in range(batches)]
    stream = [prepared.data.next() for _ in range(steps)]
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state.set_format(list(state.sites), "bf16")

    def run(site: str | None) -> float:
        model.load_state_dict(start)
        if site is not None:
            state.set_format(site, FP4)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.train.lr,
                                weight_decay=cfg.train.weight_decay, betas=(0.9, 0.95))
        torch.manual_seed(cfg.train.seed)
        for x, y in stream:
            opt.zero_grad(set_to_none=True)
            loss_of(model(x, y)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip or float("inf"))
            opt.step()
        if site is not None:
            state.set_format(site, "bf16")
        with torch.no_grad():
            return sum(float(loss_of(model(x, y))) for x, y in held) / len(held)

    ref = run(None)
    return {f: (run(f) - ref) / ref for f in state.sites}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--work", default="runs/profile_compare")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--push-share", type=float, nargs="+", default=[0.15, 0.25])
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    work = Path(args.work).resolve()
    rows = []
    for seed in args.seeds:
        d = work / f"seed{seed}"
        cfg = d / "default.yaml"
        scores_file = d / f"probe{args.steps}.json"
        if not scores_file.is_file():
            scores_file.write_text(json.dumps(probe_scores(cfg, args.steps), indent=1))
        scores = json.loads(scores_file.read_text())
        profile = Profile.from_dict(json.loads((d / "profile" / "profile.json").read_text()))
        low = min(scores.values())
        entries = [e for e in profile.entries if e.format != FP4] + [
            SiteCost(e.fqn, FP4, e.flop_share, loss_delta=scores[e.fqn] - low + 1e-9, grad_cosine=1.0)
            for e in profile.entries if e.format == FP4]
        probe = Profile(entries, profile.reference_loss, profile.batches, profile.tokens_per_batch,
                        profile.passes_per_rank, profile.world, profile.seconds)
        plans = {}
        for share in args.push_share:
            tag = f"probe{round(share * 100)}"
            caps, fmts = {FP4: share}, ["fp8_tensorwise", FP4]
            plans[tag] = (write_plan(tag, cfg, probe, caps, fmts), ())
            plans[f"{tag}_fixed"] = (write_plan(f"{tag}_fixed", cfg, probe, caps, fmts, from_start=True),
                                     ("--no-controller",))
        with ThreadPoolExecutor(args.jobs) as pool:
            futs = {k: pool.submit(train, path, d / k, 1, *extra) for k, (path, extra) in plans.items()}
            results = {k: f.result() for k, f in futs.items()}
        bf16 = train(cfg, d / "bf16", 1, "--as-baseline")
        for k, r in results.items():
            _, trips = controller_actions(d / k)
            fp4 = sorted(f for f, fm in r["summary"].get("formats", {}).items() if fm == FP4)
            rows.append({"seed": seed, "plan": k, "gap": gap(r["losses"], bf16["losses"]), "trips": trips,
                         "fp4_sites_at_end": fp4})
        ranked = sorted(scores, key=lambda f: scores[f])
        print(f"seed {seed}: probe scores, least harmful first: " +
              ", ".join(f"{f} {scores[f]:+.2%}" for f in ranked))
    (work / f"probe{args.steps}_results.json").write_text(json.dumps(rows, indent=1))
    print(f"\n| seed | plan | loss gap to BF16 (last {GAP_STEPS} steps) | loss-gap gate trips | held |")
    print("|---|---|---|---|---|")
    for r in rows:
        held = r["gap"] <= 0.03 and r["trips"] == 0
        print(f"| {r['seed']} | {r['plan']} | {r['gap']:+.2%} | {r['trips']} | {'yes' if held else 'no'} |")


if __name__ == "__main__":
    main()
