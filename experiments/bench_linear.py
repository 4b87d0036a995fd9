"""Benchmark: one linear layer's forward+backward in each backend and format, against BF16.

On a GPU this measures the `torch` backend's real FP8 GEMMs (torch._scaled_mm) against
a plain BF16 nn.Linear at the same shape; on CPU it runs the same table in FP32.
Each row is the median over --repeats timed iterations (CUDA events on a GPU) of
`y = layer(x); y.backward(g)`; the ratio column is against the plain high-precision
layer measured in the same run. A `_scaled_mm`-only row gives the GEMM's ceiling.

    python experiments/bench_linear.py --d-model 4096 8192 --tokens 8192
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from lowprec.backends import get_backend
from lowprec.formats import get_format
from lowprec.layers import PrecisionLinear


def timed(fn, repeats: int, warmup: int, cuda: bool) -> float:
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--d-model", type=int, nargs="+", default=[1024])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--variants", nargs="*", default=None,
                   help="BACKEND:FORMAT[:fused][:nostats], e.g. torch:fp8_tensorwise:fused:nostats")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    name = torch.cuda.get_device_name() if cuda else "cpu"
    variants = args.variants or ["torch:fp8_tensorwise", "torch:fp8_tensorwise:fused",
                                 "torch:fp8_rowwise", "torch:fp8_rowwise:fused",
                                 "emulated:fp8_tensorwise", "emulated:fp8_tensorwise:fused"]
    print(f"# linear fwd+bwd, tokens={args.tokens}, {dtype}, {name}, torch {torch.__version__}, "
          f"median of {args.repeats}")
    print("| d_model | variant | ms | x high precision | TFLOP/s |")
    print("|---|---|---|---|---|")
    for d in args.d_model:
        torch.manual_seed(0)
        flops = 6 * args.tokens * d * d
        base = nn.Linear(d, d, device=dev, dtype=dtype)
        x = torch.randn(args.tokens, d, device=dev, dtype=dtype, requires_grad=True)
        g = torch.randn(args.tokens, d, device=dev, dtype=dtype)

        def step(layer):
            return lambda: layer(x).backward(g)

        ref_ms = timed(step(base), args.repeats, args.warmup, cuda)
        rows = [(f"plain nn.Linear ({str(dtype).replace('torch.', '')})", ref_ms)]
        if cuda:
            a = torch.randn(args.tokens, d, device=dev).to(torch.float8_e4m3fn)
            b = torch.randn(d, d, device=dev).to(torch.float8_e4m3fn)
            one = torch.ones((), device=dev)
            gemm3 = lambda: [torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one,  # noqa: E731
                                              out_dtype=torch.bfloat16) for _ in range(3)]
            rows.append(("3x torch._scaled_mm e4m3 only (GEMM ceiling)", timed(gemm3, args.repeats, args.warmup, cuda)))
        for v in variants:
            backend, fmt, *rest = v.split(":")
            fused = "fused" in rest
            stats = "nostats" not in rest
            try:
                layer = PrecisionLinear.from_module(base, get_format(fmt), get_backend(backend), fused=fused)
                layer.collect_stats = stats
                rows.append((f"lowprec {backend} {fmt}{' fused' if fused else ''}{' +stats' if stats else ''}",
                             timed(step(layer), args.repeats, args.warmup, cuda)))
            except Exception as e:  # report, keep measuring the others
                rows.append((f"lowprec {backend} {fmt}{' fused' if fused else ''}: FAILED "
                             f"{type(e).__name__}: {str(e)[:120]}", float("nan")))
        for label, ms in rows:
            print(f"| {d} | {label} | {ms:.3f} | {ms / ref_ms:.2f} | {flops / ms / 1e9:.1f} |")


if __name__ == "__main__":
    main()
