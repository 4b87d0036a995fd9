"""Benchmark: fake-quantization of a 4096x4096 FP32 tensor, as ratios to a memory copy.

Prints one table: the median time (over --repeats runs, after warm-up) of a plain
copy into an existing buffer, the naive route `(x*s).to(float8_e4m3fn).to(float32)/s`,
and every lowprec quantizer with and without statistics, eager and fused
(torch.compile). Run: `python experiments/bench_quantize.py` (see docs/performance.md).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from lowprec.formats import FORMATS, Scaling
from lowprec.quantize import fake_quantize


def median_ms(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--no-fused", action="store_true", help="skip torch.compile'd variants")
    p.add_argument("--formats", nargs="*", default=None, help="format names (default: all)")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    x = torch.randn(args.size, args.size)
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
    delayed_scale = torch.tensor(448.0 / 5.0)
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

    print(f"# {args.size}x{args.size} fp32, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}, median of {args.repeats}")
    width = max(len(r[0]) for r in rows)
    print(f"| {'operation':<{width}} | {'ms':>8} | {'x copy':>7} |")
    print(f"|{'-' * (width + 2)}|{'-' * 10}|{'-' * 9}|")
    for label, ms in rows:
        print(f"| {label:<{width}} | {ms:8.2f} | {ms / copy_ms:7.2f} |")


if __name__ == "__main__":
    main()
