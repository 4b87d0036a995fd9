"""experiments/ledger.py's classes and experiments/distributed_paper.py's arithmetic.

The ledger's recording of real collectives is tested under torchrun
(tests/lowprec/sites/fast_path/test_fast_path_distributed.py, the `ledger:*` variants)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments.distributed_paper import MODELS, rows, table  # noqa: E402
from experiments.ledger import Collective, CollectiveLedger  # noqa: E402


@pytest.mark.parametrize("c,role,critical", [
    (Collective("all_reduce", "MAX", 4, "fwd_bwd", False), "amax_all_reduce", True),
    (Collective("all_reduce", "SUM", 4, "fwd_bwd", True), "tp_all_reduce", True),
    (Collective("all_reduce", "SUM", 4, "fwd_bwd", False), "step_all_reduce", False),
    (Collective("all_gather", "", 64, "fwd_bwd", False), "weight_all_gather", False),
    (Collective("all_gather", "", 64, "fwd_bwd", True), "tp_all_gather", True),
    (Collective("reduce_scatter", "SUM", 64, "fwd_bwd", False), "grad_reduce_scatter", False),
    (Collective("all_gather", "", 900, "check", False), "stats_all_gather", False),
])
def test_roles_and_critical_path(c, role, critical):
    assert (c.role, c.critical) == (role, critical)


def test_table_sums_per_role():
    ledger = CollectiveLedger()
    ledger.entries += [Collective("all_reduce", "MAX", 4, "fwd_bwd", False)] * 3 + [
        Collective("all_gather", "", 100, "fwd_bwd", False), Collective("all_gather", "", 28, "check", False)]
    assert ledger.table() == {"amax_all_reduce": (3, 12, 3), "stats_all_gather": (1, 28, 0),
                              "weight_all_gather": (1, 100, 0)}
    assert ledger.table("check") == {"stats_all_gather": (1, 28, 0)}


def test_paper_fp8_gather_halves_the_block_weights():
    m = MODELS[0]
    by = {(name, recipe): (n, b) for name, recipe, n, b in rows(m, 64)}
    dp, ring = 8, 7 / 8
    blocks = sum(m.site_elems) * m.layers / 8
    other = 2 * m.vocab * m.d / 8
    assert by[("FSDP weight all-gather", "bf16")][1] == pytest.approx(2 * ring * (2 * blocks + 2 * other))
    assert by[("FSDP weight all-gather", "lowprec")][1] == pytest.approx(2 * ring * (blocks + 2 * other))
    assert by[("amax all-reduce, group scope", "lowprec")][0] == 20 * m.layers + 1
    assert by[("amax all-reduce, local scope (default)", "lowprec")][0] == 2 * m.layers + 1
    assert dp == 64 // 8
    assert table().count("\n") == 1 + 2 * 2 * len(rows(m, 64))


def test_amax_count_model():
    from experiments.amax_count import SiteLayout, Split, amax_all_reduces, torchao_amax_all_reduces
    from experiments.distributed_paper import amax_rows, amax_table
    dp_sites = [SiteLayout(Split.NONE)] * 16                     # the ledger's GPT under FSDP2
    assert [amax_all_reduces(dp_sites, scope=s, dp=True, fp8_all_gather=f) for s in ("local", "group")
            for f in (False, True)] == [0, 1, 32, 33]
    tp_sites = [SiteLayout(Split.COL), SiteLayout(Split.ROW)] * 8  # FSDP2 x TP: qkv, fc column-, projs row-parallel
    assert [amax_all_reduces(tp_sites, scope="group", dp=True, fp8_all_gather=f) for f in (False, True)] == [64, 49]
    assert amax_all_reduces(tp_sites, scope="local", dp=True, fp8_all_gather=False) == 0
    qkv = [SiteLayout(Split.SP, "x")] * 3                         # 3 SP sites reading one input, TP only
    assert amax_all_reduces(qkv, scope="local", dp=False, fp8_all_gather=False) == 1
    assert amax_all_reduces(qkv, scope="group", dp=False, fp8_all_gather=False) == 1 + 3 + 3
    assert amax_all_reduces(qkv, scope="group", dp=True, fp8_all_gather=True) == 2 + 2 * 3 + 1
    assert torchao_amax_all_reduces(qkv + [SiteLayout(Split.SP, "h")] * 2, fp8_all_gather=True) == 3
    with pytest.raises(ValueError, match="scope must be"):
        amax_all_reduces(qkv, scope="global", dp=True, fp8_all_gather=False)
    for m, layers in zip(MODELS, (32, 80)):
        a = amax_rows(m)
        assert a == {"local": 2 * layers + 1, "group": 20 * layers + 1, "torchao": 2 * layers + 1}
        assert a["local"] <= 1.2 * a["torchao"]                  # issue 52: the default at most 1.2x torchao's
    assert amax_table().count("1.00x") == 4
