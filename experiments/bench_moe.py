"""One MoE layer's routed experts, forward + backward, at DeepSeek-V3-like expert shapes scaled to a
CPU: lowprec's grouped FP8 (emulated: one `torch._grouped_mm` per format group; each operand of a
group quantized in one call for all its experts, or expert by expert, the same numbers; with the
weights unchanged between calls, as here, both take them from the experts' weight caches, and
with the weights updated before every call, as in training, from one quantization or one per expert) against BF16-grid `torch._grouped_mm` (operands rounded to BF16, FP32
arithmetic: BF16 arithmetic is slow on CPUs), a loop of lowprec's linear sites over the experts,
and torchao's FP8 row-wise grouped GEMM where it runs. Prints one markdown table; docs/moe.md
publishes it. Times are this process's CPU time (`time.process_time`, one thread: on a shared
machine the waits for a core do not count).

    python -m experiments.bench_moe                       # hidden 1024, width 256, 16 experts, top 4
    python -m experiments.bench_moe --hidden 7168 --width 2048 --experts 256 --top-k 8   # DeepSeek-V3's (GPU)
    python -m experiments.bench_moe --interleaved --repeats 5   # one call against expert by expert, call by call
    python -m experiments.bench_moe --device cuda --hidden 7168 --width 2048 --experts 32 --top-k 8 --tokens 16384

On a GPU (`--device cuda`): BF16 operands and BF16 `torch._grouped_mm` as the baseline, lowprec's
experts on the `torch` backend (its grouped FP8 kernel, `torch._scaled_grouped_mm`, where a GEMM's
operands are E4M3 row-wise or tensor-wise: all three GEMMs in `fp8_rowwise_e4m3_pow2`, the forward
only in the hybrid `fp8_rowwise`), and torchao's FP8 row-wise grouped GEMM; wall time of
forward + backward with the device synchronized (CUDA events would hide the host's part).

DeepSeek-V3's experts are (hidden 7168, width 2048, 256 routed, top 8); the default keeps their
ratios of width to hidden (2/7 ~ 1/4) and of active experts to experts (1/32 ~ 1/4 at 16).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from lowprec.numerics.formats import get_format
from lowprec.sites.backends import get_backend
from lowprec.sites.experts import ExpertSite
from lowprec.sites.grouped_gemms import GroupedQuantizedFn
from lowprec.sites.grouped_scaled_mm import kernel_for
from lowprec.sites.layers import PrecisionLinear


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def _counts(tokens: int, experts: int, top_k: int, seed: int) -> tuple[int, ...]:
    """Tokens per expert of a softmax router over random logits (uneven, as real routing is)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randn(tokens, experts, generator=g).topk(top_k, dim=-1).indices
    return tuple(torch.bincount(idx.flatten(), minlength=experts).tolist())


def bf16_grouped(w13, w2, counts):
    return lambda x: _bf16_grouped(x, w13, w2, counts)


def _bf16_grouped(x, w13, w2, counts):
    offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
    if x.is_cuda:   # BF16 arithmetic on the GPU: the operands are BF16 already
        h = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs)
        g, u = h.chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(g) * u, w2.transpose(-2, -1), offs=offs)
    h = torch._grouped_mm(_bf16(x), _bf16(w13).transpose(-2, -1), offs=offs)
    g, u = h.chunk(2, dim=-1)
    return torch._grouped_mm(_bf16(F.silu(g) * u), _bf16(w2).transpose(-2, -1), offs=offs)


def lowprec_grouped(fmt_names, one_call: bool = True, backend_name: str = "emulated"):
    backend = get_backend(backend_name)

    def setup(w13, w2, counts):
        fmts = tuple(get_format(fmt_names[e % len(fmt_names)]) for e in range(len(counts)))
        sites = [ExpertSite(e, {"w13": tuple(w13.shape[1:]), "w2": tuple(w2.shape[1:])}, fmts[e], backend,
                            fqn=f"experts.{e}", seed=e, device=w13.device) for e in range(len(counts))]
        for s in sites:
            s.collect_stats = False
        return lambda x: _grouped(x, w13, w2, counts, fmts, sites, one_call)
    return setup


def _grouped(x, w13, w2, counts, fmts, sites, one_call):
    kernel, accum = kernel_for(sites[0].backend, x.device), sites[0].gemm.fast_accum()
    h = GroupedQuantizedFn.apply(x, w13, counts, fmts, tuple(s.operand_quantizer("w13") for s in sites), one_call,
                                 kernel, accum)
    g, u = h.chunk(2, dim=-1)
    return GroupedQuantizedFn.apply(F.silu(g) * u, w2, counts, fmts, tuple(s.operand_quantizer("w2") for s in sites),
                                    one_call, kernel, accum)


def updated(setup):
    """`setup`'s path with the weights updated in place before every call (a training step: every
    weight cache misses)."""
    def wrapped(w13, w2, counts):
        fn = setup(w13, w2, counts)

        def call(x):
            with torch.no_grad():
                w13.mul_(1.0)
                w2.mul_(1.0)
            return fn(x)
        return call
    return wrapped


def lowprec_loop(fmt_name):
    backend, fmt = get_backend("emulated"), get_format(fmt_name)

    def setup(w13, w2, counts):
        layers = [(PrecisionLinear(nn.Parameter(w13.detach()[e].clone()), None, fmt, backend, fqn=f"w13.{e}"),
                   PrecisionLinear(nn.Parameter(w2.detach()[e].clone()), None, fmt, backend, fqn=f"w2.{e}"))
                  for e in range(len(counts))]
        for a, b in layers:
            a.collect_stats = b.collect_stats = False
        return lambda x: _loop(x, layers, counts)
    return setup


def _loop(x, layers, counts):
    outs, start = [], 0
    for (a, b), c in zip(layers, counts):
        if c:
            g, u = a(x[start:start + c]).chunk(2, dim=-1)
            outs.append(b(F.silu(g) * u))
        start += c
    return torch.cat(outs)


def torchao_grouped(w13, w2, counts):
    return lambda x: _torchao(x, w13, w2, counts)


def _torchao(x, w13, w2, counts):
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm as mm
    offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
    h = mm(x.bfloat16(), w13.bfloat16().transpose(-2, -1), offs=offs)
    g, u = h.chunk(2, dim=-1)
    return mm((F.silu(g) * u).bfloat16(), w2.bfloat16().transpose(-2, -1), offs=offs)


def time_it(fn, x, gy, repeats: int, warmup: int, clock=time.perf_counter) -> float:
    """Median seconds of forward + backward (the weights' gradients accumulate: no matter here)."""
    times = []
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    for i in range(warmup + repeats):
        xg = x.detach().requires_grad_(True)
        sync()
        t0 = clock()
        fn(xg).float().backward(gy)
        sync()
        if i >= warmup:
            times.append(clock() - t0)
    return sorted(times)[len(times) // 2]


def interleaved(w13, w2, x, gy, counts, formats, calls: int) -> None:
    """One quantization call per operand against expert by expert, call by call in turn (the shared
    machine's load falls on both alike): min / median CPU ms of this process (`time.process_time`:
    one thread, so a shared machine's waits do not count) of `calls` calls after a warm-up each."""
    print("| format | weights | one call per operand, min / median CPU ms | expert by expert | one / loop (min) |\n"
          "|---|---|---:|---:|---:|")
    for name in formats:
        for label, wrap in (("unchanged (caches hit)", lambda s: s), ("updated every call", updated)):
            fns = [wrap(lowprec_grouped([name], one))(w13, w2, counts) for one in (True, False)]
            times = [[], []]
            for i in range(calls + 1):
                for fn, t in zip(fns, times):
                    t.append(time_it(fn, x, gy, 1, 0, time.process_time))
            (a, b) = [sorted(t[1:]) for t in times]
            print(f"| {name} | {label} | {a[0] * 1e3:.0f} / {a[len(a) // 2] * 1e3:.0f} | "
                  f"{b[0] * 1e3:.0f} / {b[len(b) // 2] * 1e3:.0f} | {a[0] / b[0]:.2f} |")


def gpu_table(a, w13, w2, x, gy, counts) -> None:
    """The GPU rows: BF16 grouped GEMM, lowprec's grouped FP8 kernel, torchao's; wall ms."""
    rows = [("BF16 torch._grouped_mm", bf16_grouped),
            ("lowprec grouped, fp8_rowwise_e4m3_pow2 (torch backend: FP8 kernel fprop, dgrad, wgrad)",
             updated(lowprec_grouped(["fp8_rowwise_e4m3_pow2"], backend_name="torch"))),
            ("lowprec grouped, fp8_rowwise (torch backend: FP8 kernel fprop; E5M2 gradients emulated)",
             updated(lowprec_grouped(["fp8_rowwise"], backend_name="torch"))),
            ("lowprec grouped, fp8_rowwise_e4m3_pow2, emulated (the same operands, FP32 GEMMs)",
             updated(lowprec_grouped(["fp8_rowwise_e4m3_pow2"]))),
            ("torchao FP8 row-wise grouped (_scaled_grouped_mm)", torchao_grouped)]
    print(f"experts {a.experts} (top {a.top_k}), hidden {a.hidden}, width {a.width}, {a.tokens} tokens -> "
          f"{sum(counts)} routed rows (min {min(counts)}, max {max(counts)} per expert); fwd+bwd, wall time with the "
          f"device synchronized, median of {a.repeats}, weights updated every call, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}\n")
    print("| path | ms | x BF16 |\n|---|---:|---:|")
    base = None
    for name, fn in rows:
        try:
            t = time_it(fn(w13, w2, counts), x, gy, a.repeats, a.warmup)
        except Exception as e:   # a library or kernel this GPU or build lacks: the row says so
            print(f"| {name} | n/a: {type(e).__name__}: {str(e).splitlines()[0][:90]} | |")
            continue
        base = base or t
        print(f"| {name} | {t * 1e3:.2f} | {t / base:.2f} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu (emulated rows, CPU time) or cuda (the GPU rows, wall time)")
    ap.add_argument("--interleaved", nargs="*", metavar="FORMAT",
                    help="instead: one call per operand against expert by expert, call by call, for these formats")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    counts = _counts(a.tokens, a.experts, a.top_k, seed=0)
    dev = torch.device(a.device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    x = torch.randn(sum(counts), a.hidden).to(dev, dt)
    w13 = nn.Parameter((torch.randn(a.experts, 2 * a.width, a.hidden) * a.hidden ** -0.5).to(dev, dt))
    w2 = nn.Parameter((torch.randn(a.experts, a.hidden, a.width) * a.width ** -0.5).to(dev, dt))
    gy = torch.randn(sum(counts), a.hidden).to(dev, dt)
    if dev.type == "cuda":
        gpu_table(a, w13, w2, x, gy, counts)
        return
    if a.interleaved is not None:
        interleaved(w13, w2, x, gy, counts, a.interleaved or ["fp8_tensorwise", "fp8_delayed", "fp8_rowwise", "mxfp8",
                                                              "nvfp4"], a.repeats)
        return
    rows = [("BF16 grid, torch._grouped_mm (FP32 arithmetic)", bf16_grouped),
            ("lowprec grouped, fp8_tensorwise (emulated), one quantization per operand", lowprec_grouped(["fp8_tensorwise"])),
            ("lowprec grouped, fp8_tensorwise (emulated), expert by expert", lowprec_grouped(["fp8_tensorwise"], False)),
            ("lowprec grouped, fp8_tensorwise, weights updated every call, one quantization per operand",
             updated(lowprec_grouped(["fp8_tensorwise"]))),
            ("lowprec grouped, fp8_tensorwise, weights updated every call, expert by expert",
             updated(lowprec_grouped(["fp8_tensorwise"], False))),
            ("lowprec grouped, fp8_rowwise (emulated), one quantization per operand", lowprec_grouped(["fp8_rowwise"])),
            ("lowprec grouped, fp8_rowwise (emulated), expert by expert", lowprec_grouped(["fp8_rowwise"], False)),
            ("lowprec grouped, mxfp8 (emulated), one quantization per operand", lowprec_grouped(["mxfp8"])),
            ("lowprec grouped, mxfp8 (emulated), expert by expert", lowprec_grouped(["mxfp8"], False)),
            ("lowprec grouped, half fp8_tensorwise / half mxfp8", lowprec_grouped(["fp8_tensorwise", "mxfp8"])),
            ("lowprec loop of linear sites, fp8_tensorwise", lowprec_loop("fp8_tensorwise")),
            ("torchao FP8 row-wise grouped (_scaled_grouped_mm)", torchao_grouped)]
    print(f"experts {a.experts} (top {a.top_k}), hidden {a.hidden}, width {a.width}, {a.tokens} tokens -> "
          f"{sum(counts)} routed rows (min {min(counts)}, max {max(counts)} per expert); fwd+bwd, CPU time, median of "
          f"{a.repeats}, torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| path | CPU ms | x BF16 grid |\n|---|---:|---:|")
    base = None
    for name, fn in rows:
        try:
            t = time_it(fn(w13, w2, counts), x, gy, a.repeats, a.warmup, time.process_time)
        except Exception as e:   # torchao's grouped FP8 GEMM needs CUDA
            print(f"| {name} | n/a: {type(e).__name__}: {str(e).splitlines()[0][:90]} | |")
            continue
        base = base or t
        print(f"| {name} | {t * 1e3:.1f} | {t / base:.2f} |")


if __name__ == "__main__":
    main()
