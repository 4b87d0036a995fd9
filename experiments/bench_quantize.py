"""Benchmark: fake-quantization of a 4096x4096 FP32 tensor, as ratios to a memory copy.

Prints one table: the median time (over --repeats runs, after warm-up) of a plain
copy into an existing buffer, the naive route `(x*s).to(float8_e4m3fn).to(float32)/s`,
and every lowprec quantizer with and without statistics, eager and fused
(torch.compile). Run: `python experiments/bench_quantize.py` (see docs/performance.md).

On a GPU (`--device cuda`, e.g. with `--dtype bfloat16`), the FP8 formats with
tensor-wise, delayed and row-wise scaling also get `triton` rows: lowprec.numerics.kernels'
fused casts to FP8 storage plus scale_inv (what the `torch` backend hands to
torch._scaled_mm; no dequantization, unlike the fake-quantization rows), with and
without statistics. Elsewhere those rows are left out, with the reason printed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from lowprec.numerics.formats import FORMATS, Scaling
from lowprec.numerics.quantize import fake_quantize


def median_ms(fn, repeats: int, warmup: int = 2) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--no-fused", action="store_true", help="skip torch.compile'd variants")
    p.add_argument("--formats", nargs="*", default=None, help="format names (default: all)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (the triton rows need cuda)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="input dtype")
    p.add_argument("--json", metavar="PATH", help="also write the rows to PATH")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    x = torch.randn(args.size, args.size).to(device=args.device, dtype=getattr(torch, args.dtype))
    buf = torch.empty_like(x)
    rows: list[tuple[str, float]] = []
    copy_ms = median_ms(lambda: buf.copy_(x), args.repeats)
    rows.append(("memory copy (into existing buffer)", copy_ms))
    rows.append(("clone (allocates)", median_ms(lambda: x.clone(), args.repeats)))

    def naive():
        s = 448.0 / x.abs().amax()
        return (x * s).to(torch.float8_e4m3fn).to(torch.float32) / s
    rows.append(("naive (x*s).to(e4m3).float()/s", median_ms(naive, args.repeats)))

    names = args.formats or [n for n, f in FORMATS.items() if not f.is_high_precision]
    delayed_scale = torch.tensor(448.0 / 5.0, device=x.device)
    kernels, why_not = _triton_kernels(x)
    for name in names:
        fmt = FORMATS[name]
        for role in ("input", "weight") if name == "nvfp4" else ("input",):
            spec = getattr(fmt, role)
            kw = {"scale": delayed_scale} if spec.scaling is Scaling.DELAYED else {}
            if spec.rounding.value == "stochastic":
                kw["generator"] = torch.Generator().manual_seed(0)
            label = f"{name} {role} ({spec.element.name}, {spec.scaling.value}"
            label += f" {spec.block[0]}x{spec.block[1]})" if spec.scaling is Scaling.BLOCK else ")"
            for fused in (False, True) if not args.no_fused else (False,):
                for stats in (False, True):
                    tag = f"{label}{' fused' if fused else ''}{' +stats' if stats else ''}"
                    fn = lambda: fake_quantize(x, spec, stats=stats, fused=fused, **kw)  # noqa: E731
                    rows.append((tag, median_ms(fn, args.repeats)))
            if kernels is not None and _triton_fits(spec):
                for stats in (False, True):
                    fn = _triton_cast(kernels, x, spec, delayed_scale, stats)
                    rows.append((f"{label} triton{' +stats' if stats else ''}", median_ms(fn, args.repeats)))

    dev = torch.cuda.get_device_name(x.device) if x.is_cuda else (platform.processor() or platform.machine())
    head = (f"# {args.size}x{args.size} {args.dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"{dev}, median of {args.repeats}")
    print(head)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": head.removeprefix("# "), "device": dev, "size": args.size, "dtype": args.dtype,
                       "torch": torch.__version__, "triton_rows_left_out": why_not,
                       "rows": [{"operation": label, "ms": ms, "x_copy": ms / copy_ms} for label, ms in rows]},
                      f, indent=1)
    if why_not:
        print(f"# triton rows left out: {why_not}")
    width = max(len(r[0]) for r in rows)
    print(f"| {'operation':<{width}} | {'ms':>8} | {'x copy':>7} |")
    print(f"|{'-' * (width + 2)}|{'-' * 10}|{'-' * 9}|")
    for label, ms in rows:
        print(f"| {label:<{width}} | {ms:8.2f} | {ms / copy_ms:7.2f} |")


def _triton_kernels(x: torch.Tensor):
    """(lowprec.numerics.kernels, None) where the fused Triton casts can run on x, else (None, why)."""
    try:
        import lowprec.numerics.kernels as kernels
    except ImportError as e:
        return None, str(e)
    if not kernels.kernels_available(x):
        return None, f"the kernels need a CUDA tensor (or TRITON_INTERPRET=1), x is on {x.device}"
    return kernels, None


def _triton_fits(spec) -> bool:
    return (spec.element.torch_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
            and spec.scaling in (Scaling.TENSOR, Scaling.DELAYED, Scaling.ROW))


def _triton_cast(kernels, x, spec, delayed_scale, stats: bool):
    if spec.scaling is Scaling.ROW:
        return lambda: kernels.cast_rowwise(x, spec.element, stats=stats)
    if spec.scaling is Scaling.TENSOR:
        return lambda: kernels.cast_tensorwise(x, spec.element, stats=stats)
    return lambda: kernels.cast_delayed(x, spec.element, delayed_scale, stats=stats)


if __name__ == "__main__":
    main()
