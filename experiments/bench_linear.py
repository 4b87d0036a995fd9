"""Benchmark (issue 15): one linear layer's forward+backward, lowprec FP8 against BF16 and torchao.

Rows (variants), all measured in one run on one device:

* `memory copy`: one copy of the input activation (tokens x d_model, BF16): what a single
  extra pass over an operand costs at that shape;
* `bf16 nn.Linear`: the baseline; every speed-up is against it;
* `torchao Float8Linear tensorwise/rowwise (compiled)`: torchao's float8 training layers
  under torch.compile (skipped, with the reason, where torchao is missing or has no GPU);
* `lowprec <format>`: PrecisionLinear on the `torch` backend (torch._scaled_mm, BF16 output
  on CUDA, weight cache) for fp8_tensorwise, fp8_delayed and fp8_rowwise, `stats off` (no
  statistics) and `stats 1/10` (statistics on one step in ten, as with `check_every: 10`:
  the time is the mean over such 10-step groups);
* `lowprec <format> (compiled)`, `(compiled, casts opaque)` and `(compiled, CUDA graphs)`,
  statistics off: the same layer under `torch.compile` (Inductor launches the cast kernels
  itself: `lowprec.numerics.fp8_ops`), the same with the casts kept opaque ops
  (`fp8_ops.opaque_in_graphs()`, how they were compiled before), and under
  `mode="reduce-overhead"`, which replays the step as one CUDA graph (no host time per
  kernel); for the formats of `--compiled` (fp8_tensorwise by default on CUDA, none on CPU,
  where the casts are the reference quantizer; CUDA graphs need CUDA);
* `lowprec torchao-backend <format>`: the same on lowprec's `torchao` backend (torchao's float8
  training primitives) for fp8_tensorwise and fp8_rowwise; a `skipped` row with the reason
  where `get_backend("torchao")` raises (the backend or torchao missing).

Each measurement is printed (and flushed) as it is made, one line per shape and variant, with
the speed-up against BF16 and TFLOP/s (6 d^2 tokens per step); the summary table, variants
by shapes, comes last. `--json PATH` writes every row to PATH, rewritten after each one, so
that a run stopped by a time limit keeps what it measured; `--deadline S` starts no new shape
after S seconds (the first always runs; the rows not measured say so).

Columns: d_model x tokens, `y = layer(x); y.backward(g)` with a `Linear(d, d)`; the median
over `--repeats` (CUDA events after `--warmup` runs; wall clock on CPU), then the speed-up
against BF16 of the same shape and run. The weight changes before every step
(`torch.autograd.graph.increment_version`, as an optimizer step would), so the weight
cache serves only the backward; `--micro-batches N` lets it serve N micro-batches.

    python experiments/bench_linear.py                       # the issue's table (a GPU)
    python experiments/bench_linear.py --device cpu --tiny   # small shapes: a smoke run
    python experiments/bench_linear.py --json $OUT/linear.json --deadline 390   # scripts/gpu_bench.sh

The header prints the command, the device, the PyTorch (and torchao) version.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time

import torch
from torch import nn
from torch.autograd.graph import increment_version

from lowprec.sites.backends import get_backend
from lowprec.numerics.formats import get_format
from lowprec.sites.layers import PrecisionLinear

FORMATS = ("fp8_tensorwise", "fp8_delayed", "fp8_rowwise")
TORCHAO_RECIPES = ("tensorwise", "rowwise")
# torchao has no delayed scaling; its rowwise recipe is lowprec's fp8_rowwise_e4m3_pow2
TORCHAO_BACKEND_FORMATS = ("fp8_tensorwise", "fp8_rowwise_e4m3_pow2")
TE_BACKEND_FORMATS = ("fp8_tensorwise", "fp8_delayed")   # with --te: Transformer Engine's recipes
CHECK_EVERY = 10
# (row label, torch.compile mode, casts kept opaque: lowprec.numerics.fp8_ops.opaque_in_graphs)
COMPILE_MODES = (("compiled", None, False), ("compiled, casts opaque", None, True),
                 ("compiled, CUDA graphs", "reduce-overhead", False))
NOT_MEASURED = "not measured: out of time (--deadline)"


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


def row_names(compiled: tuple[str, ...] = (), te: bool = False) -> list[str]:
    """Every row of the table, in order (the test checks that each one is printed)."""
    names = ["memory copy (input, one pass)", "bf16 nn.Linear"]
    names += [f"torchao Float8Linear {r} (compiled)" for r in TORCHAO_RECIPES]
    for f in FORMATS:
        names += [f"lowprec {f} stats off", f"lowprec {f} stats 1/{CHECK_EVERY}"]
    names += [_compiled_row(f, how) for f in compiled for how, _, _ in COMPILE_MODES]
    for f in TORCHAO_BACKEND_FORMATS:
        names += [f"lowprec torchao-backend {f} stats off", f"lowprec torchao-backend {f} stats 1/{CHECK_EVERY}"]
    for f in TE_BACKEND_FORMATS if te else ():
        names += [f"lowprec te-backend {f} stats off", f"lowprec te-backend {f} stats 1/{CHECK_EVERY}"]
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


def _lowprec_layer(base: nn.Linear, fmt: str, backend, fused: bool) -> nn.Module:
    """A lowprec site for `fmt`: a PrecisionLinear, or the backend's own module where it swaps
    modules (`make_site`: the torchao backend's Float8Linear sites)."""
    import copy
    if hasattr(backend, "make_site"):
        return backend.make_site(copy.deepcopy(base), fmt)
    return PrecisionLinear.from_module(copy.deepcopy(base), get_format(fmt), backend, fused=fused)


def _compiled_row(fmt: str, how: str) -> str:
    return f"lowprec {fmt} ({how}) stats off"


def _compiled_rows(base: nn.Linear, args, cuda: bool, t, step, report, out) -> None:
    """The `--compiled` rows: PrecisionLinear (statistics off) under torch.compile, its casts'
    kernels in the graph (and, for comparison, the casts as opaque ops), and with CUDA graphs
    (`mode="reduce-overhead"`, CUDA only)."""
    from contextlib import nullcontext

    from lowprec.numerics.fp8_ops import opaque_in_graphs
    for fmt in args.compiled:
        for how, mode, opaque in COMPILE_MODES:
            name = _compiled_row(fmt, how)
            if mode == "reduce-overhead" and not cuda:
                out[name] = (float("nan"), "skipped: CUDA graphs need a CUDA GPU")
            else:
                try:
                    layer = _lowprec_layer(base, fmt, get_backend("torch"), args.quantizer == "fused")
                    layer.collect_stats = False
                    with opaque_in_graphs() if opaque else nullcontext():   # traced at the first call
                        out[name] = (t(step(torch.compile(layer, mode=mode), layer.weight,
                                            cuda_graphs=mode == "reduce-overhead")), "")
                except Exception as e:  # report, keep measuring the others
                    out[name] = (float("nan"), f"FAILED {type(e).__name__}: {str(e)[:100]}")
            report(name, *out[name])


def _backend(name: str):
    """lowprec's `name` backend, or the reason it is not available here."""
    try:
        return get_backend(name), ""
    except Exception as e:  # noqa: BLE001 - the reason is the row's note
        return None, f"skipped: get_backend({name!r}) raised {type(e).__name__}: {str(e)[:160]}"


def _torchao_backend():
    """lowprec's `torchao` backend, or the reason it is not available here."""
    try:
        return get_backend("torchao"), ""
    except Exception as e:  # not built yet, or torchao missing: the rows say why
        return None, f"skipped: get_backend('torchao') raised {type(e).__name__}: {str(e)[:160]}"


def measure_shape(d: int, tokens: int, args, cuda: bool, report) -> dict[str, tuple[float, str]]:
    """{row name: (ms, note)} for one shape; a row that cannot run gets NaN and the reason.
    `report(name, ms, note)` is called as each row is measured."""
    dev, dtype = args.device, torch.bfloat16
    torch.manual_seed(0)
    base = nn.Linear(d, d, bias=False, device=dev, dtype=dtype)
    x = torch.randn(tokens, d, device=dev, dtype=dtype, requires_grad=True)
    g = torch.randn(tokens, d, device=dev, dtype=dtype)
    buf = torch.empty_like(x)
    t = lambda fn: timed(fn, args.repeats, args.warmup, cuda)  # noqa: E731
    out: dict[str, tuple[float, str]] = {}
    out["memory copy (input, one pass)"] = (t(lambda: buf.copy_(x.detach())), "")
    report("memory copy (input, one pass)", *out["memory copy (input, one pass)"])

    def step(layer, weight, cuda_graphs: bool = False):
        """One optimizer step's layer work: the gradients dropped (as `zero_grad(set_to_none=True)`,
        so that no step adds into a gradient an earlier CUDA-graph replay wrote), the weight
        changed, then the micro-batches; with `cuda_graphs`, a new step for the graphs' outputs."""
        params = list(layer.parameters())

        def run():
            x.grad = None
            for p in params:
                p.grad = None
            if cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            if weight is not None:
                increment_version(weight)   # as an optimizer step: the weight cache is stale
            for _ in range(args.micro_batches):
                layer(x).backward(g)
        return run

    out["bf16 nn.Linear"] = (t(step(base, None)), "")
    report("bf16 nn.Linear", *out["bf16 nn.Linear"])
    for recipe in TORCHAO_RECIPES:
        name = f"torchao Float8Linear {recipe} (compiled)"
        try:
            layer, why = _torchao_layer(base, recipe, cuda)
            out[name] = (t(step(layer, None)), "") if layer is not None else (float("nan"), why)
        except Exception as e:  # report, keep measuring the others
            out[name] = (float("nan"), f"FAILED {type(e).__name__}: {str(e)[:100]}")
        report(name, *out[name])

    def stats_rows(prefix: str, fmt: str, backend, why_not: str) -> None:
        """A lowprec site's `stats off` and `stats 1/N` rows (the reason twice where no backend)."""
        off, some = f"{prefix} {fmt} stats off", f"{prefix} {fmt} stats 1/{CHECK_EVERY}"
        if backend is None:
            out[off] = out[some] = (float("nan"), why_not)
            report(off, *out[off])
            report(some, *out[some])
            return
        try:
            layer = _lowprec_layer(base, fmt, backend, args.quantizer == "fused")
            layer.collect_stats = False
            out[off] = (t(step(layer, layer.weight)), "")
            report(off, *out[off])
            one = step(layer, layer.weight)

            def group():   # statistics on the first of CHECK_EVERY steps
                for i in range(CHECK_EVERY):
                    layer.collect_stats = i == 0
                    one()
            ms = timed(group, max(1, args.repeats // CHECK_EVERY), 1, cuda) / CHECK_EVERY
            out[some] = (ms, "")
            report(some, *out[some])
        except Exception as e:  # report, keep measuring the others
            why = f"FAILED {type(e).__name__}: {str(e)[:100]}"
            for name in (off, some):
                if name not in out:
                    out[name] = (float("nan"), why)
                    report(name, *out[name])

    for fmt in FORMATS:
        stats_rows("lowprec", fmt, get_backend("torch"), "")
    _compiled_rows(base, args, cuda, t, step, report, out)
    ao_backend, why_not = _torchao_backend()
    for fmt in TORCHAO_BACKEND_FORMATS:
        stats_rows("lowprec torchao-backend", fmt, ao_backend, why_not)
    if args.te:
        te_backend, why_not = _backend("te")
        for fmt in TE_BACKEND_FORMATS:
            stats_rows("lowprec te-backend", fmt, te_backend, why_not)
    return out


def versions() -> dict[str, str]:
    out = {"torch": torch.__version__}
    for name in ("triton", "torchao"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = "not installed"
    return out


def header(args, cuda: bool) -> list[str]:
    name = torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} threads)"
    v = versions()
    cmd = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    return [f"# command: {cmd}",
            f"# device: {name}; torch {v['torch']}; triton {v['triton']}; torchao {v['torchao']}; "
            f"BF16 Linear(d, d), no bias",
            f"# fwd+bwd per step x {args.micro_batches} micro-batch(es), median of {args.repeats} "
            f"after {args.warmup} warm-ups ({'CUDA events' if cuda else 'wall clock'}); "
            f"lowprec: {args.quantizer} quantizer; cell: ms (speed-up vs bf16)"]


def _configure_compile() -> None:
    """One static compilation per shape: no automatic dynamic shapes (slower kernels that
    would make the second shape's rows incomparable) and room for every shape's recompilation
    of the same forward (the default limit of 8 would fall back to eager without saying so)."""
    import torch._dynamo.config as dynamo_config
    dynamo_config.automatic_dynamic_shapes = False
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, limit):
            setattr(dynamo_config, limit, 256)


def main(argv=None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="small shapes (d 16/32, tokens 16/32)")
    p.add_argument("--d-model", type=int, nargs="+", default=None)
    p.add_argument("--tokens", type=int, nargs="+", default=None)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--quantizer", choices=["fused", "eager"], default="fused",
                   help="lowprec's quantizer: torch.compile-fused (default) or eager")
    p.add_argument("--json", metavar="PATH", help="also write every row to PATH (rewritten after each row)")
    p.add_argument("--deadline", type=float, default=None, metavar="S",
                   help="start no new shape after S seconds (the first always runs); the rows not measured say so")
    p.add_argument("--compiled", nargs="*", default=None, choices=FORMATS, metavar="FORMAT",
                   help="formats with compiled rows (default: fp8_tensorwise on CUDA, none on CPU)")
    p.add_argument("--te", action="store_true", help="also the rows of lowprec's `te` backend (Transformer Engine)")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.compiled = tuple(args.compiled if args.compiled is not None else (("fp8_tensorwise",) if cuda else ()))
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA GPU here; use --device cpu --tiny")
    _configure_compile()
    t_start = time.perf_counter()
    dims = args.d_model or ([16, 32] if args.tiny else [2048, 4096, 8192])
    toks = args.tokens or ([16, 32] if args.tiny else [8192, 16384])
    shapes = [(d, n) for d in dims for n in toks]
    lines = header(args, cuda)
    print("\n".join(lines), flush=True)
    record = {"command": lines[0].removeprefix("# command: "), "device": lines[1].removeprefix("# device: "),
              "versions": versions(), "repeats": args.repeats, "warmup": args.warmup,
              "micro_batches": args.micro_batches, "quantizer": args.quantizer, "check_every": CHECK_EVERY,
              "compiled": list(args.compiled),
              "shapes": [list(s) for s in shapes], "rows": []}
    row_head = "| d_model | tokens | variant | ms | x bf16 | TFLOP/s | note |"
    print(row_head + "\n" + "|---" * 7 + "|", flush=True)
    lines += [row_head, "|---" * 7 + "|"]

    def save():
        if args.json:
            with open(args.json, "w") as f:   # unmeasured rows: ms null, and their note
                json.dump(record, f, indent=1, allow_nan=False)

    results: dict[tuple[int, int], dict[str, tuple[float, str]]] = {}
    for d, n in shapes:
        def report(name, ms, note, d=d, n=n):
            base = results.get((d, n), {}).get("bf16 nn.Linear", (ms if name == "bf16 nn.Linear" else None,))[0]
            ok = ms == ms
            speedup = base / ms if ok and base else None
            tflops = 6 * d * d * n / (ms * 1e-3) / 1e12 if ok and ms > 0 else None
            cells = [str(d), str(n), name, f"{ms:.3f}" if ok else "n/a",
                     f"{speedup:.2f}" if speedup else "", f"{tflops:.1f}" if tflops else "", note]
            line = "| " + " | ".join(cells) + " |"
            print(line, flush=True)
            lines.append(line)
            record["rows"].append({"d_model": d, "tokens": n, "variant": name, "ms": ms if ok else None,
                                   "speedup_vs_bf16": speedup, "tflops": tflops, "note": note})
            save()

        if results and args.deadline is not None and time.perf_counter() - t_start > args.deadline:
            results[(d, n)] = {name: (float("nan"), NOT_MEASURED) for name in row_names(args.compiled, args.te)}
            for name in row_names(args.compiled, args.te):
                report(name, *results[(d, n)][name])
            continue
        results[(d, n)] = {}
        measured = measure_shape(d, n, args, cuda, _Recorder(results[(d, n)], report))
        results[(d, n)].update(measured)

    table = ["", "| variant | " + " | ".join(f"d={d} tok={n}" for d, n in shapes) + " |",
             "|---" * (len(shapes) + 1) + "|"]
    notes = {}
    for name in row_names(args.compiled, args.te):
        cells = []
        for s in shapes:
            ms, why = results[s][name]
            base = results[s]["bf16 nn.Linear"][0]
            cells.append(f"{ms:.3f} ({base / ms:.2f}x)" if ms == ms and base == base else "n/a")
            if why:
                notes[name] = why
        table.append(f"| {name} | " + " | ".join(cells) + " |")
    table += [f"# {name}: {why}" for name, why in notes.items()]
    record["seconds"] = round(time.perf_counter() - t_start, 1)
    save()
    print("\n".join(table), flush=True)
    return lines + table


class _Recorder:
    """The `report` that measure_shape calls: keeps each row in the shape's results first, so
    that the rows after `bf16 nn.Linear` get their speed-up as they are printed."""

    def __init__(self, results: dict, report):
        self.results, self.report = results, report

    def __call__(self, name, ms, note):
        self.results[name] = (ms, note)
        self.report(name, ms, note)


if __name__ == "__main__":
    main()
