"""Run a test file again in a fresh pytest process with Triton's interpreter on.

Triton decides whether its kernels are interpreted when they are defined (at import),
from TRITON_INTERPRET; the outer pytest process may already have imported Triton without
it. The fast-path tests therefore run twice: in the outer process the custom ops take the
reference quantizer (no interpreter), and `run_interpreted(__file__)` runs the same tests
where the ops run the Triton kernels on CPU tensors.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
HAVE_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def run_interpreted(test_file: str, min_passed: int) -> str:
    """Run `test_file` with TRITON_INTERPRET=1; assert it passed at least `min_passed` tests."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", test_file],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    passed = int(re.search(r"(\d+) passed", out).group(1))
    assert passed >= min_passed, out[-3000:]
    return out
