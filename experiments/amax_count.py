"""How many amax all-reduces one rank issues per training step: the count model of the ledger.

    python -m experiments.distributed_paper     # uses it for Llama 8B and 70B at scale

A site is described by how tensor parallelism splits its GEMM (`Split`) and, for a
sequence-parallel site, which input it reads (sites reading one input share one reduced
amax: `lowprec.sites.shared_amax`). `amax_all_reduces` counts, for one forward and backward
of tensor-wise FP8 sites, the MAX all-reduces lowprec's code issues (lowprec.sites.fp8_parallel,
lowprec.sites.fp8_sequence, lowprec.runtime.engines.fsdp_fp8), one per group an amax is reduced over:

* `local` (the default): an SP input's amax over TP, once per distinct input; nothing else
  per site;
* `group`: the input and the output gradient over the data-parallel group, and every operand
  over the TP groups that split it: a column-parallel site's weight (rows) and output
  gradient (columns), a row-parallel site's input (columns) and weight (columns), an SP
  site's input (once per distinct input), weight and output gradient;
* either scope: the FP8-gathered weights' amaxes (FSDP2 with FP8 all-gather) in one
  all-reduce per step; a weight gathered in FP8 is not reduced again by its site.

The torchrun tests hold the code to this model (tests/lowprec/sites/fast_path/
test_fast_path_distributed.py: the ledger of real collectives equals `amax_all_reduces` for
the test's GPT under FSDP2 and for three SP sites reading one input).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Split", "SiteLayout", "amax_all_reduces", "torchao_amax_all_reduces"]


class Split(enum.Enum):
    NONE = "none"   # not split by TP (pure data parallelism)
    COL = "col"     # column-parallel: weight rows split, input replicated
    ROW = "row"     # row-parallel: weight columns and input columns split
    SP = "sp"       # column-parallel on a sequence-sharded input, gathered as FP8 bytes


@dataclass(frozen=True)
class SiteLayout:
    split: Split
    reads: str = ""   # the input an SP site reads; SP sites reading one input share its amax


def amax_all_reduces(sites: list[SiteLayout], *, scope: str, dp: bool, fp8_all_gather: bool) -> int:
    """MAX all-reduces per step on one rank. dp: the activations' amaxes have a data-parallel
    group (`prepare(..., amax_group=...)` with more than one rank in it)."""
    if scope not in ("local", "group"):
        raise ValueError(f"scope must be 'local' or 'group', got {scope!r}")
    d = int(dp and scope == "group")
    sp_inputs = {s.reads for s in sites if s.split is Split.SP}
    n = len(sp_inputs) * (1 + d)                                  # SP inputs: TP (+ DP), shared
    if scope == "group":
        weights = 0 if fp8_all_gather else 1                       # a TP-split weight, over TP
        for s in sites:
            if s.split is Split.NONE:
                n += 2 * d                                         # input, output gradient over DP
            elif s.split is Split.COL:
                n += d + weights + (1 + d)                         # input DP; weight TP; grad TP + DP
            elif s.split is Split.ROW:
                n += (1 + d) + weights + d                         # input TP + DP; weight TP; grad DP
            else:
                n += weights + (1 + d)                             # weight TP; grad TP + DP
    return n + int(fp8_all_gather)


def torchao_amax_all_reduces(sites: list[SiteLayout], *, fp8_all_gather: bool) -> int:
    """torchao's float8 training (tensor-wise, dynamic): each rank's own amaxes, one TP amax
    all-reduce per `Float8ColwiseParallel` SP input (a shared input cast once), and
    `precompute_float8_dynamic_scale_for_fsdp`'s one all-reduce per step. A lower bound:
    `Float8RowwiseParallel` casts its input, and both styles their output gradient, as
    DTensors (torchao/float8/float8_tensor_parallel.py), whose `torch.max(torch.abs(x))` is
    reduced over the shards when the scale is formed; those are not counted here."""
    return len({s.reads for s in sites if s.split is Split.SP}) + int(fp8_all_gather)
