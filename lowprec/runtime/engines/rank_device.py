"""Where a rank of `lowprec run` under torchrun trains: the process group's backend and the device.

    placed = rank_device(cfg.parallel.device, env.local_rank, torch.cuda.device_count())
    placed.backend   # Backend.NCCL or Backend.GLOO, for dist.init_process_group
    placed.device    # torch.device("cuda", LOCAL_RANK) or torch.device("cpu")

The one place that decides it, from the config's `parallel.device` and what torchrun tells
each worker (LOCAL_RANK, its index among the processes of its own node): `cuda` puts rank
LOCAL_RANK of each node on that node's GPU LOCAL_RANK, with NCCL, as torchtitan and
torchrun's examples do; `cpu` is gloo; `auto` is cuda where torch finds a CUDA device, else
cpu. Everything a rank builds (meshes, pipeline stages and their receive buffers, the loss
and statistics all-reduces, telemetry) takes its device from here; nothing names "cpu".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowprec.base.enums import StrEnum
from lowprec.base.parse import ConfigError
from lowprec.config.schema import RunDevice

__all__ = ["Backend", "RankDevice", "rank_device", "cuda_devices"]


class Backend(StrEnum):
    """The torch.distributed backend of a job."""
    NCCL = "nccl"
    GLOO = "gloo"


@dataclass(frozen=True)
class RankDevice:
    """A rank's process-group backend and the device it trains on."""
    backend: Backend
    device: torch.device

    @property
    def sums_only(self) -> bool:
        """gloo reduces with SUM, MAX, MIN, PRODUCT only (no AVG, no PREMUL_SUM): FSDP2 must be
        told to reduce its gradients as plain SUMs."""
        return self.backend is Backend.GLOO


def cuda_devices() -> int:
    """The CUDA devices torch finds on this machine (0 on a CPU build or without a GPU)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def rank_device(wanted: RunDevice | str, local_rank: int, cuda_devices: int) -> RankDevice:
    """The backend and device of the rank that is process `local_rank` of its node, on a node
    where torch finds `cuda_devices` CUDA devices; ConfigError when `wanted` cannot be had."""
    wanted = RunDevice(wanted)
    if wanted is RunDevice.AUTO:
        wanted = RunDevice.CUDA if cuda_devices > 0 else RunDevice.CPU
    if wanted is RunDevice.CPU:
        return RankDevice(Backend.GLOO, torch.device("cpu"))
    if cuda_devices == 0:
        raise ConfigError("parallel.device", "is cuda, and torch finds no CUDA device on this node (a CPU build "
                                             "of torch, or no GPU visible): set device: cpu (gloo) or auto")
    if not 0 <= local_rank < cuda_devices:
        raise ConfigError("parallel.device", (
            f"is cuda, and this is process {local_rank} of its node (LOCAL_RANK) with {cuda_devices} CUDA "
            f"devices: start at most {cuda_devices} processes per node (torchrun --nproc-per-node {cuda_devices})"))
    return RankDevice(Backend.NCCL, torch.device("cuda", local_rank))
