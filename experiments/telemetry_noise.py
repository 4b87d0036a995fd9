"""How much do a run's cost numbers (`telemetry/*`) move between reruns of one config?

    OMP_NUM_THREADS=1 python -m experiments.telemetry_noise                 # 5 runs, in a temp folder
    OMP_NUM_THREADS=1 python -m experiments.telemetry_noise -n 8 --folder runs/telemetry_noise

Runs `lowprec run CONFIG` (default experiments/configs/telemetry_noise.yaml) N times, one
after another, as subprocesses from the repository root, each into its own `--out` under the
folder, tracking to `sqlite:///<folder>/mlflow.db` (a copy of the config with `tracking.uri`
set is written into the folder; the store's tables are created before the first run, which
would otherwise count their creation in its start-up). Reads each run's `telemetry.json` and prints, as Markdown:

- per run: tokens/s, step tokens/s, goodput, energy per token (J), the run's wall time
  (`telemetry/wall_s`, start-up included) and the subprocess's wall time;
- per number: mean, min, max, relative spread (max/min - 1), coefficient of variation;
- per gated number, over every ordered pair (baseline, candidate) of runs: the largest
  relative regression, and the largest upper end of the interval `lowprec gate` forms with
  `statistic: stderr` (delta + z * sqrt(se_b^2 + se_c^2), relative to the baseline value);
  a rerun passes a gate only when that upper end is at most the tolerance, so the suggested
  tolerance is that largest upper end times --margin, rounded up to the next percent.

The numbers are only as good as the machine is quiet: another job sharing the CPU shows up
as spread (say so when you record them; docs/gates.md, "Gates on cost (telemetry)").
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "experiments" / "configs" / "telemetry_noise.yaml"

# (metric, short name, direction: +1 higher is better, -1 lower is better)
NUMBERS = [("telemetry/tokens_per_s", "tokens/s", +1),
           ("telemetry/step_tokens_per_s", "step tokens/s", +1),
           ("telemetry/goodput", "goodput", +1),
           ("telemetry/energy_per_token_j", "energy/token (J)", -1)]


def run_once(config: dict, folder: Path, i: int) -> dict:
    cfg = json.loads(json.dumps(config))
    cfg.setdefault("tracking", {})["uri"] = f"sqlite:///{folder.resolve() / 'mlflow.db'}"
    cfg["tracking"]["run_name"] = f"{cfg['tracking'].get('run_name') or 'telemetry-noise'}-{i}"
    path = folder / f"config_{i}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    out = folder / f"run{i}"
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "lowprec.cli", "run", str(path), "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"run {i} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    metrics = json.loads((out / "telemetry.json").read_text())["metrics"]
    return {"metrics": metrics, "wall": wall, "run_id": (out / "run_id").read_text().strip()
            if (out / "run_id").is_file() else ""}


def _fmt(x: float) -> str:
    return f"{x:.4g}" if x is not None and math.isfinite(x) else "-"


def summarize(runs: list[dict], z: float, margin: float) -> str:
    lines = []
    head = [name for _, name, _ in NUMBERS] + ["run wall (s)", "process wall (s)"]
    lines.append("| run | " + " | ".join(head) + " |")
    lines.append("|---|" + "---|" * len(head))
    cols: dict[str, list[float]] = {h: [] for h in head}
    for i, r in enumerate(runs):
        m = r["metrics"]
        row = [m.get(k) for k, _, _ in NUMBERS] + [m.get("telemetry/wall_s"), r["wall"]]
        for h, v in zip(head, row):
            if v is not None:
                cols[h].append(v)
        lines.append(f"| {i} | " + " | ".join(_fmt(v) for v in row) + " |")
    lines.append("")
    lines.append("| number | mean | min | max | spread (max/min - 1) | CV | rel. stderr in run (mean) |")
    lines.append("|---|---|---|---|---|---|---|")
    keys = {name: k for k, name, _ in NUMBERS}
    for h in head:
        v = cols[h]
        if not v:
            lines.append(f"| {h} | - | - | - | - | - | - |")
            continue
        mean = statistics.fmean(v)
        cv = statistics.stdev(v) / mean if len(v) > 1 and mean else float("nan")
        se = ""
        if h in keys:
            rel = [r["metrics"][keys[h] + "_stderr"] / r["metrics"][keys[h]] for r in runs
                   if r["metrics"].get(keys[h] + "_stderr") is not None and r["metrics"].get(keys[h])]
            se = f"{statistics.fmean(rel):.2%}" if rel else "-"
        lines.append(f"| {h} | {_fmt(mean)} | {_fmt(min(v))} | {_fmt(max(v))} | "
                     f"{max(v) / min(v) - 1:.2%} | {cv:.2%} | {se or ''} |")
    lines.append("")
    lines.append(f"| gated number | largest pairwise regression | largest interval upper end (z={z:.3g}) | "
                 f"suggested tolerance (x{margin:g}, next percent) |")
    lines.append("|---|---|---|---|")
    for k, name, sign in NUMBERS:
        worst, upper = 0.0, 0.0
        have = [r["metrics"] for r in runs if k in r["metrics"]]
        for b, c in itertools.permutations(have, 2):
            delta = -sign * (c[k] - b[k]) / abs(b[k])   # + = worse, relative to the baseline
            worst = max(worst, delta)
            se_b, se_c = b.get(k + "_stderr"), c.get(k + "_stderr")
            if se_b is not None and se_c is not None:
                upper = max(upper, delta + z * math.sqrt(se_b ** 2 + se_c ** 2) / abs(b[k]))
        if len(have) < 2:
            lines.append(f"| {k} | - | - | - |")
            continue
        suggest = math.ceil(upper * margin * 100 - 1e-9) / 100
        lines.append(f"| {k} | {worst:.2%} | {upper:.2%} | {suggest:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="the config to rerun (default: %(default)s)")
    p.add_argument("-n", type=int, default=5, help="how many runs (default 5)")
    p.add_argument("--folder", default=None, help="where the runs and their store go (default: a temp folder)")
    p.add_argument("--confidence", type=float, default=0.95, help="the gates' confidence (default 0.95)")
    p.add_argument("--margin", type=float, default=1.25, help="suggested tolerance = margin x the largest "
                   "interval upper end (default 1.25)")
    args = p.parse_args(argv)
    if args.n < 2:
        p.error("-n must be at least 2")
    folder = Path(args.folder) if args.folder else Path(tempfile.mkdtemp(prefix="telemetry-noise-"))
    folder.mkdir(parents=True, exist_ok=True)
    config = yaml.safe_load(Path(args.config).read_text())
    z = statistics.NormalDist().inv_cdf((1 + args.confidence) / 2)
    # the store's tables first: the run that creates them (~1.5 s) would count that in its start-up
    from mlflow.tracking import MlflowClient
    MlflowClient(f"sqlite:///{folder.resolve() / 'mlflow.db'}").search_experiments()
    print(f"{args.n} runs of {args.config} into {folder}", file=sys.stderr)
    runs = []
    for i in range(args.n):
        runs.append(run_once(config, folder, i))
        m = runs[-1]["metrics"]
        print(f"  run {i}: {m.get('telemetry/tokens_per_s', float('nan')):.0f} tokens/s, "
              f"{runs[-1]['wall']:.1f} s", file=sys.stderr)
    (folder / "telemetry_noise.json").write_text(json.dumps(runs, indent=1))
    print(summarize(runs, z, args.margin))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
