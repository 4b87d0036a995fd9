"""Benchmark (issue 43): the host time of a `PrecisionLinear` fast-path step, on any CPU.

`bench_host.py` measures the host side on a GPU. This harness measures it here: the layer
runs the fast path's own host code (the recipe, the weight cache, the autograd function,
the custom ops' Python, the kernels' argument preparation and buffer allocations) with
each Triton kernel launch replaced by a no-op that counts it, so no kernel runs and the
time per step is the host's: Python, autograd and the dispatcher. `torch._scaled_mm` is
replaced too, by the allocation of its output (on this CPU a real 16x16 FP8 `_scaled_mm`
costs about 21 us of arithmetic where a BF16 `torch.mm` costs 4: a GPU's launch costs
neither). `nn.Linear` runs for real, on operands small enough (`--d-model 16 --tokens 16`
by default) that its three GEMMs are mostly dispatch.

The replacement is scoped to `noop_launches()` (restored on exit) and patches only what
decides where a cast runs and what launches: `fp8_ops.uses_kernels` and
`fp8_cast.kernels_available` say "the kernels", `cast_transpose.eager_launch` returns a
no-op, `torch._scaled_mm` allocates. The FP8 outputs are
then uninitialised memory; nothing reads them but the GEMMs.

Rows: `nn.Linear fwd+bwd` (the baseline), `PrecisionLinear` on fp8_tensorwise, fp8_delayed
and fp8_rowwise with statistics off, fp8_tensorwise and fp8_rowwise on a check step (statistics on), and
fp8_tensorwise under `torch.compile` (on CPU the casts stay opaque ops in the graph, which
call the same no-op launches). Each step changes the weight (as an optimizer step does) and
sets the gradients to None (as `zero_grad` does). Columns: the fastest of `--repeats`
rounds of `--calls` steps (the rows interleaved), in microseconds of this thread's CPU
time per step; the ratio to `nn.Linear`; the device launches of one step on a GPU: the
Triton kernels and `_scaled_mm` calls the no-ops stood in for, and every other PyTorch op
that launches a kernel there (`torch.zeros`, a sum, a copy; counted under the autograd
profiler as the innermost ATen ops that are not views or allocations; in a compiled row
Inductor's own generated kernels are not seen). `est GPU us` adds `--launch-us` per launch
(default 14.7: the H200's `Triton launch` row of bench_host.py, Triton's own launch path of a
3-argument kernel, 2026-11-27) to the host figure, a prediction of the GPU host's time that
leaves out that host's slower Python and CUDA's allocator; `est x` divides it by the
`nn.Linear` row's estimate. `--triton` runs Triton's own host launch path for sm_90 on this
CPU instead of no-ops (experiments/triton_nolaunch.py; the fast path's warm launches
included), so the host figure holds what Triton does per launch except the driver call.

`--profile ROW` prints the cProfile of that row's steps (the top functions by own time).

    OMP_NUM_THREADS=1 python experiments/bench_host_noop.py
    OMP_NUM_THREADS=1 python experiments/bench_host_noop.py --runs 5   # medians of 5 runs
    OMP_NUM_THREADS=1 python experiments/bench_host_noop.py --profile "PrecisionLinear fp8_tensorwise"
    OMP_NUM_THREADS=1 python experiments/bench_host_noop.py --triton --launch-us 0   # Triton's own launch path
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import platform
import pstats
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

BASE = "nn.Linear fwd+bwd"
# row name -> (format, statistics on, compiled)
LAYERS = {
    "PrecisionLinear fp8_tensorwise": ("fp8_tensorwise", False, False),
    "PrecisionLinear fp8_delayed": ("fp8_delayed", False, False),
    "PrecisionLinear fp8_rowwise": ("fp8_rowwise", False, False),
    "PrecisionLinear fp8_tensorwise, check step": ("fp8_tensorwise", True, False),
    "PrecisionLinear fp8_rowwise, check step": ("fp8_rowwise", True, False),
    "PrecisionLinear fp8_tensorwise (compiled)": ("fp8_tensorwise", False, True),
}
ROWS = (BASE, "nn.Linear fwd+bwd (compiled)", *LAYERS)


class _Counter:
    launches = 0
    driver = None   # the recording driver's `Launches` under --triton (it counts the kernels' launches)


@torch.library.custom_op("lowprec_bench::scaled_mm_noop", mutates_args=())
def _scaled_mm_noop(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """What a compiled graph calls in place of `_scaled_mm` here: the output's allocation."""
    _Counter.launches += 1
    return torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@_scaled_mm_noop.register_fake
def _(a, b, scale_a, scale_b, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@contextlib.contextmanager
def noop_launches(triton_path: bool = False):
    """Within this block the fast path's casts take the Triton path on CPU tensors, every
    Triton launch is a no-op and `torch._scaled_mm` only allocates its output; each counts
    itself (`_Counter.launches`). With `triton_path`, the Triton launches run Triton's own
    host path for sm_90 instead (experiments/triton_nolaunch.py: binding, specialisation, the
    warm launches' direct calls), ending in a launcher that counts."""
    from lowprec.numerics.kernels import cast_transpose, fp8_cast

    def launch(kernel, grid, warm=None, vary=(), kw=None):
        def run(*args, **kwargs):
            _Counter.launches += 1
        return run

    def scaled_mm(a, b, *, scale_a, scale_b, out_dtype=None, **kwargs):
        if torch.compiler.is_compiling():   # one opaque node, as _scaled_mm is (not dead code)
            return torch.ops.lowprec_bench.scaled_mm_noop(a, b, scale_a, scale_b, out_dtype or a.dtype)
        _Counter.launches += 1
        return torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype or a.dtype)

    # Inductor registers its extern `_scaled_mm` under the name of the function `torch._scaled_mm` is when its
    # GEMM lowerings are first imported: imported under the patch below, the process's registry would hold this
    # stand-in as `scaled_mm`, and a graph compiled elsewhere and loaded from Inductor's cache later in the
    # process (its code calls `extern_kernels._scaled_mm`) would fail. Import them first, unpatched.
    import torch._inductor.kernel.mm  # noqa: F401
    saved = (fp8_ops.uses_kernels, fp8_cast.kernels_available, cast_transpose.eager_launch, torch._scaled_mm)
    fp8_ops.uses_kernels = lambda x: True
    fp8_cast.kernels_available = lambda x: True
    if not triton_path:   # with it, the kernels' launches are the fast path's own, counted by the driver
        cast_transpose.eager_launch = launch
    torch._scaled_mm = scaled_mm
    driver = contextlib.nullcontext()
    if triton_path:
        try:
            from experiments.triton_nolaunch import nolaunch_driver
        except ImportError:   # run as a script: its own folder is on the path
            from triton_nolaunch import nolaunch_driver
        driver = nolaunch_driver(record=False)
    try:
        with driver as launches:
            _Counter.driver = launches
            yield
    finally:
        _Counter.driver = None
        (fp8_ops.uses_kernels, fp8_cast.kernels_available, cast_transpose.eager_launch,
         torch._scaled_mm) = saved


def _step(layer, x, g, weight):
    """One training step's layer work: the weight changed (as by an optimizer), fwd+bwd, the
    gradients dropped (as by zero_grad(set_to_none=True))."""
    params = [p for p in layer.parameters()]

    def step():
        increment_version(weight)
        layer(x).backward(g)
        x.grad = None
        for p in params:
            p.grad = None
    return step


# ATen ops that launch nothing on a device (views, allocations, metadata)
_NO_KERNEL = frozenset("aten::" + n for n in (
    "empty", "empty_strided", "empty_like", "view", "_unsafe_view", "reshape", "as_strided", "detach", "alias",
    "t", "transpose", "permute", "expand", "slice", "select", "unsqueeze", "squeeze", "resolve_conj",
    "resolve_neg", "lift_fresh", "_reshape_alias", "contiguous", "set_", "result_type"))


def _launches_below(event) -> bool:
    return any((c.name.startswith("aten::") and c.name not in _NO_KERNEL) or _launches_below(c)
               for c in event.cpu_children)


def count_launches(step) -> tuple[int, int]:
    """(Triton kernels and `_scaled_mm` calls, other kernel-launching ATen ops) of one step:
    the no-ops' own count (under `--triton`, the recording driver's count of the kernels'
    launches, which the layer makes itself: no wrapper adds host time to them), and the profiler's innermost ATen ops that are not views or
    allocations (`torch.zeros` is its fill, `sum` its reduction)."""
    from torch.profiler import ProfilerActivity, profile
    _Counter.launches = 0
    before = 0 if _Counter.driver is None else _Counter.driver.count
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    other = sum(1 for e in prof.events() if e.name.startswith("aten::") and e.name not in _NO_KERNEL
                and not _launches_below(e))
    kernels = 0 if _Counter.driver is None else _Counter.driver.count - before
    return _Counter.launches + kernels, other


def measure(steps: dict, calls: int, repeats: int) -> dict[str, tuple[float, tuple[int, int]]]:
    """{row: (host microseconds per step, `count_launches`)}: the fastest of `repeats` rounds,
    each round timing `calls` steps of every row in turn. Time is this thread's CPU time
    (`time.thread_time`): nothing here waits on a device, and a shared CPU's other work then
    adds only through caches; the fastest round, as that only ever adds time."""
    launches = {}
    for row, fn in steps.items():
        for _ in range(3):
            fn()
        launches[row] = count_launches(fn)
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(repeats):
        for row, fn in steps.items():
            t0 = time.thread_time()
            for _ in range(calls):
                fn()
            best[row] = min(best[row], (time.thread_time() - t0) / calls * 1e6)
    return {row: (best[row], launches[row]) for row in steps}


def make_step(row: str, d: int, n: int):
    torch.manual_seed(0)
    x = torch.randn(n, d, dtype=torch.bfloat16).requires_grad_(True)
    g = torch.randn(n, d, dtype=torch.bfloat16)
    base = nn.Linear(d, d, bias=False, dtype=torch.bfloat16)
    if row in (BASE, "nn.Linear fwd+bwd (compiled)"):
        run = torch.compile(base) if "compiled" in row else base
        return _step(run, x, g, base.weight)
    fmt, stats, compiled = LAYERS[row]
    layer = PrecisionLinear.from_module(base, get_format(fmt), get_backend("torch"))
    layer.collect_stats = stats
    run = torch.compile(layer) if compiled else layer
    return _step(run, x, g, layer.weight)


def _profile(step, calls: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        step()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    return out.getvalue()


def main(argv=None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=16)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--runs", type=int, default=1,
                   help="measure this many times (all rows each time); the table gives the medians of the runs' "
                        "microseconds and of their ratios to nn.Linear in the same run")
    p.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS), metavar="ROW")
    p.add_argument("--profile", metavar="ROW", choices=ROWS, help="print the cProfile of this row's steps")
    p.add_argument("--launch-us", type=float, default=14.7,
                   help="host microseconds one device launch adds on the GPU, for the estimate columns (default: "
                        "the H200's `Triton launch` row of bench_host.py, 2026-11-27: Triton's own launch path)")
    p.add_argument("--triton", action="store_true",
                   help="run Triton's own host launch path for sm_90 (experiments/triton_nolaunch.py) instead of "
                        "no-op launches; needs Triton's NVIDIA backend (compiles the kernels once)")
    args = p.parse_args(argv)
    lines = [f"# command: {' '.join(shlex.quote(a) for a in [sys.executable, *sys.argv])}",
             f"# machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s); "
             f"torch {torch.__version__}; d_model {args.d_model}, tokens {args.tokens}; kernel launches are "
             f"{'Triton host paths ending in a no-op launcher' if args.triton else 'no-ops'}; the fastest of "
             f"{args.repeats} rounds of {args.calls} steps, rows interleaved; median of {args.runs} run(s); est GPU = "
             f"host us + launches x {args.launch_us} us",
             f"| step | host us | x {BASE} | est GPU us | est x | Triton + GEMM | other | launches |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    rows = [BASE] + [r for r in args.rows if r != BASE]
    with noop_launches(args.triton):
        steps = {row: make_step(row, args.d_model, args.tokens) for row in rows}
        runs = [measure(steps, args.calls, args.repeats) for _ in range(args.runs)]
        base_est = statistics.median(r[BASE][0] + sum(r[BASE][1]) * args.launch_us for r in runs)
        for row in rows:
            us = statistics.median(r[row][0] for r in runs)
            ratio = statistics.median(r[row][0] / r[BASE][0] for r in runs)
            kernels, other = runs[-1][row][1]
            est = us + (kernels + other) * args.launch_us
            lines.append(f"| {row} | {us:.1f} | {ratio:.2f} | {est:.1f} | {est / base_est:.2f} | {kernels} | {other} "
                         f"| {kernels + other} |")
            print(lines[-1], flush=True)
        if args.profile:
            text = _profile(make_step(args.profile, args.d_model, args.tokens), args.calls)
            lines += text.splitlines()
            print(text)
    return lines


if __name__ == "__main__":
    main()
