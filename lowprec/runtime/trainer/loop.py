"""The one training loop: one process, DP x TP, or pipeline stages; the engine is an argument.

    result = train(train_cfg, engine, state, data, controller=ctl, out_dir="runs/x",
                   tracker=tracker, evals=evals, rollout=rollout_cfg)

Each step: draw the batch, `engine.forward_backward`, and `Session.step` (clip by the
engine's global norm, decide, step / skip / rewind). Around it: the learning-rate schedule
(linear warmup, a `LambdaLR`, so a rewind restores it), checkpoints every
`train.ckpt_every` steps (atomic; `resume=True` continues from the newest) and at the last step, eval
checkpoints (periodic, before promotions through the controller's gate, at the end; a
periodic verdict goes to `Session.after_eval`), tracking (means over `train.log_every`
steps, the signals and the precision map at check steps, every event) and injected
faults (`lowprec.runtime.trainer.faults`). Rewinds go to in-memory snapshots or, with
`rollout.rewind.source: disk`, to the checkpoints; both work under pipeline parallelism,
since each rank restores its own stage. The loss that caused a rewind is logged as
`train/loss_rewound` (with `train/rewound_to`, the step it went back to) at the step where
it was seen. Resuming when every checkpoint is corrupt raises NoUsableCheckpointError
rather than starting again at step 0.

Every rank runs this loop with the same decisions (the session combines statistics
across ranks); rank 0 writes losses.json, grad_norms.json, summary.json (with the final
eval's results) and, with the LR probe on, lr_probes.json (every probe this process ran) in
`out_dir`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lowprec.state.checkpoint import checkpoint_to_resume, list_checkpoints, load_checkpoint, save_checkpoint
from lowprec.runtime.trainer.stop_request import RunStopped
from lowprec.runtime.trainer.data import TokenBatches
from lowprec.state.ranks import on_any_rank, process_rank
from lowprec.runtime.session.after_step import AfterStep
from lowprec.runtime.engines.engine import Engine
from lowprec.runtime.session.lrprobe import LRProbe
from lowprec.runtime.trainer.faults import Faults, Injection
from lowprec.runtime.session.session import Session, SessionSettings
from lowprec.runtime.trainer.site_paths import all_gather_tag, path_metrics, site_paths
from lowprec.runtime.session.snapshots import DiskSnapshots
from lowprec.runtime.session.tracked_map import regather
from lowprec.tracking.phases import PassOutcome, Phase
from lowprec.tracking.telemetry import Telemetry, TelemetryConfig

__all__ = ["RunResult", "train", "warmup_schedule"]


@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)          # per step, as finally trained
    grad_norms: list[float] = field(default_factory=list)
    events: list = field(default_factory=list)
    formats: dict[int, dict[str, str]] = field(default_factory=dict)        # check step -> precision map
    flops_share: dict[int, dict[str, float]] = field(default_factory=dict)
    seconds_per_step: float = 0.0
    passes: int = 0               # loop passes, rewound ones included
    rewinds: int = 0
    skipped: int = 0
    nonfinite_params: bool = False
    evals: list[dict] = field(default_factory=list)
    final_eval: object = None
    lr_probes: list = field(default_factory=list)   # every LR probe's ProbeResult, in order
    telemetry: dict[str, float] = field(default_factory=dict)   # the run's telemetry/* numbers
    site_paths: dict[str, dict] = field(default_factory=dict)   # per site: calls by GEMM path, all-gather dtype

    def summary(self) -> dict:
        return {"steps": len(self.losses), "passes": self.passes, "rewinds": self.rewinds,
                "skipped_steps": self.skipped, "events": len(self.events),
                "seconds_per_step": self.seconds_per_step, "nonfinite_params": self.nonfinite_params,
                "formats": self.formats[max(self.formats)] if self.formats else {},
                "flops_share": self.flops_share[max(self.flops_share)] if self.flops_share else {},
                "final_eval": ({k: self.evals[-1][k] for k in ("step", "mode", "results", "results_hp")}
                               if self.evals else None),
                "site_paths": self.site_paths}


def warmup_schedule(optimizer: torch.optim.Optimizer, warmup: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to the optimizer's lr over `warmup` steps, then constant."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / warmup))


def train(tc, engine: Engine, state, data, *, out_dir: str | Path, controller=None, rollout=None,
          sites: list[str] | None = None, group=None, tracker=None, evals=None,
          baseline: dict[int, float] | None = None, resume: bool | Path = False, faults: list[Injection] | tuple = (),
          steps: int | None = None, checkpoints: bool = True, telemetry: Telemetry | None = None,
          progress=None, precision_map=None, stop=None) -> "RunResult":
    """Train `engine`'s model for `steps` (default `tc.steps`) as the train section `tc` says.

    controller: a RolloutController (None: the plan as it is, no decisions); rollout: its
    parsed section (for the rewind source and snapshot cadence). sites/group: as Session.
    telemetry: where the time and energy go (`lowprec.tracking.telemetry`); default none.
    resume: True continues from the newest usable checkpoint in `out_dir`/checkpoints (none: from
    step 0); a Path, from that checkpoint (the caller chose it: `lowprec run --resume`).
    progress: told after every pass `update(steps done, loss=, tokens=)` (`lowprec.runtime.trainer.console.Progress`).
    precision_map: what tracking, the summary and the results report as the model's formats and
    FLOP shares (`formats()`, `flops_share()`); default `state`; under pipeline stages, where
    `state` holds this rank's sites, the whole model's (`lowprec.runtime.session.tracked_map.tracked_map`).
    stop: a `lowprec.runtime.trainer.stop_request.StopRequest`, asked at every step boundary (every
    rank agreeing): once a signal came, a checkpoint is written at that step and RunStopped raised
    (no final eval, no summary).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_steps = tc.steps if steps is None else steps
    tele = telemetry or Telemetry(TelemetryConfig(enabled=False))
    session, opt, sched = _build_session(tc, engine, state, data, out, controller, rollout, sites, group, tracker,
                                         tele.clock, evals)
    res = RunResult()
    tracked = state if precision_map is None else precision_map
    after = AfterStep(session, tracked, tracker=tracker, evals=evals, log_every=tc.log_every, baseline=baseline,
                      total_steps=n_steps, clock=tele.clock, on_precision_change=tele.formats_changed,
                      window_metrics=tele.window)
    # resume: None = no checkpoint yet (start at 0); every checkpoint bad: NoUsableCheckpointError
    iteration = 0   # loop passes, rewinds included: injected faults happen once, in time
    last = resume if isinstance(resume, Path) else checkpoint_to_resume(out / "checkpoints") if resume else None
    written = None   # the step whose checkpoint is on disk as loaded, the newest there: not written again
    if last is not None:
        iteration = _resume(last, engine, opt, sched, state, data, session, after, res)
        regather(tracked)   # every rank loaded its sites' formats
        newest = max((s for s, _ in list_checkpoints(out / "checkpoints")), default=-1) == session.step_index
        written = session.step_index if not on_any_rank(not newest) else None   # every rank alike
    if tracker is not None:
        tracker.log_precision(session.step_index, tracked.formats(), tracked.flops_share())
    injected = Faults(engine.module, faults)
    first = session.step_index
    tele.begin()   # the clock the session and the engine were built with counts from here
    t0 = time.perf_counter()
    try:
        _steps(_Loop(tc, engine, opt, sched, state, data, session, after, tele, injected, progress, checkpoints,
                     out / "checkpoints", stop, written), res, n_steps, iteration)
    finally:
        injected.remove()
        session.close()
    trained = n_steps - first   # 0: resumed at the last step's checkpoint, for the final eval only
    if trained == 0 and n_steps > 0:   # no step ran to record the precision map at the end: as it was loaded
        after.record.formats[n_steps - 1] = tracked.formats()
        after.record.flops_share[n_steps - 1] = tracked.flops_share()
    final_eval = stop.interrupting(n_steps) if stop is not None and checkpoints else contextlib.nullcontext()
    _conclude(res, after.record, engine, state, session, evals, tracker, tele, rank=process_rank(), out=out,
              n_steps=n_steps, seconds=(time.perf_counter() - t0) / trained if trained > 0 else 0.0,
              final_eval=final_eval)
    return res


def _build_session(tc, engine: Engine, state, data, out: Path, controller, rollout, sites, group, tracker, clock,
                   evals):
    """The optimizer (AdamW), its warmup schedule and the Session that drives them (laps on
    `clock`; a promotion is gated by `evals` when they have an in-loop gate)."""
    rank = process_rank()
    opt = torch.optim.AdamW(engine.params, lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.95))
    sched = warmup_schedule(opt, tc.warmup)
    ckpt_dir = out / "checkpoints"
    snapshots = None
    if controller is not None and controller.config.rewind and rollout.rewind.source == "disk":
        snapshots = DiskSnapshots(ckpt_dir, engine.module, opt, margin=2 * rollout.check_every,
                                  scheduler=sched, data=data)
    lr_probe = _lr_probe(rollout, controller, engine, opt, state, data, tc)
    world_suffix = "" if rank == 0 and not (group is not None or sites is not None) else f".rank{rank}"
    session = Session(engine.module, opt, state, controller, scheduler=sched, data=data, snapshots=snapshots,
                      clip=lambda: engine.clip_grad_norm(tc.grad_clip), sites=sites, group=group,
                      event_log=out / f"events{world_suffix}.jsonl" if controller is not None else None,
                      on_events=tracker.log_events if tracker is not None else None, lr_probe=lr_probe,
                      settings=SessionSettings.from_rollout(rollout), clock=clock,
                      gate=evals.gate if evals is not None and evals.checker is not None else None)
    return session, opt, sched


def _resume(last: Path, engine: Engine, opt, sched, state, data, session: Session, after: AfterStep,
            res: "RunResult") -> int:
    """Load the checkpoint `last` into everything; the loop pass it was taken at."""
    info = load_checkpoint(last, model=engine.module, optimizer=opt, precision=state, controller=session)
    data.load_state_dict(info["data_state"])
    extra = info["extra"] or {}
    sched.load_state_dict(extra["scheduler"])
    after.load_state_dict(extra)
    res.passes = int(extra.get("passes", 0))   # the summary's
    session.resume_at(info["step"])
    return int(extra["iteration"])


@dataclass
class _Loop:
    """What the step loop drives (all built by `train`)."""

    tc: object
    engine: Engine
    opt: torch.optim.Optimizer
    sched: object
    state: object
    data: object
    session: Session
    after: AfterStep
    tele: Telemetry
    injected: Faults
    progress: object
    checkpoints: bool
    ckpt_dir: Path
    stop: object = None   # a StopRequest (see `train`)
    written: int | None = None   # the step resumed at, whose checkpoint is the newest: its boundary writes none


def _steps(lp: _Loop, res: "RunResult", n_steps: int, iteration: int) -> None:
    """Run passes until the session reaches `n_steps` (rewound passes included); a checkpoint
    every `train.ckpt_every` steps, at `n_steps` and where a signal stops the run, except the
    one a resume just loaded (`lp.written`): writing it again cost a whole checkpoint's time and,
    after a full disk, the room for a second copy that the resume may not have."""
    tc, engine, opt, sched, state, data = lp.tc, lp.engine, lp.opt, lp.sched, lp.state, lp.data
    session, after, tele, injected, progress = lp.session, lp.after, lp.tele, lp.injected, lp.progress
    clock = tele.clock
    while True:
        step = session.step_index
        clock.lap(Phase.OTHER)
        signum = lp.stop.agreed(step) if lp.stop is not None else None
        again = step == lp.written   # the resume's first boundary: that checkpoint was just loaded
        lp.written = None            # (a rewind back to this step writes it again, moving later ones aside)
        if lp.checkpoints and not again and (step % tc.ckpt_every == 0 or signum is not None or step >= n_steps):
            save_checkpoint(lp.ckpt_dir, step, model=engine.module, optimizer=opt, precision=state,
                            controller=session, data_state=data.state_dict(), keep=tc.ckpt_keep,
                            extra={**after.state_dict(), "scheduler": sched.state_dict(),
                                   "iteration": iteration, "passes": res.passes})
            clock.lap(Phase.CHECKPOINT)
        if signum is not None:
            raise RunStopped(signum, step)
        if step >= n_steps:   # the last step's checkpoint is written: the trained weights, and a
            return            # resume that redoes only the final eval
        injected.tick(iteration)
        iteration += 1
        if (factor := injected.lr_factor()) != 1.0:
            for g in opt.param_groups:
                g["lr"] *= factor
        lr = opt.param_groups[0]["lr"]
        x, y = data.next()
        clock.lap(Phase.DATA)
        loss = engine.forward_backward(x, y)
        clock.lap(Phase.BACKWARD)   # what the engine did not lap itself
        out_step = session.step(loss, closure=lambda: engine.forward_backward(x, y))
        res.passes += 1
        tokens = x.numel() * getattr(engine, "data_parallel_size", 1)
        value = loss.item()
        if not after.keep(out_step, value):
            tele.end_pass(step, PassOutcome.REWOUND, tokens, rewound_to=out_step.rewound_to)
            if progress is not None:
                progress.update(session.step_index, tokens=tokens)
            continue
        tele.end_pass(step, PassOutcome.APPLIED if out_step.applied else PassOutcome.SKIPPED, tokens)
        after.after_applied(out_step, lr)
        if progress is not None:
            progress.update(session.step_index, loss=value, tokens=tokens)


def _conclude(res: "RunResult", rec, engine: Engine, state, session: Session, evals, tracker, tele: Telemetry, *,
              rank: int, out: Path, n_steps: int, seconds: float, final_eval=contextlib.nullcontext()) -> None:
    """Fill `res` from the record, the final evaluation (within `final_eval`: a signal may stop
    it, `StopRequest.interrupting`) and the telemetry; rank 0 writes the files. seconds: per
    step this process trained (0.0: it trained none, resumed for the final eval only)."""
    clock, trained = tele.clock, seconds > 0
    res.losses, res.grad_norms, res.formats, res.flops_share = rec.losses, rec.grad_norms, rec.formats, rec.flops_share
    res.rewinds = rec.rewinds
    res.seconds_per_step = seconds
    if evals is not None:
        clock.lap(Phase.OTHER)
        try:
            with final_eval:
                evals.final(n_steps)
        except RunStopped:   # the telemetry of the steps this process trained and of its eval so far
            clock.lap(Phase.EVAL)
            _telemetry(res, tele, tracker, n_steps, rank, out, trained=trained)
            raise
        clock.lap(Phase.EVAL)
        res.evals, res.final_eval = evals.history, evals.last
    _telemetry(res, tele, tracker, n_steps, rank, out, trained=trained)
    res.site_paths = site_paths(state, engine)   # a collective: every rank's counts
    if tracker is not None and res.site_paths:
        tracker.log_metrics(n_steps, path_metrics(res.site_paths))
        tracker.log_tags(all_gather_tag(res.site_paths))
    res.nonfinite_params = on_any_rank(any(not torch.isfinite(p.detach()).all() for p in engine.params))
    res.events, res.skipped = session.events, session.skipped
    res.lr_probes = list(session.lr_probe.results) if session.lr_probe is not None else []
    if rank == 0:
        (out / "losses.json").write_text(json.dumps(res.losses))
        (out / "grad_norms.json").write_text(json.dumps(res.grad_norms))
        (out / "summary.json").write_text(json.dumps(res.summary(), indent=1))
        if res.lr_probes:   # the probes this process ran (a resumed run: those since the resume)
            (out / "lr_probes.json").write_text(json.dumps([dataclasses.asdict(r) for r in res.lr_probes], indent=1))


def _telemetry(res: "RunResult", tele: Telemetry, tracker, n_steps: int, rank: int, out: Path, *, trained: bool) -> None:
    """The run's telemetry/* numbers, logged and (rank 0) in telemetry.json: this process's. A
    process that trained no step (resumed for the final eval) measured no speed: it logs none,
    and the numbers of the life that trained the steps stand."""
    numbers = tele.finish()
    res.telemetry = numbers if trained else {}
    if not res.telemetry:
        return
    if tracker is not None:
        tracker.log_metrics(n_steps, res.telemetry)
        tracker.log_tags(tele.sources())
    if rank == 0:
        (out / "telemetry.json").write_text(json.dumps({"metrics": res.telemetry, "sources": tele.sources()},
                                                       indent=1))


HELD_SEED_OFFSET = 7919   # the LR probe's held batch: a TokenBatches of seed train.seed + this


def _lr_probe(rollout, controller, engine: Engine, opt, state, data, tc) -> LRProbe | None:
    """`rollout.lr_probe`'s probe through the engine, on a held batch that leaves the training
    stream alone: with `TokenBatches` data, batch 0 of another TokenBatches over the same
    tokens (seed + HELD_SEED_OFFSET); any other batch source must have `held_batch()`,
    returning this rank's (x, y) of a batch that training never draws."""
    if controller is None or rollout is None or not rollout.lr_probe.enabled:
        return None
    from lowprec.base.parse import ConfigError
    if isinstance(data, TokenBatches):
        held = TokenBatches(data.tokens, data.batch_size, data.block_size, seed=data.seed + HELD_SEED_OFFSET,
                            rank=data.rank, world=data.world).batch(0)
    elif callable(getattr(data, "held_batch", None)):
        held = data.held_batch()
    else:
        raise ConfigError("rollout.lr_probe", (
            f"is enabled, and the probe needs a held batch that the {type(data).__name__} batch source cannot give: "
            f"give it a held_batch() method returning (x, y), a batch training never draws, or set "
            f"lr_probe.enabled: false"))
    cfg = rollout.lr_probe
    try:
        return LRProbe.for_engine(engine, opt, held, state=state, clip=lambda: engine.clip_grad_norm(tc.grad_clip),
                                  factors=cfg.factors, every_checks=cfg.every_checks)
    except (TypeError, ValueError) as e:
        raise ConfigError("rollout.lr_probe", str(e)) from None
