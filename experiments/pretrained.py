"""A real pretrained model under precision plans: SmolLM2-135M evaluated and briefly fine-tuned.

    python -m experiments.pretrained info
    python -m experiments.pretrained eval [--plan fp8 --plan nvfp4] [--limit 10] [--tasks hellaswag ...]
    python -m experiments.pretrained finetune [--steps 32] [--baseline] [--config experiments/configs/smollm2_rollout.yaml]
    python -m experiments.pretrained step-time

`eval` scores multiple-choice tasks (HellaSwag and BIG-bench, from the data folder `experiments.data.SHARED`, through
lowprec.evals) with the same weights under each plan and prints acc and acc_norm with their
standard errors and, per task, the paired difference to BF16 (same items, candidate minus
baseline, with its standard error and a paired-bootstrap 95% interval from `lowprec.gates.stats`).
Plans: `bf16` (the sites of smollm2_fp8.yaml with BF16-rounded GEMM operands: the baseline,
always run), `fp8` and `nvfp4` (experiments/configs/smollm2_{fp8,nvfp4}.yaml), or a path
to any YAML with a `precision:` section. The baseline is itself a dequantized Q4_1 model
(see experiments/smollm2.py): the deltas measure FP8/NVFP4 against that model.

`finetune` trains on the Shakespeare training text (tokenized with SmolLM2's tokenizer)
with the config's plan and its rollout controller on, printing the loss, the controller's
events, the share of GEMM FLOPs per format, held-out loss before and after, and seconds
per step; `--baseline` first runs the same steps in BF16 without the controller and gives
the rollout that loss curve (the controller's loss-gap check). Its loop is a user's loop
with lowprec.runtime.Session; there are no checkpoints (a
rewind decision skips the step instead). `step-time` times one training step with every
plan site in BF16, FP8 and NVFP4.

All arithmetic is FP32 on CPU (BF16 matmuls are about 5x slower here); the emulated backend
rounds each GEMM's operands to the format's grid. `--threads 1` is the default: on this
shared 2-core machine two torch threads were up to 13x slower than one under load.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from experiments import smollm2

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"   # the multiple-choice sets (opt-in eval data), handed over as data_dir
CONFIGS = ROOT / "experiments" / "configs"
PLANS = {"fp8": CONFIGS / "smollm2_fp8.yaml", "nvfp4": CONFIGS / "smollm2_nvfp4.yaml"}
BASELINE = "bf16"
# the cheaper half of the multiple_choice suite (tokens per item with SmolLM2's tokenizer:
# hellaswag 165, strategyqa 39, winowhy 126, social_iqa 163, physical_intuition 213,
# goal_inference 274); `--tasks all` adds step_inference 343, timedial 762, understanding_fables 1071
DEFAULT_TASKS = ("hellaswag", "bigbench_strategyqa", "bigbench_winowhy", "bigbench_social_iqa",
                 "bigbench_physical_intuition", "bigbench_goal_step_wikihow_goal_inference")
METRICS = ("acc", "acc_norm")


@dataclass(frozen=True)
class EvalSettings:
    plans: tuple[str, ...] = ("fp8", "nvfp4")   # candidates; BF16 is always run as the baseline
    tasks: tuple[str, ...] = DEFAULT_TASKS
    limit: int = 10                             # items per task (the first N of each task's fixed order)
    max_length: int = 512                       # tokens; the longest item of these tasks is 448
    batch_size: int = 8
    confidence: float = 0.95

    def __post_init__(self) -> None:
        if self.limit < 1 or self.max_length < 8 or self.batch_size < 1:
            raise ValueError(f"limit ({self.limit}), batch_size ({self.batch_size}) must be >= 1 and "
                             f"max_length ({self.max_length}) >= 8")


@dataclass
class PlanRun:
    name: str
    results: dict[str, dict[str, float]]
    samples: dict[str, dict[str, dict[str, float]]]
    n: dict[str, int]
    seconds: float
    tokens: int = 0


@dataclass
class Paired:
    """candidate - baseline over the same items: mean, its standard error, a bootstrap interval."""
    n: int
    delta: float
    se: float
    interval: tuple[float, float]
    flips: int           # items whose score changed


def plan_path(name: str) -> Path:
    """The YAML of a plan name (fp8, nvfp4) or a path; BF16 uses the FP8 plan's sites."""
    if name == BASELINE:
        return PLANS["fp8"]
    if name in PLANS:
        return PLANS[name]
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    raise ValueError(f"unknown plan {name!r}: use {BASELINE}, {', '.join(PLANS)} or the path of a YAML file with "
                     f"a precision: section (e.g. {PLANS['fp8'].relative_to(ROOT)})")


def prepared_copy(base: torch.nn.Module, name: str, seed: int = 0):
    """A copy of `base` prepared with plan `name` (bf16: the FP8 plan's sites switched to BF16)."""
    from lowprec import prepare
    from lowprec.sites.plan import PrecisionPlan

    model = copy.deepcopy(base)
    state = prepare(model, PrecisionPlan.from_yaml(plan_path(name)), seed=seed)
    if name == BASELINE:
        state.set_format(list(state.sites), "bf16")
    return model, state


def paired(base: dict[str, float], cand: dict[str, float], confidence: float) -> Paired:
    from lowprec.gates.stats import paired_bootstrap_interval, paired_differences

    d, _ = paired_differences(base, cand, 1.0)
    n = int(d.size)
    se = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan
    lo, hi = paired_bootstrap_interval(d, confidence) if n else (math.nan, math.nan)
    return Paired(n, float(d.mean()) if n else math.nan, se, (lo, hi), int((d != 0).sum()))


def evaluate_plan(base: torch.nn.Module, tokenizer, name: str, settings: EvalSettings) -> PlanRun:
    """Run the tasks on a copy of `base` prepared with plan `name` (statistics collection off)."""
    from lowprec.evals import EvalSuite, HFTokenizer, run_suite

    model, state = prepared_copy(base, name)
    state.collect_stats(False)   # quantizer statistics are for the monitors; they cost 2-3x here
    tokens = [0]

    def forward(idx: torch.Tensor) -> torch.Tensor:
        tokens[0] += idx.numel()
        return model(input_ids=idx, use_cache=False).logits

    suite = EvalSuite("smollm2", tuple(settings.tasks))
    res = run_suite(suite, forward, HFTokenizer(tokenizer), settings.max_length, mode="full",
                    limit=settings.limit, batch_size=settings.batch_size, model=model, data_dir=SHARED)
    return PlanRun(name, res.results, res.samples, dict(res.n), res.seconds, tokens[0])


def _pooled(run: PlanRun, metric: str) -> dict[str, float]:
    return {f"{t}/{k}": v for t, per in run.samples.items() for k, v in per.get(metric, {}).items()}


def report(runs: list[PlanRun], settings: EvalSettings) -> str:
    """Markdown tables: per task and metric, BF16 acc +- se, each plan's acc and paired delta."""
    base, cands = runs[0], runs[1:]
    lines = []
    for metric in METRICS:
        head = f"| task | n | {BASELINE} {metric} ± se |" + "".join(
            f" {c.name} {metric} | {c.name} − {BASELINE} (paired ± se) [95% CI] |" for c in cands)
        lines += [f"**{metric}**", "", head, "|" + "---|" * (3 + 2 * len(cands))]
        for task in [*base.results, "all (pooled)"]:
            if task == "all (pooled)":
                b_scores = _pooled(base, metric)
                n, acc = len(b_scores), sum(b_scores.values()) / max(len(b_scores), 1)
                se = math.sqrt(acc * (1 - acc) / max(n - 1, 1))
            else:
                b_scores = base.samples[task][metric]
                n, acc, se = base.n[task], base.results[task][metric], base.results[task][f"{metric}_stderr"]
            row = f"| {task} | {n} | {acc:.3f} ± {se:.3f} |"
            for c in cands:
                c_scores = _pooled(c, metric) if task == "all (pooled)" else c.samples[task][metric]
                p = paired(b_scores, c_scores, settings.confidence)
                c_acc = sum(c_scores.values()) / max(len(c_scores), 1)
                row += (f" {c_acc:.3f} | {p.delta:+.3f} ± {p.se:.3f} [{p.interval[0]:+.3f}, {p.interval[1]:+.3f}]"
                        f" {p.flips} changed |")
            lines.append(row)
        lines.append("")
    lines.append("| plan | seconds | tokens scored | ms per token |")
    lines.append("|---|---|---|---|")
    lines += [f"| {r.name} | {r.seconds:.0f} | {r.tokens} | {1e3 * r.seconds / max(r.tokens, 1):.1f} |" for r in runs]
    return "\n".join(lines)


def run_eval(settings: EvalSettings, json_out: Path | None = None, *, base: torch.nn.Module | None = None,
             tokenizer=None) -> list[PlanRun]:
    """BF16 and then each plan of `settings` on copies of `base` (loaded here when not given)."""
    smollm2.require()
    from lowprec.evals import EvalSuite

    for name in settings.plans:
        plan_path(name)            # an unknown plan or task fails before the model loads
    EvalSuite("smollm2", tuple(settings.tasks))
    if base is None or tokenizer is None:
        t0 = time.perf_counter()
        base, tokenizer = smollm2.load_model(), smollm2.load_tokenizer()
        print(f"loaded SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to FP32) in {time.perf_counter() - t0:.0f} s",
              flush=True)
    runs = []
    for name in (BASELINE, *[p for p in settings.plans if p != BASELINE]):
        print(f"evaluating {name}: {len(settings.tasks)} tasks x {settings.limit} items ...", flush=True)
        runs.append(evaluate_plan(base, tokenizer, name, settings))
        print(f"  {runs[-1].seconds:.0f} s", flush=True)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps({"settings": settings.__dict__, "runs": [r.__dict__ for r in runs]},
                                       indent=1, default=list))
    return runs


def _info() -> None:
    smollm2.require()
    q = smollm2.quantization_summary()
    print(f"file: {smollm2.gguf_path()}")
    print(f"model: {q['name']} ({q['architecture']}, finetune {q['finetune']})")
    print(f"GGUF file type: {q['file_type']}; tensors by storage type: "
          + ", ".join(f"{k} {v}" for k, v in sorted(q["tensor_types"].items())))
    print("examples: " + ", ".join(f"{k} {v}" for k, v in q["examples"].items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.pretrained", description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: faster than 2 on a shared 2-core machine)")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="which model and quantization the installed GGUF file holds")
    pe = sub.add_parser("eval", help="multiple-choice accuracy under BF16 and each plan, with paired deltas")
    pe.add_argument("--plan", action="append", default=None,
                    help=f"a candidate plan: {', '.join(PLANS)} or a YAML path; repeat for several "
                         f"(default: fp8 and nvfp4). {BASELINE} always runs as the baseline")
    pe.add_argument("--limit", type=int, default=EvalSettings.limit, help="items per task")
    pe.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS),
                    help="eval_suites task names, or `all` for the whole multiple_choice suite")
    pe.add_argument("--max-length", type=int, default=EvalSettings.max_length)
    pe.add_argument("--batch-size", type=int, default=EvalSettings.batch_size)
    pe.add_argument("--json", type=Path, default=None, help="also write every score to this JSON file")
    pf = sub.add_parser("finetune", help="a short fine-tune on Shakespeare with the rollout controller")
    pf.add_argument("--config", default=str(CONFIGS / "smollm2_rollout.yaml"))
    pf.add_argument("--steps", type=int, default=None, help="default: the config's train.steps")
    pf.add_argument("--out", default="runs/pretrained_finetune")
    pf.add_argument("--no-controller", action="store_true", help="keep the plan's starting formats throughout")
    pf.add_argument("--baseline", action="store_true",
                    help="first run the same steps without the controller (BF16) and watch the loss gap to it")
    ps = sub.add_parser("step-time", help="seconds per training step with every plan site in BF16, FP8, NVFP4")
    ps.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    try:
        if args.command == "info":
            _info()
        elif args.command == "eval":
            tasks = args.tasks
            if tasks == ["all"]:
                from lowprec.evals import get_suite
                tasks = list(get_suite("multiple_choice").tasks)
            settings = EvalSettings(plans=tuple(args.plan or ("fp8", "nvfp4")), tasks=tuple(tasks),
                                    limit=args.limit, max_length=args.max_length, batch_size=args.batch_size)
            runs = run_eval(settings, args.json)
            print()
            print(report(runs, settings))
        elif args.command == "step-time":
            from experiments.pretrained_finetune import step_times
            step_times(reps=args.reps)
        else:
            from experiments.pretrained_finetune import main_finetune
            if args.baseline and args.no_controller:
                p.error("--baseline runs a second fine-tune with the controller; it cannot go with --no-controller")
            main_finetune(args.config, args.out, args.steps, controller=not args.no_controller,
                          with_baseline=args.baseline)
    except (smollm2.PretrainedUnavailable, ValueError, KeyError) as e:   # a missing extra, plan or task
        print(f"experiments.pretrained: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
