"""Which ranks a weight's amax is taken over under FP8 all-gather (`lowprec.sites.fp8_allgather.amax_groups`).

The whole path (FSDP2 x TP 2 under torchtitan's Trainer, each gathered weight one process's
cast of the whole weight) runs in tests/lowprec/integrations/test_torchtitan_trainer.py; this
holds the placement rule on a one-process mesh, in milliseconds.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def mesh(gloo, tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    gloo.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "tp"))
    gloo.destroy_process_group()


def test_the_amax_spans_every_sharded_mesh_dim_fsdp2s_strided_shard_included(mesh):
    """FSDP2 over a column-wise TP weight (tp-sharded on dim 0) places `_StridedShard` on dp,
    which torch 2.13 does not count as a `Shard`: c13c165 took such a weight's amax over tp only,
    so each dp rank scaled its FP8 bytes by its own amax."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import Partial, _StridedShard

    from lowprec.sites.fp8_allgather import amax_groups
    dp, tp = mesh.get_group(0), mesh.get_group(1)

    def groups(*placements):
        w = DTensor.from_local(torch.ones(4, 4), mesh, placements, run_check=False)
        return amax_groups(w)

    assert not _StridedShard(0, split_factor=2).is_shard()   # why `is_shard()` alone missed it
    assert groups(_StridedShard(0, split_factor=1), Shard(0)) == (dp, tp)   # column-wise TP under FSDP2
    assert groups(Shard(0), Shard(1)) == (dp, tp)                          # row-wise TP under FSDP2
    assert groups(Shard(0), Replicate()) == (dp,) and groups(Replicate(), Shard(1)) == (tp,)
    assert groups(Partial(), Shard(0)) == (tp,)   # partial sums are no shard of the weight
    assert amax_groups(None, group="given") == ("given",)
