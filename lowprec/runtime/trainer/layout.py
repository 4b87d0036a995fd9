"""`lowprec plan`'s account of a config's `parallel:` section: the layout and how to launch it.

    for line in layout_lines(cfg, "job.yaml"):
        print(line)

    parallel: dp_shard 2 x tp 2 = 4 processes: FSDP2 over tensor-parallel shards
      mesh: (dp_shard 2, tp 2); 2 data-parallel ranks, each 4 rows of train.batch_size 8 ...
      launch: lowprec run --nproc-per-node 4 job.yaml --out DIR
          or: torchrun --nproc-per-node 4 -m lowprec.cli run job.yaml --out DIR
      on 2 machines (DIR on a filesystem both see): torchrun --nnodes 2 --nproc-per-node 2 ...

What it says is what `lowprec.runtime.engines.parallel.build_engine` builds for these degrees and
what `lowprec.runtime.engines.rank_device` decides for `parallel.device`; nothing here starts a process.
"""

from __future__ import annotations

import shlex

from lowprec.config.schema import RunDevice

__all__ = ["layout_lines"]

_DEVICE = {RunDevice.AUTO: "NCCL on cuda:LOCAL_RANK where torch finds a GPU, else gloo on the CPU",
           RunDevice.CUDA: "NCCL, each process on cuda:LOCAL_RANK of its machine",
           RunDevice.CPU: "gloo on the CPU"}


def _engine(par) -> tuple[str, list[tuple[str, int]]]:
    """(what runs, the mesh's dimensions) for the degrees of `par`."""
    if par.pp > 1:
        return (f"{par.pp} pipeline stages, one per process (GPipe over train.microbatches)", [("pp", par.pp)])
    tp = [("tp", par.tp)] if par.tp > 1 else []
    over = " over tensor-parallel shards" if par.tp > 1 else ""
    if par.dp_replicate > 1 and par.dp_shard > 1:
        return (f"HSDP (FSDP2 sharded over dp_shard, replicated over dp_replicate){over}",
                [("dp_replicate", par.dp_replicate), ("dp_shard", par.dp_shard), *tp])
    if par.dp_shard > 1:
        return f"FSDP2{over}", [("dp_shard", par.dp_shard), *tp]
    if par.dp_replicate > 1:
        return (f"replicated data parallel (gradients all-reduced){over}",
                [("dp_replicate", par.dp_replicate), *tp])
    return "tensor parallel", tp


def layout_lines(cfg, config_path: str) -> list[str]:
    """The layout of `cfg.parallel` and the commands that launch it; [] for one process."""
    par, tc = cfg.parallel, cfg.train
    if par.world == 1:
        return []
    what, dims = _engine(par)
    degrees = " x ".join(f"{k} {v}" for k, v in dims)
    lines = [f"parallel: {degrees} = {par.world} processes: {what}",
             "  mesh: (" + ", ".join(f"{k} {v}" for k, v in dims) + ")"]
    if par.data_ranks > 1:
        rows = tc.batch_size // par.data_ranks
        lines[-1] += (f"; {par.data_ranks} data-parallel ranks, each {rows} rows of train.batch_size "
                      f"{tc.batch_size}")
    if par.fp8_all_gather:
        lines.append("  FSDP2 all-gathers the weights of tensor-wise FP8 sites as FP8 (parallel.fp8_all_gather)")
    lines.append(f"  devices: {_DEVICE[par.device]} (parallel.device {par.device})")
    cfg_arg = shlex.quote(str(config_path))
    lines += [f"  launch: lowprec run --nproc-per-node {par.world} {cfg_arg} --out DIR",
              f"      or: torchrun --nproc-per-node {par.world} -m lowprec.cli run {cfg_arg} --out DIR"]
    if par.world % 2 == 0:
        lines.append(f"  on 2 machines, on each (DIR on a filesystem both see): torchrun --nnodes 2 --nproc-per-node "
                     f"{par.world // 2} --rdzv-backend c10d --rdzv-endpoint HOST:29400 --rdzv-id JOB -m lowprec.cli "
                     f"run {cfg_arg} --out DIR")
    return lines
