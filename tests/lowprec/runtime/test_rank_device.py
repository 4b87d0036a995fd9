"""`lowprec.runtime.engines.rank_device`: the backend and device a rank of `lowprec run` trains on."""

import pytest
import torch

from lowprec.base.parse import ConfigError
from lowprec.config import ParallelConfig
from lowprec.config.schema import RunDevice
from lowprec.runtime.engines.rank_device import Backend, rank_device


@pytest.mark.parametrize("wanted, local_rank, gpus, backend, device", [
    ("auto", 0, 0, Backend.GLOO, "cpu"),          # a CPU machine: gloo
    ("auto", 3, 8, Backend.NCCL, "cuda:3"),       # a GPU node: NCCL, this process's own GPU
    ("cuda", 1, 2, Backend.NCCL, "cuda:1"),
    ("cpu", 5, 8, Backend.GLOO, "cpu"),           # asked for the CPU on a GPU node
])
def test_backend_and_device_from_the_config_and_local_rank(wanted, local_rank, gpus, backend, device):
    placed = rank_device(RunDevice(wanted), local_rank, gpus)
    assert (placed.backend, placed.device) == (backend, torch.device(device))
    assert placed.sums_only == (backend is Backend.GLOO)   # FSDP2's SUM workaround: gloo only


def test_cuda_without_a_gpu_or_with_too_many_processes_is_a_config_error():
    with pytest.raises(ConfigError, match="finds no CUDA device.*device: cpu"):
        rank_device(RunDevice.CUDA, 0, 0)
    with pytest.raises(ConfigError, match="process 4 of its node.*4 CUDA devices.*--nproc-per-node 4"):
        rank_device(RunDevice.CUDA, 4, 4)


def test_parallel_device_is_parsed_and_checked_at_load():
    from lowprec.base.parse import parse
    assert parse(ParallelConfig, {"dp_shard": 2, "device": "cuda"}, "parallel").device is RunDevice.CUDA
    assert ParallelConfig().device is RunDevice.AUTO
    with pytest.raises(ConfigError, match="device"):
        parse(ParallelConfig, {"device": "tpu"}, "parallel")
