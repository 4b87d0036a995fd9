"""Benchmark: one training step of a transformer MLP block on CPU, as ratios to FP32.

The block is `x + Linear(4d, d)(GELU(Linear(d, 4d)(LayerNorm(x))))` and one step is
forward, an MSE loss, backward and an AdamW step. Rows (all in one run, same data,
same initial weights):

- plain FP32 (the reference of the ratio column);
- lowprec `emulated` for every low-precision format, quantizer statistics on (the
  default) and off, eager and, for tensor-wise/delayed scaling, fused (torch.compile);
- lowprec `torch` backend (torch._scaled_mm on CPU) for fp8_tensorwise / fp8_rowwise;
- torchao's `Float8Linear` with `Float8LinearConfig(emulate=True)` (tensorwise recipe),
  the peer, when torchao is installed.

The variants run round-robin (one step of each per round), each step right after a plain
FP32 step; a row's ratio is the median over --repeats rounds (after --warmup rounds) of
its step time over that FP32 step's, so that a change in the load of a shared machine
hits both sides of a ratio alike. Run (see docs/performance.md):

    python experiments/bench_mlp_step.py                 # d=1024, 256 tokens
    python experiments/bench_mlp_step.py --only 'fp32|tensorwise|torchao' --repeats 5
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import re
import statistics
import subprocess
import time

import torch
from torch import nn

from lowprec.sites.backends import get_backend
from lowprec.numerics.formats import FORMATS, Scaling
from lowprec.sites.layers import PrecisionLinear

EMULATED_FORMATS = ("fp8_tensorwise", "fp8_delayed", "fp8_rowwise", "fp8_blockwise",
                    "mxfp8", "mxfp4", "nvfp4", "fp4_tensorwise")


class MLPBlock(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


def machine_info() -> str:
    model = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        import torchao
        ao = f"torchao {torchao.__version__}"
    except ImportError:
        ao = "torchao not installed"
    return (f"{model}, {os.cpu_count()} logical CPUs, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}, {ao}, python {platform.python_version()}")


def build_variants(base: nn.Module, names_filter: str | None):
    """[(label, model)] with every model a deep copy of `base` (same initial weights)."""
    variants: list[tuple[str, object]] = []

    def lowprec(backend: str, fmt: str, fused: bool, stats: bool):
        def make():
            m = copy.deepcopy(base)
            for name in ("fc1", "fc2"):
                layer = PrecisionLinear.from_module(getattr(m, name), FORMATS[fmt],
                                                    get_backend(backend), fused=fused, fqn=name)
                layer.collect_stats = stats
                setattr(m, name, layer)
            return m
        label = f"lowprec {backend} {fmt}{' fused' if fused else ''}{' +stats' if stats else ' no stats'}"
        variants.append((label, make))

    variants.append(("plain FP32", lambda: copy.deepcopy(base)))
    for fmt in EMULATED_FORMATS:
        fusable = FORMATS[fmt].input.scaling in (Scaling.TENSOR, Scaling.DELAYED)
        for fused in (False, True) if fusable else (False,):
            for stats in (True, False):
                lowprec("emulated", fmt, fused, stats)
    for fmt in ("fp8_tensorwise", "fp8_rowwise"):
        for stats in (True, False):
            lowprec("torch", fmt, False, stats)
    lowprec("torch", "fp8_tensorwise", True, False)

    def torchao_emulated():
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        return convert_to_float8_training(copy.deepcopy(base),
                                          config=Float8LinearConfig(emulate=True))
    variants.append(("torchao Float8Linear emulate=True (tensorwise)", torchao_emulated))
    if names_filter:
        keep = re.compile(names_filter)
        variants = [v for v in variants if v[0] == "plain FP32" or keep.search(v[0])]
    return variants


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=9, help="timed rounds (median)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first (compiles fused ones)")
    p.add_argument("--only", default=None, help="regex on the row label (plain FP32 is always kept)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    d, hidden = args.d_model, 4 * args.d_model
    torch.manual_seed(0)
    base = MLPBlock(d, hidden)
    x = torch.randn(args.tokens, d)
    target = torch.randn(args.tokens, d)

    runs = []  # [label, step fn, times]
    for label, make in build_variants(base, args.only):
        try:
            model = make()
        except Exception as e:  # e.g. torchao missing: report, measure the others
            runs.append([f"{label}: FAILED {type(e).__name__}: {str(e)[:100]}", None, []])
            continue
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, opt=opt):
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), target)
            loss.backward()
            opt.step()
            return loss
        runs.append([label, step, []])

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    # Every variant's step is paired with a plain FP32 step just before it; its ratio is
    # the median over rounds of (its step / that FP32 step), which cancels the slow swings
    # of a shared machine's load better than dividing two medians taken apart.
    load0 = " ".join(f"{v:.2f}" for v in os.getloadavg())
    ref = runs[0]
    ref_times: list[float] = []
    ratios: dict[int, list[float]] = {i: [] for i in range(len(runs))}
    for r in range(args.warmup + args.repeats):
        for i, run in enumerate(runs):
            if run[1] is None:
                continue
            t_ref = timed(ref[1])
            try:
                t = timed(run[1]) if i else t_ref
            except Exception as e:
                run[0] = f"{run[0]}: FAILED {type(e).__name__}: {str(e)[:100]}"
                run[1] = None
                continue
            if r >= args.warmup:
                ref_times.append(t_ref)
                run[2].append(t)
                ratios[i].append(t / t_ref)

    print(f"# MLP block training step (LayerNorm -> Linear({d}, {hidden}) -> GELU -> "
          f"Linear({hidden}, {d}) + residual, forward + backward + AdamW), {args.tokens} tokens, FP32 "
          f"master weights; {args.repeats} rounds after {args.warmup} warm-up rounds")
    print(f"# {machine_info()}; load average before/after: {load0} / "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print("# ms: median step time; x FP32: median over rounds of (step / the FP32 step run just "
          "before it), with its quartiles")
    width = max(len(run[0]) for run in runs)
    print(f"| {'variant':<{width}} | {'ms':>8} | {'x FP32':>6} | {'quartiles':>11} |")
    print(f"|{'-' * (width + 2)}|{'-' * 9}:|{'-' * 7}:|{'-' * 12}:|")
    for i, (label, _, times) in enumerate(runs):
        if not times:
            print(f"| {label:<{width}} | {'-':>8} | {'-':>6} | {'-':>11} |")
            continue
        ms = statistics.median(ref_times if i == 0 else times)
        q = statistics.quantiles(ratios[i], n=4) if len(ratios[i]) > 1 else [ratios[i][0]] * 3
        print(f"| {label:<{width}} | {ms:8.1f} | {q[1]:6.2f} | {q[0]:5.2f}-{q[2]:<5.2f} |")

if __name__ == "__main__":
    main()
