"""Benchmark (issue 43) of the compiled code on a CPU: registers and spills of the cast kernels.

A check step's `_ct_kernel` (statistics on) took 5.1x the plain step's on an H200
(docs/performance.md). This script compiles the cast kernels for sm_90 on a machine without
a GPU -- Triton's own launch path through `triton_nolaunch.nolaunch_driver`, the same
constexprs and specialisations the host code launches -- and reads what ptxas made of each:
registers per thread, spill stores and loads and the stack frame (`ptxas -v` over the
kernel's PTX, with the newest ptxas the Triton wheel ships), and the registers and stack of
the cubin Triton built itself (`cuobjdump -res-usage`: what a GPU would run; Triton passes
ptxas its own options). Variants: tensor-wise, delayed
and row-wise, statistics off and on, each alone and as the input-and-weight pair a layer's
eager step launches (`cast_pair`); BF16 input, E4M3, 64x64 tiles and the plan's warps.

    .venv/bin/python experiments/kernel_registers.py

Registers are capped at 255 a thread; past that ptxas spills to local memory (the stack),
which on a GPU is traffic through L1/L2 for every spilled value of every element.
Needs Triton with its NVIDIA backend (ptxas in the wheel); not under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile

import torch

try:   # one module object whoever imports it: Triton keeps a compiled kernel's launcher, bound to its driver
    from experiments.triton_nolaunch import nolaunch_driver
except ImportError:   # run as a script: its own folder goes on the path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from triton_nolaunch import nolaunch_driver  # noqa: E402

from lowprec.numerics.kernels import cast_pair, cast_transpose as ct  # noqa: E402
from lowprec.numerics.kernels.cast_pair_kernels import _ct_pair_kernel, _ct_row_pair_kernel  # noqa: E402
from lowprec.numerics.kernels.cast_transpose_kernels import _ct_kernel, _ct_row_kernel  # noqa: E402
from lowprec.numerics.kernels.fp8_cast import _element  # noqa: E402

_PTXAS_RE = re.compile(r"Used (\d+) registers.*")
_CUBIN_RE = re.compile(r"REG:(\d+) STACK:(\d+)")
_SPILL_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _ptxas() -> str:
    """The newest ptxas in the Triton wheel (the PTX Triton 3.9 writes needs ISA 9.x)."""
    import triton
    folder = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    found = sorted(glob.glob(os.path.join(folder, "ptxas*")), key=lambda p: "blackwell" not in p)
    if not found:
        raise SystemExit(f"no ptxas under {folder}: Triton's NVIDIA backend is needed")
    return found[0]


def _resources(ptx: str, ptxas: str) -> dict:
    """Registers, stack frame and spill bytes of the one kernel in `ptx`, from `ptxas -v`."""
    target = re.search(r"\.target (\S+)", ptx).group(1)
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        run = subprocess.run([ptxas, f"-arch={target}", "-v", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True, check=True)
    regs = _PTXAS_RE.search(run.stderr)
    spill = _SPILL_RE.search(run.stderr)
    return dict(target=target, regs=int(regs.group(1)), stack=int(spill.group(1)),
                spill_st=int(spill.group(2)), spill_ld=int(spill.group(3)))


def _cubin_usage(cubin: bytes, ptxas: str) -> dict:
    """Registers and stack frame of the cubin Triton itself built (`cuobjdump -res-usage`)."""
    cuobjdump = os.path.join(os.path.dirname(ptxas), "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        run = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True, check=True)
    found = _CUBIN_RE.search(run.stdout)
    return dict(built_regs=int(found.group(1)), built_stack=int(found.group(2)))


def _launched(cast) -> list:
    """(kernel, CompiledKernel) of every launch `cast(launch)` makes, each through Triton's own
    path (`kernel[grid]`, never a warm launch): the kernel that launch compiled, or found compiled
    already in this process, whichever ran before."""
    out = []

    def launch(kernel, grid, warm=None, vary=(), kw=None):
        run = kernel[grid]
        return lambda *args: out.append((kernel, run(*args, **(kw or {}))))
    cast(launch)
    return out


def _variants(m: int, n: int):
    """(name, stats, kernel, cast) of each variant: `cast(launch)` casts a fresh (m, n) BF16
    operand once, alone or (the pairs) beside an (m, n) FP32 weight, as a layer's eager step
    casts them together; `kernel` is the cast+transpose kernel whose figures the row gives."""
    e4m3 = _element("e4m3")
    x = torch.randn(m, n, dtype=torch.bfloat16)
    w = torch.randn(m, n, dtype=torch.float32)

    def history():
        st = ct.DelayedState(torch.zeros(16), torch.zeros((), dtype=torch.int64))
        return st.history, st.count, st.scratch, st.ticket
    for stats in (False, True):
        yield ("tensor-wise", stats, _ct_kernel,
               lambda launch, s=stats: ct.tensorwise(x, e4m3, True, s, launch, None, ct._TILE))
        yield ("delayed", stats, _ct_kernel,
               lambda launch, s=stats, h=history(): ct.delayed(x, e4m3, h, 0, False, None, 0, True, s, launch, None,
                                                               ct._TILE))
        yield ("row-wise", stats, _ct_row_kernel,
               lambda launch, s=stats: ct.rowwise(x, e4m3, True, s, launch, None, ct._TILE))
    for stats in (False, True):
        yield ("tensor-wise pair", stats, _ct_pair_kernel,
               lambda launch, s=stats: cast_pair.pair(x, w, e4m3, True, launch, stats=s))
        yield ("delayed pair", stats, _ct_pair_kernel,
               lambda launch, s=stats, a=history(), b=history(): cast_pair.pair(
                   x, w, e4m3, True, launch, delayed=(a, b, 0, False, None), stats=s))
        yield ("row-wise pair", stats, _ct_row_pair_kernel,
               lambda launch, s=stats: cast_pair.pair(x, w, e4m3, True, launch, stats=s, rowwise=True))


def table(m: int = 8192, n: int = 8192) -> list[dict]:
    """One row per variant: its kernel, statistics on or off, warps and ptxas's figures."""
    ptxas = _ptxas()
    rows = []
    with nolaunch_driver(record=False):
        for name, stats, kernel, cast in _variants(m, n):
            for ck in [ck for k, ck in _launched(cast) if k is kernel]:
                rows.append(dict(variant=name, stats=stats, kernel=kernel.__name__,
                                 warps=ck.metadata.num_warps, **_resources(ck.asm["ptx"], ptxas),
                                 **_cubin_usage(ck.asm["cubin"], ptxas)))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8192, help="rows of the operand (default 8192: the profile's d 8192 step)")
    ap.add_argument("--cols", type=int, default=8192, help="columns of the operand (default 8192)")
    args = ap.parse_args(argv)
    rows = table(args.rows, args.cols)
    print(f"ptxas: {os.path.basename(_ptxas())}, target {rows[0]['target'] if rows else '?'}")
    print(f"{'variant':<16} {'stats':<5} {'kernel':<19} {'warps':>5} {'regs':>5} {'stack B':>8} "
          f"{'spill st B':>10} {'spill ld B':>10} {'built regs':>10} {'built stack B':>13}")
    for r in rows:
        print(f"{r['variant']:<16} {'on' if r['stats'] else 'off':<5} {r['kernel']:<19} {r['warps']:>5} "
              f"{r['regs']:>5} {r['stack']:>8} {r['spill_st']:>10} {r['spill_ld']:>10} {r['built_regs']:>10} "
              f"{r['built_stack']:>13}")


if __name__ == "__main__":
    main()
