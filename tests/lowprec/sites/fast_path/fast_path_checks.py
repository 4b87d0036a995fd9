"""Shared checks of the fast-path tests: statistics compared with their stated tolerance,
the `use_fast_accum` of each `_scaled_mm` a step ran, and a test file run again in a
fresh pytest process with Triton's interpreter on.

Triton decides whether its kernels are interpreted when they are defined (at import),
from TRITON_INTERPRET; the outer pytest process may already have imported Triton without
it. The fast-path tests therefore run twice: in the outer process the custom ops take the
reference quantizer (no interpreter), and `run_interpreted(files)` runs the same tests
where the ops run the Triton kernels on CPU tensors (one process for INTERPRETED_FILES).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[4]
HAVE_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


# The files whose tests run again under the interpreter, with the fewest tests each must pass there;
# one pytest process runs them all (test_fp8_ops.py::test_fast_path_files_under_interpreter).
INTERPRETED_FILES = {"test_fp8_ops.py": 16, "test_fp8_linear.py": 12, "test_fast_path_traffic.py": 12}


def run_interpreted(files: dict[str, int]) -> str:
    """Run the test files (names in this folder: the fewest tests each must pass) in one pytest
    process with TRITON_INTERPRET=1; assert that every one passed at least that many."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    paths = [str(Path(__file__).with_name(name)) for name in files]
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-x", *paths],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    for name, min_passed in files.items():
        passed = len(re.findall(rf"^PASSED \S*{re.escape(name)}::", out, flags=re.MULTILINE))
        assert passed >= min_passed, (name, passed, out[-3000:])
    return out


class ScaledMMFlags(TorchDispatchMode):
    """A dispatch mode (`with ScaledMMFlags() as calls:`) recording the `use_fast_accum` of
    every aten._scaled_mm call, forward and backward, in order (`calls.fast_accum`)."""

    def __init__(self):
        super().__init__()
        self.fast_accum: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._scaled_mm.default:
            self.fast_accum.append(bool(kwargs.get("use_fast_accum", args[7] if len(args) > 7 else False)))
        return func(*args, **kwargs)


EXACT_FIELDS = ("amax", "saturated", "underflow", "nonfinite", "numel")


def assert_same_stats(got, want) -> None:
    """Packed QuantStats `got` against `want`: counts and amax exactly; the sums to 1e-6
    relative plus what one FP32 rounding of each dequantized value allows: `quantize`
    dequantizes (q / scale) in FP32, the kernels in FP64, so dq_i may differ by 2**-24 |x_i|,
    which moves sum (dq - x)**2 by at most 2**-23 sqrt(sq_error * signal_power)
    (Cauchy-Schwarz) and a square by 2**-46 x**2; `quantize`'s squares below 2**-150 of
    amax**2 flush to zero (documented there)."""
    from lowprec.numerics.quant_stats import QuantStats
    names = QuantStats.FIELDS
    got, want = [float(v) for v in got], [float(v) for v in want]
    power, err = want[names.index("signal_power")], want[names.index("sq_error")]
    floor = 2.0 ** -46 * abs(power) + 2.0 ** -22 * (max(err, 0.0) * abs(power)) ** 0.5
    for f, a, b in zip(names, got, want):
        if f in EXACT_FIELDS:
            assert a == b, (f, a, b)
        elif b == b and abs(b) != float("inf") and abs(power) != float("inf"):
            assert abs(a - b) <= 1e-6 * abs(b) + floor, (f, a, b)
