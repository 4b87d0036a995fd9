"""Benchmark (issue 29): the host time of the FP8 fast path, piece by piece.

On an H100 a lowprec layer step at d_model 2048 took 2.2 ms where its kernels took 0.57 ms,
as BF16's: host time. This script times what the host does, each piece on its own, with no
synchronisation inside the timed loop, on operands small enough that the device never
holds the host up (so the time per call is the host's):

* `torch.empty`: one allocation, the floor of any PyTorch call;
* `Triton launch`: one `_amax_partial_kernel` launch (CUDA only): Triton's own launch path;
  `Triton launch, warm`: the same launch as the fast path's eager casts make it, the compiled
  kernel's launcher called directly (`lowprec.numerics.kernels.warm_launch`);
* `fp8_cast, direct` / `fp8_cast, dispatcher`: a tensor-wise cast+transpose as the layer
  calls it (`lowprec.numerics.fp8_ops.cast`, no dispatcher in eager code) and through
  `torch.ops.lowprec.fp8_cast` (the custom op's dispatch on top);
* `_scaled_mm`: one FP8 GEMM call (CUDA only);
* `nn.Linear fwd+bwd`, eager and compiled (the baselines of issue 43's goals: eager at
  most 3x `nn.Linear`, compiled at most 1.5x), `PrecisionLinear fwd+bwd` (fp8_tensorwise,
  statistics off, the weight changed before each step as by an optimizer and the
  gradients dropped as by `zero_grad(set_to_none=True)`), and the same layer under
  `torch.compile` (the casts' kernels in the graph, then the casts kept opaque ops:
  `fp8_ops.opaque_in_graphs()`) and under `mode="reduce-overhead"` (CUDA graphs, CUDA only).

Each row is the median over `--repeats` rounds of `--calls` calls, in microseconds per call,
then divided by the `nn.Linear fwd+bwd` row for the layer rows. A CUDA run synchronises
before and after each round only. On a CPU the casts run the reference quantizer (their
rows then measure it, not the kernels' launch path), and the CUDA-only rows say so;
`bench_host_noop.py` measures the layer's host time on a CPU with the launches as no-ops.

    python experiments/bench_host.py                 # on a GPU
    python experiments/bench_host.py --device cpu    # a smoke run here
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import statistics
import sys
import time

import torch
from torch import nn
from torch.autograd.graph import increment_version

from lowprec.numerics import fp8_ops
from lowprec.numerics.formats import get_format
from lowprec.sites.backends import get_backend
from lowprec.sites.layers import PrecisionLinear

ROWS = ("torch.empty", "Triton launch", "Triton launch, warm", "fp8_cast, direct", "fp8_cast, dispatcher", "_scaled_mm",
        "nn.Linear fwd+bwd", "nn.Linear fwd+bwd (compiled)", "PrecisionLinear fwd+bwd",
        "PrecisionLinear fwd+bwd (compiled)",
        "PrecisionLinear fwd+bwd (compiled, casts opaque)", "PrecisionLinear fwd+bwd (compiled, CUDA graphs)")
LAYER_BASE = "nn.Linear fwd+bwd"


def per_call_us(fn, calls: int, repeats: int, cuda: bool) -> float:
    """Median over `repeats` rounds of the host microseconds per call of `fn`."""
    for _ in range(3):
        fn()
    rounds = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
        if cuda:
            torch.cuda.synchronize()
    return statistics.median(rounds)


def _layer_step(layer, x, g, weight, cuda_graphs: bool = False):
    """One fwd+bwd of `layer`, the weight changed before it as by an optimizer step and the
    gradients dropped as by `zero_grad(set_to_none=True)`: a step that added into the last
    step's gradients would read, under CUDA graphs, memory the next replay has overwritten
    (the "accessing tensor output of CUDAGraphs that has been overwritten" error). With
    `cuda_graphs`, each step a new replay of the recorded graphs."""
    params = list(layer.parameters())

    def step():
        x.grad = None
        for p in params:
            p.grad = None
        if cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        increment_version(weight)
        layer(x).backward(g)
    return step


def _warm_amax_launch(xs, partial):
    """The `Triton launch` row's launch as a warm launch (the plan's dict kept across calls)."""
    from lowprec.numerics.kernels.fp8_cast import _amax_partial_kernel, _bits
    from lowprec.numerics.kernels.warm_launch import warm_launch
    warm: dict = {}
    kw = dict(BLOCK=2048, BF16=True, TICKET=False, num_warps=8)

    def launch():
        xb = _bits(xs)
        warm_launch(_amax_partial_kernel, (1,), warm, (xb,), kw)(xb, partial, xs.numel())
    return launch


def measure(args) -> dict[str, tuple[float, str]]:
    cuda = args.device == "cuda"
    dev, d, n = args.device, args.d_model, args.tokens
    torch.manual_seed(0)
    x = torch.randn(n, d, device=dev, dtype=torch.bfloat16)
    g = torch.randn(n, d, device=dev, dtype=torch.bfloat16)
    t = lambda fn: per_call_us(fn, args.calls, args.repeats, cuda)  # noqa: E731
    out: dict[str, tuple[float, str]] = {}
    only_cuda = (float("nan"), "CUDA only")
    out["torch.empty"] = (t(lambda: torch.empty((n, d), dtype=torch.uint8, device=dev)), "")
    if cuda:
        from lowprec.numerics.kernels.fp8_cast import _amax_partial_kernel, _bits
        partial = torch.empty(1, dtype=torch.float32, device=dev)
        xs = x[:1, :16].contiguous()
        out["Triton launch"] = (t(lambda: _amax_partial_kernel[(1,)](_bits(xs), partial, xs.numel(), BLOCK=2048,
                                                                      BF16=True, TICKET=False, num_warps=8)), "")
        out["Triton launch, warm"] = (t(_warm_amax_launch(xs, partial)), "")
    else:
        out["Triton launch"] = out["Triton launch, warm"] = only_cuda
    out["fp8_cast, direct"] = (t(lambda: fp8_ops.cast(x, 0, False, True, False)), "")
    out["fp8_cast, dispatcher"] = (t(lambda: torch.ops.lowprec.fp8_cast(x, 0, False, True, False)), "")
    if cuda:
        qa = x.to(torch.float8_e4m3fn)
        qb = g.to(torch.float8_e4m3fn)
        one = torch.ones((), device=dev)
        out["_scaled_mm"] = (t(lambda: torch._scaled_mm(qa, qb.t(), scale_a=one, scale_b=one,
                                                         out_dtype=torch.bfloat16)), "")
    else:
        out["_scaled_mm"] = only_cuda
    xg = x.detach().requires_grad_(True)
    base = nn.Linear(d, d, bias=False, device=dev, dtype=torch.bfloat16)
    out[LAYER_BASE] = (t(_layer_step(base, xg, g, base.weight)), "")
    out["nn.Linear fwd+bwd (compiled)"] = (t(_layer_step(torch.compile(base), xg, g, base.weight)), "")
    variants = (("PrecisionLinear fwd+bwd", None, False, False),
                ("PrecisionLinear fwd+bwd (compiled)", None, True, False),
                ("PrecisionLinear fwd+bwd (compiled, casts opaque)", None, True, True),
                ("PrecisionLinear fwd+bwd (compiled, CUDA graphs)", "reduce-overhead", True, False))
    for name, mode, compiled, opaque in variants:
        if mode and not cuda:
            out[name] = only_cuda
            continue
        try:
            layer = PrecisionLinear.from_module(nn.Linear(d, d, bias=False, device=dev, dtype=torch.bfloat16),
                                                get_format("fp8_tensorwise"), get_backend("torch"))
            layer.collect_stats = False
            run = torch.compile(layer, mode=mode) if compiled else layer
            step = _layer_step(run, xg, g, layer.weight, cuda_graphs=mode == "reduce-overhead")
            with fp8_ops.opaque_in_graphs() if opaque else contextlib.nullcontext():   # traced at the first call
                out[name] = (t(step), "")
        except Exception as e:  # report, keep measuring the others
            out[name] = (float("nan"), f"FAILED {type(e).__name__}: {str(e)[:120]}")
    return out


def main(argv=None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA GPU here; use --device cpu")
    name = torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} threads)"
    lines = [f"# command: {' '.join(shlex.quote(a) for a in [sys.executable, *sys.argv])}",
             f"# device: {name}; torch {torch.__version__}; d_model {args.d_model}, tokens {args.tokens}; "
             f"median of {args.repeats} rounds of {args.calls} calls, host microseconds per call",
             "| piece | us per call | x nn.Linear fwd+bwd | note |", "|---|---:|---:|---|"]
    print("\n".join(lines), flush=True)
    res = measure(args)
    base = res[LAYER_BASE][0]
    for row in ROWS:
        us, note = res[row]
        ratio = f"{us / base:.2f}" if "fwd+bwd" in row and us == us else ""
        lines.append(f"| {row} | {us:.1f} | {ratio} | {note} |" if us == us else f"| {row} | n/a | | {note} |")
        print(lines[-1], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": lines[:2], "rows": {k: {"us": v[0] if v[0] == v[0] else None, "note": v[1]}
                                                     for k, v in res.items()}}, f, indent=1)
    return lines


if __name__ == "__main__":
    main()
