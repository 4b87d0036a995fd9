"""The reference experiment under torchrun: data x tensor parallel, or pipeline parallel.

    torchrun --nproc-per-node 4 -m experiments.train_parallel CONFIG --dp 2 --tp 2 --out DIR
    torchrun --nproc-per-node 2 -m experiments.train_parallel CONFIG --pp 2 --out DIR

The same config, precision plan and rollout controller as `experiments/train.py`, with
the loop pieces of that module (batches, learning-rate schedule, microbatches, fault
injection). The sharding is `experiments/parallel.py`'s. Every rank runs one controller
fed with the same global loss and gradient norm and the monitor's combined statistics
(one all-gather per check), so every rank takes the same decisions; each writes them to
`DIR/events.rank<R>.jsonl`. Rank 0 writes `DIR/losses.json` (the global batch-mean loss
per step), `DIR/grad_norms.json` (the global gradient norm before clipping, per step) and
`DIR/summary.json` (mode, seconds per step, the final precision map).

DP x TP: `prepare(..., amax_group=<dp group>)`; tensor-wise amaxes of the DTensor shards
are reduced over the tp group by PrecisionLinear itself, so the numerics are the single
process's. Every dp rank reads rows dp_rank::dp of the same global batch.
PP: each rank prepares the whole model (so that the plan's and the rollout's selectors
see all of it), builds the controller over all sites, then keeps its own stage; the
monitor packs every site's row (`RolloutSession(sites=...)`).

Rewinds (DP x TP): with `rollout.rewind.enabled`, sharded checkpoints are written every
`train.ckpt_every` steps to `DIR/checkpoints` (`torch.distributed.checkpoint`: every rank
its shards, its precision and controller state) and a rewind restores them as
`experiments/train.py` does, the first at step 0 as there. Under
pipeline parallelism rewinds are off (a printed note): lowprec.checkpoint saves the
optimizer's param_groups as one object that DCP keeps once for all ranks, so a stage
would get another stage's parameter list back. There is no --resume.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from experiments.model import build_gpt
from experiments.parallel import DataTensorParallel, ParallelConfig, Pipeline, local_state
from experiments.train import (Injection, TrainConfig, _install, load, lr_at, parse_injection, rewind,
                               rollout_section, train_batches)
from lowprec import prepare
from lowprec.checkpoint import save_checkpoint
from lowprec.controller import Action
from lowprec.plan import PrecisionPlan
from lowprec.rollout import RolloutConfig, RolloutSession, build_controller

__all__ = ["train_parallel", "main"]


def _rollout_spec(cfg: dict, par: ParallelConfig, rank: int) -> RolloutConfig:
    """The rollout section; under pipeline parallelism with rewinds off (see the docstring)."""
    spec = rollout_section(cfg)
    if par.pp > 1 and spec.rewind.enabled:
        if rank == 0:
            print("note: rewinds are off under pipeline parallelism (the stages' sharded checkpoints "
                  "do not restore the optimizer yet); the controller rolls stages back without "
                  "rewinding", flush=True)
        spec = dataclasses.replace(spec, rewind=dataclasses.replace(spec.rewind, enabled=False))
    return spec


def train_parallel(cfg: dict, out_dir: str | Path, par: ParallelConfig, *, steps: int | None = None,
                   injections: list[Injection] = (), microbatches: int | None = None) -> dict:
    """Train as `cfg` says on the initialised process group; returns rank 0's summary."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != par.world:
        raise ValueError(f"{par.mode} needs {par.world} processes, torchrun started {world} "
                         f"(--nproc-per-node {par.world})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tc = TrainConfig(**{**(cfg.get("train") or {}),
                        **({"microbatches": microbatches} if microbatches is not None else {})})
    if tc.batch_size % (tc.microbatches * par.dp):
        raise ValueError(f"train.batch_size ({tc.batch_size}) must be a multiple of microbatches x dp "
                         f"({tc.microbatches} x {par.dp})")
    n_steps = steps if steps is not None else tc.steps
    torch.manual_seed(tc.seed)   # every rank builds the single process's initial model
    model = build_gpt(**cfg["model"].get("args", {}))
    unknown = [j.site for j in injections if j.kind != "lr_spike" and j.site not in dict(model.named_modules())]
    if unknown:
        raise ValueError(f"--inject names no module of the model: {unknown}")
    if par.pp > 1:
        state = prepare(model, PrecisionPlan.from_dict(cfg["precision"]), seed=tc.seed)
        engine = Pipeline(model, rank, par.pp, tc.microbatches)
        data = train_batches(tc, model.cfg.block_size)   # stage 0 uses x, the last stage y
    else:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (par.dp, par.tp), mesh_dim_names=("dp", "tp"))
        dp_rank = mesh.get_local_rank("dp")
        state = prepare(model, PrecisionPlan.from_dict(cfg["precision"]), seed=tc.seed,
                        amax_group=mesh.get_group("dp") if par.dp > 1 else None)
        data = train_batches(tc, model.cfg.block_size, rank=dp_rank, world=par.dp)
    spec = _rollout_spec(cfg, par, rank)
    ctl = build_controller(spec, state, model)   # every site, forward order
    all_sites = list(ctl.order)
    ckpt_dir = out / "checkpoints"
    if ctl.config.rewind and ckpt_dir.is_dir() and any(ckpt_dir.iterdir()):
        raise FileExistsError(f"{ckpt_dir} holds an earlier run's checkpoints, which a rewind would "
                              f"restore; parallel runs do not resume: use a new --out or remove them")
    if par.pp > 1:
        local = engine.module
        state = local_state(state, [f for f, _ in local.named_modules() if f in state.sites])
        del model   # this rank keeps its stage's modules only
    else:
        engine = DataTensorParallel(model, mesh, tc.microbatches)
        local = model
    session = RolloutSession(state, ctl, monitor=spec.monitor_config(),
                             event_log=out / f"events.rank{rank}.jsonl", sites=all_sites)
    opt = torch.optim.AdamW(engine.params, lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.95))
    names = {n for n, _ in local.named_modules()}
    faults = [j for j in injections if j.kind == "lr_spike" or j.site in names]   # this rank's sites
    step_ref = [0]
    hooks = _install(local, faults, step_ref)
    lr_spikes = [j for j in injections if j.kind == "lr_spike"]
    losses: list[float] = []
    grad_norms: list[float] = []
    skipped = rewinds = 0
    step = iteration = 0   # iteration counts loop passes, rewinds included (faults happen in time)
    t0 = time.perf_counter()
    while step < n_steps:
        step_ref[0] = iteration
        iteration += 1
        # Collective (DCP: every rank its shards and its state)
        if ctl.config.rewind and step % tc.ckpt_every == 0:
            save_checkpoint(ckpt_dir, step, model=local, optimizer=opt, precision=state, controller=session,
                            data_state=data.state_dict(), keep=5)
        lr = lr_at(tc, step, lr_spikes, step_ref[0])
        for g in opt.param_groups:
            g["lr"] = lr
        session.before_step(step)
        x, y = data.next()
        opt.zero_grad(set_to_none=True)
        loss = engine.forward_backward(x, y)
        gnorm = engine.clip_grad_norm(tc.grad_clip)
        decision = session.after_backward(step, loss, gnorm)
        if decision.rewind and (back := rewind(ckpt_dir, step, decision, session, local, opt, data)) is not None:
            losses, grad_norms = losses[:back], grad_norms[:back]
            rewinds += 1
            step = back
            continue
        if decision.action is Action.CONTINUE:
            opt.step()
        else:   # skip_step, or a rewind with no checkpoint to go back to
            opt.zero_grad(set_to_none=True)
            skipped += 1
        losses.append(loss.item())
        grad_norms.append(float(gnorm))
        step += 1
    seconds = (time.perf_counter() - t0) / max(n_steps, 1)   # as train.py: rewound passes included
    for h in hooks:
        h.remove()
    summary = {"mode": par.mode, "world": world, "steps": n_steps, "microbatches": tc.microbatches,
               "seconds_per_step": seconds, "passes": iteration, "skipped_steps": skipped, "rewinds": rewinds, "events": len(session.events),
               "formats": dict(ctl.current),
               "nonfinite_params": any(not torch.isfinite(p.detach()).all() for p in engine.params)}
    if rank == 0:
        (out / "losses.json").write_text(json.dumps(losses))
        (out / "grad_norms.json").write_text(json.dumps(grad_norms))
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (alone, without --dp/--tp)")
    p.add_argument("--out", default="runs/train_parallel")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--microbatches", type=int, default=None,
                   help="overrides train.microbatches (the pipeline's microbatches; gradient "
                        "accumulation otherwise)")
    p.add_argument("--inject", action="append", default=[], metavar="KIND:SITE:START:STOP",
                   help="a fault (nan, overflow, lr_spike) as in experiments.train; repeatable")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per process")
    args = p.parse_args(argv)
    par = ParallelConfig(args.dp, args.tp, args.pp)
    if "RANK" not in os.environ:
        raise SystemExit(f"start this under torchrun: torchrun --nproc-per-node {par.world} -m "
                         f"experiments.train_parallel {args.config} ...")
    torch.set_num_threads(args.threads)
    injections = [parse_injection(t) for t in args.inject]
    dist.init_process_group("gloo")
    try:
        summary = train_parallel(load(args.config), args.out, par, steps=args.steps,
                                 injections=injections, microbatches=args.microbatches)
        if dist.get_rank() == 0:
            print(f"{summary['mode']}: {summary['steps']} steps, {summary['seconds_per_step'] * 1e3:.0f} ms/step, "
                  f"{summary['events']} events; losses and events in {args.out}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
