"""The reference experiment under torchrun: data x tensor parallel, pipeline parallel, or FSDP2.

    torchrun --nproc-per-node 4 -m experiments.train_parallel CONFIG --dp 2 --tp 2 --out DIR
    torchrun --nproc-per-node 2 -m experiments.train_parallel CONFIG --pp 2 --out DIR
    torchrun --nproc-per-node 2 -m experiments.train_parallel CONFIG --fsdp 2 --out DIR

The same config, precision plan and rollout controller as `lowprec run CONFIG`, through
the same loop (`lowprec.runtime.loop.train`); only the engine differs: the sharding of
`experiments/parallel.py` (the reference GPT's tensor-parallel plan and pipeline stages) or
`lowprec.runtime.fsdp.FullyShardedDP` (FSDP2, for any model).
Every rank runs one controller fed with the same global loss and gradient norm and the
monitor's combined statistics (one all-gather per check), so every rank takes the same
decisions; each writes them to `DIR/events.rank<R>.jsonl`. Rank 0 writes `DIR/losses.json`,
`DIR/grad_norms.json` and `DIR/summary.json` (mode, seconds per step, the final precision map).

DP x TP: `prepare(..., amax_group=<dp group>)`; tensor-wise amaxes of the DTensor shards
are reduced over the tp group by PrecisionLinear itself, so the numerics are the single
process's. Every dp rank reads rows dp_rank::dp of the same global batch.
FSDP2: `prepare(..., amax_group=<the world>)` first (same Parameters), then `fully_shard`
on every block and the root; every rank reads rows rank::world of the global batch.
PP: each rank prepares the whole model (so that the plan's and the rollout's selectors
see all of it), builds the controller over all sites, then keeps its own stage; the
monitor packs every site's row.

Rewinds: in-memory snapshots by default (each rank its shards or its stage: nothing is
gathered), under DP x TP, FSDP2 and pipeline parallelism alike; with `rollout.rewind.source: disk`
sharded checkpoints (`torch.distributed.checkpoint`) every `train.ckpt_every` steps.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from experiments.parallel import DataTensorParallel, ParallelConfig, Pipeline, local_state
from lowprec.config import LowprecConfig
from lowprec.policy.rollout import build_controller
from lowprec.runtime.data import as_batch_source
from lowprec.runtime.faults import parse_injection
from lowprec.runtime.fsdp import FullyShardedDP
from lowprec.runtime.loop import train
from lowprec.runtime.run import load_factory, read_baseline
from lowprec.sites.precision_state import prepare

__all__ = ["train_parallel", "main"]


def train_parallel(cfg: LowprecConfig | dict, out_dir: str | Path, par: ParallelConfig, *, steps: int | None = None,
                   injections=(), microbatches: int | None = None) -> dict:
    """Train as `cfg` says on the initialised process group; returns rank 0's summary."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != par.world:
        raise ValueError(f"{par.mode} needs {par.world} processes, torchrun started {world} "
                         f"(--nproc-per-node {par.world})")
    rc = cfg if isinstance(cfg, LowprecConfig) else LowprecConfig.from_dict(cfg)
    if microbatches is not None:
        rc = replace(rc, train=replace(rc.train, microbatches=microbatches))
    tc = rc.train
    if tc.batch_size % (tc.microbatches * par.data_ranks):
        raise ValueError(f"train.batch_size ({tc.batch_size}) must be a multiple of microbatches x data-parallel "
                         f"ranks ({tc.microbatches} x {par.data_ranks})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [Path.cwd()]
    torch.manual_seed(tc.seed)   # every rank builds the single process's initial model
    model = load_factory(rc.model.factory, "model.factory", paths)(**dict(rc.model.args or {}))
    unknown = [j.site for j in injections if j.kind.needs_site and j.site not in dict(model.named_modules())]
    if unknown:
        raise ValueError(f"--inject names no module of the model: {unknown}")
    tokens = load_factory(rc.data.factory, "data.factory", paths)(**dict(rc.data.args or {}))
    if par.pp > 1:
        state = prepare(model, rc.precision, seed=tc.seed)
        data = as_batch_source(tokens, batch_size=tc.batch_size, block_size=rc.data.block_size, seed=tc.seed)
    elif par.fsdp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (par.fsdp,), mesh_dim_names=("dp",))
        state = prepare(model, rc.precision, seed=tc.seed, amax_group=mesh.get_group())
        data = as_batch_source(tokens, batch_size=tc.batch_size, block_size=rc.data.block_size, seed=tc.seed,
                               rank=rank, world=par.fsdp)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (par.dp, par.tp), mesh_dim_names=("dp", "tp"))
        state = prepare(model, rc.precision, seed=tc.seed, amax_group=mesh.get_group("dp") if par.dp > 1 else None)
        data = as_batch_source(tokens, batch_size=tc.batch_size, block_size=rc.data.block_size, seed=tc.seed,
                               rank=mesh.get_local_rank("dp"), world=par.dp)
    ctl = build_controller(rc.rollout, state, model, baseline=read_baseline(rc))   # every site, forward order
    all_sites = list(ctl.order)
    if par.pp > 1:
        engine = Pipeline(model, rank, par.pp, tc.microbatches)
        state = local_state(state, [f for f, _ in engine.module.named_modules() if f in state.sites])
        del model   # this rank keeps its stage's modules only
    elif par.fsdp > 1:
        engine = FullyShardedDP(model, mesh_or_group=mesh, microbatches=tc.microbatches)
    else:
        engine = DataTensorParallel(model, mesh, tc.microbatches)
    disk = ctl.config.rewind and rc.rollout.rewind.source == "disk"
    ckpt_dir = out / "checkpoints"
    if disk and ckpt_dir.is_dir() and any(ckpt_dir.iterdir()):
        raise FileExistsError(f"{ckpt_dir} holds an earlier run's checkpoints, which a rewind would "
                              f"restore; parallel runs do not resume: use a new --out or remove them")
    res = train(tc, engine, state, data, out_dir=out, controller=ctl, rollout=rc.rollout, sites=all_sites,
                faults=list(injections), steps=steps, checkpoints=disk)
    summary = {"mode": par.mode, "world": world, "microbatches": tc.microbatches, **res.summary(),
               "steps": len(res.losses), "formats": dict(ctl.current)}
    if rank == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (alone, without --dp/--tp)")
    p.add_argument("--fsdp", type=int, default=1, help="FSDP2 ranks (alone, without --dp/--tp/--pp)")
    p.add_argument("--out", default="runs/train_parallel")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--microbatches", type=int, default=None,
                   help="overrides train.microbatches (the pipeline's microbatches; gradient "
                        "accumulation otherwise)")
    p.add_argument("--inject", action="append", default=[], metavar="KIND:SITE:START:STOP",
                   help="a fault (nan, overflow, lr_spike, loss_spike) as in `lowprec run`; repeatable")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per process")
    args = p.parse_args(argv)
    par = ParallelConfig(args.dp, args.tp, args.pp, args.fsdp)
    if "RANK" not in os.environ:
        raise SystemExit(f"start this under torchrun: torchrun --nproc-per-node {par.world} -m "
                         f"experiments.train_parallel {args.config} ...")
    torch.set_num_threads(args.threads)
    injections = [parse_injection(t) for t in args.inject]
    dist.init_process_group("gloo")
    try:
        summary = train_parallel(LowprecConfig.from_yaml(args.config), args.out, par, steps=args.steps,
                                 injections=injections, microbatches=args.microbatches)
        if dist.get_rank() == 0:
            print(f"{summary['mode']}: {summary['steps']} steps, {summary['seconds_per_step'] * 1e3:.0f} ms/step, "
                  f"{summary['events']} events; losses and events in {args.out}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
