"""`lowprec run` on several processes: the launch, the checks before it, and each rank's run.

    lowprec run --nproc-per-node 4 CONFIG --out DIR        # starts torchrun itself
    torchrun --nproc-per-node 4 -m lowprec.cli run CONFIG --out DIR

The config's `parallel:` section (`lowprec.config.ParallelConfig`) says how the model is
split; once every rank joined, `start_group` starts the process group and builds the mesh
(`lowprec.runtime.engines.parallel.build_layout`), the model is prepared with its amax group,
`lowprec.runtime.engines.parallel.build_engine` builds the engine on that mesh, and the run
goes through the one loop (`lowprec.runtime.trainer.loop.train`) exactly as in one process.

**Checked before any rank trains** (`check_launch` before the ranks meet; then, once every
rank joined (`join`: a rank whose peers do not all come within `parallel.peer_timeout_s` says
how many came and exits 2) and the process group and mesh are up, `prepare_run` and
`check_model_plan` on the model every rank builds): the number of processes against the
product of the degrees, the degrees against each other (pipeline stages with data parallel),
the batch against the data-parallel ranks and microbatches, the degrees against the model's
own plan (a tp that does not divide the GPT's heads), and everything a one-process `lowprec
run` checks. A refused job is one line from rank 0 (under `--nproc-per-node`: from the
launcher, which checks before it starts any rank), exit 2, and no output folder.

**Files and tracking.** Rank 0 creates the run folder, writes losses, summary and the
MLflow run (one per job, through its outbox: the other ranks have no tracker, so no rank
waits on tracking); every rank writes its own event log `events.rank<R>.jsonl`. The
statistics rank 0 logs are the monitor's, reduced over every rank at each check; the precision
map it logs and summary.json's are the whole model's, every stage's sites under pipeline stages
(`lowprec.runtime.session.tracked_map`), as is summary.json's `nonfinite_params`. At the
end every rank's events are merged into the run's event table (`merge_rank_events`): the
ranks decide alike, so each event is logged once; one that some rank did not record would
be logged with the ranks that did. Checkpoints are written every `train.ckpt_every` steps
(sharded, `torch.distributed.checkpoint`), so `--resume` continues a killed job, and its
MLflow run, from the newest one.

**Evals** (`eval:`): every rank runs every eval checkpoint's forwards, which a sharded model
needs on all ranks; rank 0 has lm-eval's results, logs them, reaches the in-loop gate's
verdict and broadcasts it, so every rank's controller decides alike. Under pipeline stages an
eval's forward is the Pipeline engine's `logits` (through every stage, the last stage's
logits broadcast: `lowprec.runtime.engines.pipeline_forward`), and whether an `eval_hp` pass runs is
read from the whole model's formats, so every rank runs the same passes.

**A rank that dies** takes the job down: torchrun stops the others, and the launcher of
`lowprec run --nproc-per-node` says which rank died and how (its exit code or signal) and
the command that continues the run.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from lowprec.base.parse import ConfigError

__all__ = ["RankEnv", "rank_env", "place_rank", "peer_lost_line", "check_launch", "check_prepared",
           "join", "start_group", "end_group", "train_ranks", "merge_rank_events", "EXIT_PEER_LOST",
           "REFUSED_GRACE_S"]

EXIT_UNUSABLE = 2
EXIT_PEER_LOST = 4     # a rank's, when a collective lost a peer (the one that died is the news)
# a refusing rank other than 0 waits this long before it exits: torchrun stops every rank at the
# first exit, and rank 0 must have said why by then
REFUSED_GRACE_S = 3.0


@dataclass(frozen=True)
class RankEnv:
    """This process's place in a torchrun job (what torchrun tells its workers)."""
    rank: int
    world: int
    local_rank: int
    master_addr: str
    master_port: int
    agent_store: bool          # the store is torchrun's agent's (else rank 0 hosts it)
    attempt: int               # torchrun's restart count


def rank_env(environ=None) -> RankEnv | None:
    """The torchrun job this process is a rank of; None when it runs alone."""
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    return RankEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"])),
                   env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500")),
                   env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
                   int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))


def place_rank(par, env: RankEnv):
    """This rank's backend and device (`lowprec.runtime.engines.rank_device`), made torch's current CUDA
    device when it is one, so that a model factory's "cuda" builds on this rank's GPU."""
    import torch
    from lowprec.runtime.engines.rank_device import cuda_devices, rank_device
    placed = rank_device(par.device, env.local_rank, cuda_devices())
    if placed.device.type == "cuda":
        torch.cuda.set_device(placed.device)
    return placed


def check_launch(cfg, nproc: int | None, env: RankEnv | None) -> None:
    """ConfigError when the processes started (or to start) do not fit `parallel:`."""
    par = cfg.parallel
    if nproc is not None:
        if env is not None:
            raise ConfigError("--nproc-per-node", f"is given under torchrun (rank {env.rank} of {env.world}); "
                                                  f"torchrun starts the processes: drop --nproc-per-node")
        if nproc < 1:
            raise ConfigError("--nproc-per-node", f"expected a number of processes >= 1, found {nproc}")
        started, how = nproc, f"--nproc-per-node {nproc}"
    elif env is not None:
        started, how = env.world, f"torchrun started {env.world}"
    else:
        started, how = 1, "one process"
    if started != par.world:
        fix = (f"start {par.world} (lowprec run --nproc-per-node {par.world} CONFIG, or torchrun "
               f"--nproc-per-node {par.world} -m lowprec.cli run CONFIG)" if par.world > 1
               else "add a parallel: section whose degrees multiply to that number")
        raise ConfigError("parallel", f"{par.mode} needs {par.world} processes (dp_replicate {par.dp_replicate} x "
                                      f"dp_shard {par.dp_shard} x tp {par.tp} x pp {par.pp}), {how}: {fix}")


def check_prepared(prepared, par) -> None:
    """ConfigError when the built model or data cannot be split as `par` says (before any process group)."""
    from lowprec.runtime.trainer.data import TokenBatches
    from lowprec.runtime.engines.parallel import check_model_plan
    check_model_plan(prepared.model, par.tp, par.pp)   # ValueError: its message names the key
    if par.data_ranks > 1 and prepared.data is not None and not isinstance(prepared.data, TokenBatches):
        raise ConfigError("data.factory", (
            f"returned a {type(prepared.data).__name__}; with {par.data_ranks} data-parallel ranks each reads its "
            f"rows of a token batch: return a 1-D token tensor (or use pp / tp only)"))


class PeersMissing(Exception):
    """A rank waited `parallel.peer_timeout_s` for the others and not all came."""


def join(env: RankEnv, timeout_s: float):
    """Wait (at most `timeout_s`) until every rank of the job has come; the store they share.
    PeersMissing says how many came, and where they were to meet."""
    import torch.distributed as dist
    where = f"{env.master_addr}:{env.master_port}"
    try:
        store = dist.TCPStore(env.master_addr, env.master_port, env.world,
                              is_master=env.rank == 0 and not env.agent_store,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    except (RuntimeError, dist.DistError) as e:
        raise PeersMissing(f"rank {env.rank}: no rank 0 answered at {where} within parallel.peer_timeout_s = "
                           f"{timeout_s:g} s ({str(e).splitlines()[0][:120]}); start every rank (torchrun does)")
    key = f"lowprec.joined.{env.attempt}"
    came = store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while came < env.world and time.monotonic() < deadline:
        time.sleep(0.1)
        came = store.add(key, 0)
    if came < env.world:
        raise PeersMissing(f"rank {env.rank}: {came} of {env.world} ranks joined at {where} within "
                           f"parallel.peer_timeout_s = {timeout_s:g} s; the others never started or cannot reach "
                           f"it: start all {env.world} (torchrun --nproc-per-node {env.world}), or raise the timeout")
    return store


@dataclass
class RankRun:
    """What one rank trains: built from a PreparedRun once the process group is up."""
    engine: object
    state: object
    data: object
    sites: list[str] | None = None   # every site of the model, in forward order (for the monitor)
    precision_map: object = None     # what tracking reports (`lowprec.runtime.session.tracked_map`): the whole model's


def _to_device(device):
    """A forward pre-hook that moves a module's tensor inputs to `device` (the batches are made on the CPU)."""
    import torch

    def move(v):
        return v.to(device) if isinstance(v, torch.Tensor) else v

    def hook(module, args, kwargs):
        return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}
    return hook


def _build(prepared, par, layout, device, clock) -> RankRun:
    """This rank's engine (lapping on `clock`) on `layout`, precision state and batches, on `device`."""
    from lowprec.runtime.trainer.data import TokenBatches
    from lowprec.runtime.engines.parallel import build_engine, local_state
    from lowprec.runtime.session.tracked_map import tracked_map

    tc = prepared.config.train
    sites = list(prepared.controller.order) if prepared.controller is not None else None
    if any(p.device != device for p in prepared.model.parameters()):   # where the factory did not build it
        prepared.model.to(device)
    if device.type != "cpu":   # the batches, eval tokens and held batch are made on the CPU
        prepared.model.register_forward_pre_hook(_to_device(device), with_kwargs=True)
    engine = build_engine(prepared.model, par, layout, tc.microbatches, device, clock)
    state, data, whole = prepared.state, prepared.data, None
    if par.pp > 1:   # this rank keeps its stage's sites; the monitor packs every site's row
        whole, state = state, local_state(state, [f for f, _ in engine.module.named_modules() if f in state.sites])
    if layout.data_ranks > 1:
        data = TokenBatches(data.tokens, data.batch_size, data.block_size, seed=data.seed, rank=layout.data_rank,
                            world=layout.data_ranks)
    return RankRun(engine, state, data, sites, tracked_map(state, whole, prepared.controller))


def merge_rank_events(out: Path, world: int) -> list:
    """The events some rank recorded more often than rank 0 did (`events.rank<R>.jsonl`), each
    once with `evidence.ranks` naming the ranks; none when the ranks decided alike."""
    from collections import Counter
    from dataclasses import replace
    from lowprec.policy.events import read_events

    def log(r: int) -> list:
        path = out / f"events.rank{r}.jsonl"
        return read_events(path) if path.is_file() else []

    lead = Counter(e.to_json() for e in log(0))
    extra: dict[str, tuple] = {}
    for r in range(1, world):
        for key, n in (Counter(e.to_json() for e in log(r)) - lead).items():
            if key not in extra:
                extra[key] = (next(e for e in log(r) if e.to_json() == key), [])
            extra[key][1].append(r)
    return [replace(e, evidence={**e.evidence, "ranks": ranks}) for e, ranks in extra.values()]


def peer_lost_line(rank: int, e: BaseException, limit: int = 200) -> str:
    """What a rank says when a collective failed under it: the error's first line without
    its source-location prefix, shortened at a word boundary (never mid-word) to `limit`."""
    why = re.sub(r"^\[[^\]]*\]\s*", "", (str(e).splitlines() or [""])[0]) or type(e).__name__
    if len(why) > limit:   # at the last space that fits (a single word longer than that: cut)
        head = why[:limit + 1]
        why = (head.rsplit(" ", 1)[0] if " " in head else why[:limit]).rstrip(" ,;:") + " ..."
    return f"rank {rank}: stopped: {why} (another rank died or stopped)"


def start_group(par, env: RankEnv, placed, store):
    """Join this rank to the job's process group (once every rank joined: `store`, from `join`)
    on `placed` (`place_rank`: NCCL on this rank's GPU, or gloo on the CPU) and build its mesh:
    the `lowprec.runtime.engines.parallel.Layout` whose `amax_group` the model is then prepared with.
    `end_group` leaves it."""
    import torch.distributed as dist
    from lowprec.runtime.engines.parallel import build_layout
    try:
        dist.init_process_group(str(placed.backend), store=dist.PrefixStore("lowprec", store), rank=env.rank,
                                world_size=env.world,
                                device_id=placed.device if placed.device.type == "cuda" else None)
        return build_layout(par, placed.device)
    except (RuntimeError, dist.DistError) as e:   # a peer went away since `join`
        raise PeersMissing(peer_lost_line(env.rank, e)) from None


def end_group() -> None:
    """Leave the process group `start_group` joined (nothing when none was joined)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def train_ranks(prepared, out: Path, *, name: str, env: RankEnv, placed, layout, resume: bool, faults, console,
                started: float, tracking_optional: bool, stop=None, config_path=None) -> int:
    """This rank's part of a `lowprec run` under torchrun, in the process group `start_group`
    joined, on `layout` (its mesh, the model prepared with its amax group); the exit status."""
    import torch.distributed as dist
    try:
        return _train_rank(prepared, out, name=name, env=env, device=placed.device, layout=layout, resume=resume,
                           faults=faults, console=console, started=started, tracking_optional=tracking_optional,
                           stop=stop, config_path=config_path)
    except (RuntimeError, dist.DistError) as e:   # a peer went away mid-collective
        console.say(peer_lost_line(env.rank, e))
        return EXIT_PEER_LOST


def _train_rank(prepared, out: Path, *, name: str, env: RankEnv, device, layout, resume: bool, faults, console,
                started: float, tracking_optional: bool, stop=None, config_path=None) -> int:
    import torch.distributed as dist
    from lowprec.runtime.trainer.console import LOG_NAME
    from lowprec.runtime.trainer.loop import train
    from lowprec.runtime.session.host import tracking_uri as _tracking_uri
    from lowprec.runtime.trainer.run import (EXIT_OK, EXIT_UNSENT, close_run, stopped_line, stopped_reason,
                                             summary_text, unsent_line)
    from lowprec.runtime.trainer.stop_request import RunStopped
    from lowprec.runtime.session.run_life import RunLife
    from lowprec.state.checkpoint import NoUsableCheckpointError
    from lowprec.state.ranks import from_rank_0
    from lowprec.tracking.records import RunStatus
    from lowprec.tracking.telemetry import Telemetry, TelemetryConfig

    cfg, lead = prepared.config, env.rank == 0
    tel = cfg.telemetry if lead else TelemetryConfig(enabled=False)
    clock = Telemetry.clock_for(tel, device)   # the engine's and the session's, counting from begin()
    run = _build(prepared, cfg.parallel, layout, device, clock)
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        console.log_to(out / LOG_NAME)
    dist.barrier()   # the run folder exists before any rank writes to it
    par = cfg.parallel   # rank 0's MLflow run, one per job (`resume` continues the killed job's)
    life = RunLife(cfg, name, out / "tracking", lead=lead, resume=resume, system_metrics=True, warn_unsent=False,
                   tags={"lowprec.parallel": f"{par.mode} ({par.world} processes)",
                         "lowprec.parallel.backend": dist.get_backend()})   # nccl or gloo
    tracker = life.tracker
    progress = console.progress(cfg.train.steps, mix=run.precision_map.flops_share) if lead else None
    telemetry = Telemetry(tel, device=device, model=run.engine.module, state=run.state, started=started,
                          clock=clock)
    evals = None
    if prepared.evals is not None:   # every rank evaluates (collective forwards); rank 0 logs, gates and shares
        # the eval passes decided on the whole model's formats, which every rank tracks alike; under
        # pipeline stages scored through the forward through every stage
        evals = life.evals(prepared.evals, share=from_rank_0, formats=run.precision_map.formats,
                           forward=run.engine.logits if cfg.parallel.pp > 1 else None)
    status, why = RunStatus.FAILED, None
    try:
        res = train(cfg.train, run.engine, run.state, run.data, out_dir=out, controller=prepared.controller,
                    rollout=cfg.rollout, sites=run.sites, tracker=tracker, baseline=prepared.baseline, resume=resume,
                    faults=faults, telemetry=telemetry, progress=progress, checkpoints=True, evals=evals,
                    precision_map=run.precision_map, stop=stop)
        dist.barrier()   # every rank's event log is complete
        if tracker is not None:
            tracker.log_events(merge_rank_events(out, env.world))
        status = RunStatus.FINISHED
    except NoUsableCheckpointError as e:
        if lead:
            console.say(f"--resume: {e}")
        return EXIT_UNUSABLE
    except RunStopped as e:   # every rank at the same step, its checkpoint written
        status, why = RunStatus.KILLED, stopped_reason(e)
        if progress is not None:
            progress.close()
        if lead:
            console.say(stopped_line(e, out, config_path, nproc=par.world))
        return e.exit_code
    finally:
        close_run(progress, life, status, out, why)
    if not lead:
        return EXIT_OK
    run_id = tracker.run_id if tracker is not None else None
    if run_id:
        (out / "run_id").write_text(run_id + "\n")
    console.print(summary_text(name, res, prepared, out, run_id, _tracking_uri(cfg)))
    unsent = unsent_line(tracker)
    if unsent:
        console.say(unsent + ("" if tracking_optional else f" (exit {EXIT_UNSENT}; --tracking-optional exits 0)"))
        return EXIT_OK if tracking_optional else EXIT_UNSENT
    return EXIT_OK
