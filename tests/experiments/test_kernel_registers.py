"""experiments/kernel_registers.py: the cast kernels compiled for sm_90 on this CPU, through
Triton's own launch path, and what ptxas made of them. Every variant -- tensor-wise, delayed
and row-wise, statistics off and on, each alone and as the input-and-weight pair an eager
step launches -- is listed, and none spills: the check step's statistics
once held enough FP64 tiles live per element to hit the 255-register cap and spill to the stack
(255 registers, 304 bytes of stack in the tensor-wise cubin). 2048x2048 gives the plan's
largest specialisation (1,024 partial maxima, as at d 8192) for little memory."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="TRITON_INTERPRET=1: the kernels are interpreted, not compiled")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from experiments import kernel_registers  # noqa: E402


def test_every_variant_compiles_for_sm90_without_spills():
    rows = kernel_registers.table(2048, 2048)
    assert [(r["variant"], r["stats"]) for r in rows] == [
        (v, s) for s in (False, True) for v in ("tensor-wise", "delayed", "row-wise")] + [
        (v, s) for s in (False, True) for v in ("tensor-wise pair", "delayed pair", "row-wise pair")]
    for r in rows:
        assert r["target"].startswith("sm_90"), r
        assert r["spill_st"] == r["spill_ld"] == 0, r
        assert r["built_stack"] == 0, r
        assert 0 < r["built_regs"] < 255, r
