"""Profile (issue 29, step 2): the kernels of one FP8 layer step, beside the traffic model.

One `Linear(d, d)` forward+backward on `tokens` tokens (BF16 input, weight and gradient, as
in bench_linear.py), for plain BF16 `nn.Linear` and lowprec's `torch` backend (fp8_tensorwise
by default; a non-check step, statistics off, and a check step), profiled with
`torch.profiler` over `--steps` steps after warm-up. For each variant it prints every GPU
kernel (name, launches per step, microseconds per step, share of the step) and the step's
device time, and beside it the floor the model of docs/performance.md gives:

* the GEMMs: 3 x 2 d^2 tokens FLOP at the rate the same run measured for three bare
  `torch._scaled_mm` e4m3 GEMMs (so the GEMM floor is this card's, not a datasheet's);
* everything else: the bytes `lowprec.numerics.fp8_ops.kernel_traffic` and the bias/scalar
  ops move (20E tensor-wise, E = tokens x d bytes) at the bandwidth of a device-to-device
  copy measured in the same run.

    python experiments/profile_linear.py                      # d 8192, 8192 tokens, CUDA
    python experiments/profile_linear.py --device cpu --d-model 256 --tokens 256 --steps 2

`--json PATH` writes the kernel lists and floors. On the CPU the kernels are CPU operators
(a smoke run of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys

import torch
from torch import nn
from torch.autograd.graph import increment_version
from torch.profiler import ProfilerActivity, profile

from lowprec.numerics.formats import get_format
from lowprec.sites.backends import get_backend
from lowprec.sites.layers import PrecisionLinear

# bytes outside the GEMMs of one non-check step, in units of E (docs/performance.md's table)
MODEL_E = {"fp8_tensorwise": 20.0, "fp8_delayed": 14.2, "fp8_rowwise": 20.3}


def _device_us(evt) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(evt, name):
            return float(getattr(evt, name))
    return 0.0


def kernel_table(prof, steps: int, cuda: bool) -> list[dict]:
    """Per kernel (CUDA) or operator (CPU): launches and microseconds per step, largest first."""
    rows = []
    for evt in prof.key_averages():
        if cuda:
            if str(getattr(evt, "device_type", "")).split(".")[-1] != "CUDA":
                continue
            us = _device_us(evt)
        else:
            if evt.key.startswith("ProfilerStep"):
                continue
            us = float(evt.self_cpu_time_total)
        if us <= 0:
            continue
        rows.append({"kernel": evt.key, "launches": evt.count / steps, "us": us / steps})
    rows.sort(key=lambda r: -r["us"])
    return rows


def classify(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ("gemm", "sm90", "cutlass", "scaled_mm", "nvjet", "xmma", "matmul")):
        return "gemm"
    if "triton" in low or "cast" in low or "amax" in low or low.startswith("_ct"):
        return "cast"
    return "other"


def measure(layer, weight, x, g, steps: int, warmup: int, cuda: bool, stats: bool) -> list[dict]:
    def one():
        if weight is not None:
            increment_version(weight)
        if hasattr(layer, "collect_stats"):
            layer.collect_stats = stats
        layer(x).backward(g)
    for _ in range(warmup):
        one()
    if cuda:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            one()
        if cuda:
            torch.cuda.synchronize()
    return kernel_table(prof, steps, cuda)


def ceilings(d: int, tokens: int, dev: str, cuda: bool) -> dict:
    """Bandwidth of a device copy and the rate of three bare _scaled_mm GEMMs, this run."""
    from experiments.bench_linear import timed
    x = torch.randn(tokens, d, device=dev, dtype=torch.bfloat16)
    big = torch.empty(256 * 2**20 // 2, device=dev, dtype=torch.bfloat16)
    big2 = torch.empty_like(big)
    copy_ms = timed(lambda: big2.copy_(big), 20, 5, cuda)
    out = {"copy_GBps": 2 * big.numel() * 2 / (copy_ms * 1e-3) / 1e9}
    if cuda:
        a = x.to(torch.float8_e4m3fn)
        w = torch.randn(d, d, device=dev).to(torch.float8_e4m3fn)
        one = torch.ones((), device=dev)
        def gemms():
            for _ in range(3):
                torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        ms = timed(gemms, 20, 5, cuda)
        out["scaled_mm_3x_ms"] = ms
        out["fp8_TFLOPs"] = 6 * d * d * tokens / (ms * 1e-3) / 1e12
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--d-model", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--formats", nargs="+", default=["fp8_tensorwise"], choices=sorted(MODEL_E))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--top", type=int, default=15, help="kernels listed per variant")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA GPU here; use --device cpu with small shapes")
    dev, d, n = args.device, args.d_model, args.tokens
    torch.manual_seed(0)
    base = nn.Linear(d, d, bias=False, device=dev, dtype=torch.bfloat16)
    x = torch.randn(n, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(n, d, device=dev, dtype=torch.bfloat16)
    ceil = ceilings(d, n, dev, cuda)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"# command: {' '.join(shlex.quote(a) for a in [sys.executable, *sys.argv])}")
    print(f"# device: {name}; torch {torch.__version__}; d_model {d}, tokens {n}; "
          f"{args.steps} profiled steps after {args.warmup} warm-ups")
    print("# ceilings this run: " + ", ".join(f"{k} {v:.3f}" for k, v in ceil.items()))
    e_bytes = n * d
    variants = [("bf16 nn.Linear", base, None, False, None)]
    for fmt in args.formats:
        layer = PrecisionLinear.from_module(copy.deepcopy(base), get_format(fmt), get_backend("torch"), fused=True)
        variants += [(f"lowprec {fmt} stats off", layer, layer.weight, False, fmt),
                     (f"lowprec {fmt} check step", layer, layer.weight, True, fmt)]
    record = {"device": name, "torch": torch.__version__, "d_model": d, "tokens": n, "ceilings": ceil, "variants": []}
    for label, layer, weight, stats, fmt in variants:
        rows = measure(layer, weight, x, g, args.steps, args.warmup, cuda, stats)
        total = sum(r["us"] for r in rows)
        by_class = {c: sum(r["us"] for r in rows if classify(r["kernel"]) == c) for c in ("gemm", "cast", "other")}
        floor = {}
        if cuda and fmt is not None:
            floor["gemm_us"] = ceil["scaled_mm_3x_ms"] * 1e3
            floor["outside_gemm_us"] = MODEL_E[fmt] * e_bytes / (ceil["copy_GBps"] * 1e9) * 1e6
        print(f"\n## {label}: {total:.0f} us of kernels per step "
              + ", ".join(f"{c} {v:.0f} us" for c, v in by_class.items())
              + ("; model floor: GEMMs {gemm_us:.0f} us, outside the GEMMs {outside_gemm_us:.0f} us".format(**floor)
                 if floor else ""))
        print("| kernel | class | launches/step | us/step | share |")
        print("|---|---|---:|---:|---:|")
        for r in rows[:args.top]:
            print(f"| {r['kernel'][:90]} | {classify(r['kernel'])} | {r['launches']:.1f} | {r['us']:.1f} | "
                  f"{100 * r['us'] / total:.1f}% |")
        if len(rows) > args.top:
            rest = sum(r["us"] for r in rows[args.top:])
            print(f"| ({len(rows) - args.top} more) | | | {rest:.1f} | {100 * rest / total:.1f}% |")
        record["variants"].append({"variant": label, "total_us": total, "by_class_us": by_class,
                                   "floor": floor, "kernels": rows})
        sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
