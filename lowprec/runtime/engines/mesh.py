"""The one DeviceMesh of a job under torchrun, for every layout, and the data-parallel ranks in it.

    mesh = build_mesh(device, dp_replicate=2, dp_shard=2, tp=2)   # 8 processes
    mesh["tp"]                              the tensor-parallel ranks (model.tensor_parallel)
    mesh["dp_replicate", "dp_shard"]        FSDP2's 2-D mesh: HSDP; dp_shard 1 is replicated DP
    mesh["pp"]                              the pipeline stages
    data_group(mesh), data_rank(mesh)       this rank's data-parallel ranks, its index among them

Every layout of `lowprec run` (`lowprec.runtime.engines.parallel.build_engine`) is one 4-D mesh
(pp, dp_replicate, dp_shard, tp) on the run's device type (`lowprec.runtime.engines.rank_device`),
its degrees the config's (`lowprec.config.ParallelConfig`); a degree of 1 is a dimension of
size 1. Data parallelism of any kind is FSDP2 on the (dp_replicate, dp_shard) sub-mesh, as
torchtitan composes it: sharded over dp_shard, replicated over dp_replicate.
"""

from __future__ import annotations

import torch

__all__ = ["MESH_DIMS", "build_mesh", "flat_group", "data_group", "data_rank"]

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def build_mesh(device: torch.device | str, *, pp: int = 1, dp_replicate: int = 1, dp_shard: int = 1, tp: int = 1):
    """The job's mesh over every rank of the initialised process group, on `device`'s type
    (the rank's own device: `cuda:LOCAL_RANK` or the CPU)."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(torch.device(device).type, (pp, dp_replicate, dp_shard, tp), mesh_dim_names=MESH_DIMS)


def flat_group(mesh):
    """The process group of every rank of `mesh` (any number of dimensions), this rank's slice."""
    if mesh.ndim == 1:
        return mesh.get_group()
    return mesh._flatten("_".join(mesh.mesh_dim_names)).get_group()   # no public flatten in torch 2.13


def data_group(mesh):
    """The process group of this rank's data-parallel ranks (dp_replicate x dp_shard, one per tp
    rank): where the loss and the activations' amaxes are summed and reduced."""
    return flat_group(mesh["dp_replicate", "dp_shard"])


def data_rank(mesh) -> int:
    """This rank's index among its data-parallel ranks: which rows of the global batch it reads."""
    return mesh.get_local_rank("dp_replicate") * mesh["dp_shard"].size() + mesh.get_local_rank("dp_shard")
