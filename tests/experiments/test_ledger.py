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
    assert by[("amax all-reduce, group scope", "lowprec")][0] == 33 * m.layers + 1
    assert by[("amax all-reduce, local scope", "lowprec")][0] == 5 * m.layers + 1
    assert dp == 64 // 8
    assert table().count("\n") == 1 + 2 * 2 * len(rows(m, 64))
