"""Benchmark (issue 15): one linear layer's forward+backward, lowprec FP8 against BF16 and torchao.

Rows (variants), all measured in one run on one device:

* `memory copy`: one copy of the input activation (tokens x d_model, BF16): what a single
  extra pass over an operand costs at that shape;
* `bf16 nn.Linear`: the baseline; every speed-up is against it;
* `torchao Float8Linear tensorwise/rowwise (compiled)`: torchao's float8 training layers
  under torch.compile (skipped, with the reason, where torchao is missing or has no GPU);
* `lowprec <format>`: PrecisionLinear on the `torch` backend (torch._scaled_mm, BF16 output
  on CUDA, weight cache), `stats off` (no statistics) and `stats 1/10` (statistics on one
  step in ten, as with `check_every: 10`: the time is the mean over such 10-step groups).

Columns: d_model x tokens, `y = layer(x); y.backward(g)` with a `Linear(d, d)`; the median
over `--repeats` (CUDA events after `--warmup` runs; wall clock on CPU), then the speed-up
against BF16 of the same shape and run. The weight changes before every step
(`torch.autograd.graph.increment_version`, as an optimizer step would), so the weight
cache serves only the backward; `--micro-batches N` lets it serve N micro-batches.

    python experiments/bench_linear.py                       # the issue's table (a GPU)
    python experiments/bench_linear.py --device cpu --tiny   # small shapes: a smoke run

The header prints the command, the device, the PyTorch (and torchao) version.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import torch
from torch import nn
from torch.autograd.graph import increment_version

from lowprec.backends import get_backend
from lowprec.formats import get_format
from lowprec.layers import PrecisionLinear

FORMATS = ("fp8_tensorwise", "fp8_delayed", "fp8_rowwise")
TORCHAO_RECIPES = ("tensorwise", "rowwise")
CHECK_EVERY = 10


def timed(fn, repeats: int, warmup: int, cuda: bool) -> float:
    """Median milliseconds of `fn()` (CUDA events on a GPU, wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def row_names() -> list[str]:
    """Every row of the table, in order (the test checks that each one is printed)."""
    names = ["memory copy (input, one pass)", "bf16 nn.Linear"]
    names += [f"torchao Float8Linear {r} (compiled)" for r in TORCHAO_RECIPES]
    for f in FORMATS:
        names += [f"lowprec {f} stats off", f"lowprec {f} stats 1/{CHECK_EVERY}"]
    return names


def _torchao_layer(base: nn.Linear, recipe: str, cuda: bool):
    """torchao's Float8Linear for `recipe`, compiled; or the reason it cannot be built here."""
    if not cuda:
        return None, "skipped: torchao's float8 training needs a CUDA GPU (SM89+)"
    try:
        import torchao  # noqa: F401
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        return None, f"skipped: torchao not installed ({e}); see docs/performance.md"
    import copy
    model = nn.Sequential(copy.deepcopy(base))
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    return torch.compile(model), ""


def _lowprec_layer(base: nn.Linear, fmt: str, fused: bool) -> PrecisionLinear:
    import copy
    return PrecisionLinear.from_module(copy.deepcopy(base), get_format(fmt), get_backend("torch"),
                                       fused=fused)


def measure_shape(d: int, tokens: int, args, cuda: bool) -> dict[str, tuple[float, str]]:
    """{row name: (ms, note)} for one shape; a row that cannot run gets NaN and the reason."""
    dev, dtype = args.device, torch.bfloat16
    torch.manual_seed(0)
    base = nn.Linear(d, d, bias=False, device=dev, dtype=dtype)
    x = torch.randn(tokens, d, device=dev, dtype=dtype, requires_grad=True)
    g = torch.randn(tokens, d, device=dev, dtype=dtype)
    buf = torch.empty_like(x)
    t = lambda fn: timed(fn, args.repeats, args.warmup, cuda)  # noqa: E731
    out: dict[str, tuple[float, str]] = {}
    out["memory copy (input, one pass)"] = (t(lambda: buf.copy_(x.detach())), "")

    def step(layer, weight):
        def run():
            if weight is not None:
                increment_version(weight)   # as an optimizer step: the weight cache is stale
            for _ in range(args.micro_batches):
                layer(x).backward(g)
        return run

    out["bf16 nn.Linear"] = (t(step(base, None)), "")
    for recipe in TORCHAO_RECIPES:
        name = f"torchao Float8Linear {recipe} (compiled)"
        layer, why = _torchao_layer(base, recipe, cuda)
        out[name] = (t(step(layer, None)), "") if layer is not None else (float("nan"), why)
    for fmt in FORMATS:
        try:
            layer = _lowprec_layer(base, fmt, args.quantizer == "fused")
            layer.collect_stats = False
            out[f"lowprec {fmt} stats off"] = (t(step(layer, layer.weight)), "")
            one = step(layer, layer.weight)

            def group():   # statistics on the first of CHECK_EVERY steps
                for i in range(CHECK_EVERY):
                    layer.collect_stats = i == 0
                    one()
            ms = timed(group, max(1, args.repeats // CHECK_EVERY), 1, cuda) / CHECK_EVERY
            out[f"lowprec {fmt} stats 1/{CHECK_EVERY}"] = (ms, "")
        except Exception as e:  # report, keep measuring the others
            why = f"FAILED {type(e).__name__}: {str(e)[:100]}"
            out.setdefault(f"lowprec {fmt} stats off", (float("nan"), why))
            out.setdefault(f"lowprec {fmt} stats 1/{CHECK_EVERY}", (float("nan"), why))
    return out


def header(args, cuda: bool) -> list[str]:
    name = torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} threads)"
    try:
        import torchao
        ao = f"torchao {torchao.__version__}"
    except ImportError:
        ao = "torchao not installed"
    cmd = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    return [f"# command: {cmd}",
            f"# device: {name}; torch {torch.__version__}; {ao}; BF16 Linear(d, d), no bias",
            f"# fwd+bwd per step x {args.micro_batches} micro-batch(es), median of {args.repeats} "
            f"after {args.warmup} warm-ups ({'CUDA events' if cuda else 'wall clock'}); "
            f"lowprec: torch backend, {args.quantizer} quantizer; cell: ms (speed-up vs bf16)"]


def main(argv=None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="small shapes (d 64/128, tokens 64/128)")
    p.add_argument("--d-model", type=int, nargs="+", default=None)
    p.add_argument("--tokens", type=int, nargs="+", default=None)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--quantizer", choices=["fused", "eager"], default="fused",
                   help="lowprec's quantizer: torch.compile-fused (default) or eager")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA GPU here; use --device cpu --tiny")
    dims = args.d_model or ([64, 128] if args.tiny else [2048, 4096, 8192])
    toks = args.tokens or ([64, 128] if args.tiny else [8192, 16384])
    shapes = [(d, n) for d in dims for n in toks]
    results = {s: measure_shape(*s, args, cuda) for s in shapes}
    lines = header(args, cuda)
    lines.append("| variant | " + " | ".join(f"d={d} tok={n}" for d, n in shapes) + " |")
    lines.append("|---" * (len(shapes) + 1) + "|")
    notes = {}
    for name in row_names():
        cells = []
        for s in shapes:
            ms, why = results[s][name]
            base = results[s]["bf16 nn.Linear"][0]
            cells.append(f"{ms:.3f} ({base / ms:.2f}x)" if ms == ms else "n/a")
            if why:
                notes[name] = why
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [f"# {name}: {why}" for name, why in notes.items()]
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
