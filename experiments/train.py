"""Train the small GPT on Shakespeare with a precision plan and the rollout controller.

    python -m experiments.train experiments/configs/default.yaml --out runs/default

The loop is what README.md shows: build the plan and the controller from the config,
call `session.after_backward` after backward, obey its decision (skip the step, or
rewind to the last good checkpoint and skip batches). Faults can be injected for tests
and demonstrations (`Injection`): a NaN in one site's output, one site's input scaled by
1e4 (an overflow), a learning-rate spike (`--inject KIND:SITE:START:STOP`).
`experiments/train_parallel.py` runs the same loop pieces under torchrun (DP x TP, PP).
"""

from __future__ import annotations

import argparse
import json
import math
import time
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from experiments.data import Batches, split_texts, tokens_of
from experiments.evaluation import EvalCheckpoints, EvalConfig
from experiments.model import build_gpt
from lowprec import prepare
from lowprec.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from lowprec.controller import Action
from lowprec.plan import PrecisionPlan
from lowprec.rollout import RolloutConfig, RolloutSession, build_controller, parse_rollout


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    batch_size: int = 16
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup: int = 20
    grad_clip: float = 1.0
    seed: int = 0
    ckpt_every: int = 50
    max_train_bytes: int | None = 2_000_000
    log_every: int = 10   # tracked metrics: every N steps (the mean over those steps), and at check steps
    # gradient accumulation: each batch in this many equal row chunks, one forward and
    # backward each (a pipeline's microbatches). Tensor-wise current scaling then takes
    # each chunk's own amax, as it does for each microbatch under pipeline parallelism.
    microbatches: int = 1

    def __post_init__(self) -> None:
        if self.microbatches < 1 or self.batch_size % self.microbatches:
            raise ValueError(f"train.microbatches ({self.microbatches}) must be >= 1 and divide "
                             f"train.batch_size ({self.batch_size})")


@dataclass(frozen=True)
class Injection:
    """A fault: kind in {"nan", "overflow", "lr_spike"}, on `site`, for iterations [start, stop)
    (loop passes: after a rewind the step counter goes back, time does not).

    "nan" and "overflow" model faults that come from running the site in low precision:
    they fire only while the site's format is not high precision (a fallback cures them).
    "overflow" fires every `every`-th step, like intermittent activation outliers.
    """

    kind: str
    start: int
    stop: int
    site: str = ""
    factor: float = 1e4
    every: int = 1

    def active(self, step: int, module=None) -> bool:
        low = module is None or not module.format.is_high_precision
        return self.start <= step < self.stop and (step - self.start) % self.every == 0 and low


@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)
    events: list = field(default_factory=list)
    formats: dict[int, dict[str, str]] = field(default_factory=dict)   # check step -> precision map
    flops_share: dict[int, dict[str, float]] = field(default_factory=dict)
    seconds_per_step: float = 0.0
    nonfinite_params: bool = False
    rewinds: int = 0
    evals: list[dict] = field(default_factory=list)   # every eval checkpoint (experiments.evaluation)
    final_eval: object = None                         # the end-of-run EvalResult


def load(path: str | Path) -> dict:
    return yaml.safe_load(Path(path).read_text())


def rollout_section(cfg: dict, baseline: dict[int, float] | None = None) -> RolloutConfig:
    """The config's rollout section. Its loss gap needs the baseline's loss curve, passed in
    code (experiments.run_default) or in the file `rollout.baseline` names; with neither at
    hand (python -m experiments.train on its own) the loss gap is off (docs/results.md)."""
    rollout = parse_rollout(cfg["rollout"])
    named = rollout.baseline.losses if rollout.baseline is not None else None
    if baseline is None and rollout.thresholds.loss_gap is not None and not (named and Path(named).is_file()):
        rollout = dataclasses.replace(rollout, thresholds=dataclasses.replace(rollout.thresholds, loss_gap=None))
    return rollout


def parse_injection(text: str) -> Injection:
    """`KIND:SITE:START:STOP[:FACTOR[:EVERY]]` (the --inject option); lr_spike takes no site."""
    parts = text.split(":")
    try:
        kind, site, start, stop = parts[:4]
        extra = [float(parts[4])] if len(parts) > 4 else []
        extra += [int(parts[5])] if len(parts) > 5 else []
        if len(parts) > 6:
            raise ValueError("too many fields")
        return Injection(kind, int(start), int(stop), site, *extra)
    except ValueError as e:
        raise ValueError(f"--inject {text!r}: expected KIND:SITE:START:STOP[:FACTOR[:EVERY]], e.g. "
                         f"nan:blocks.1.mlp.fc:40:200 or lr_spike::60:64:100 ({e})") from None


def train_batches(tc: TrainConfig, block_size: int, *, rank: int = 0, world: int = 1) -> Batches:
    """The training batches of a run: rows rank::world of each global batch."""
    train_files, _ = split_texts()
    return Batches(tokens_of(train_files, tc.max_train_bytes), tc.batch_size, block_size, seed=tc.seed,
                   rank=rank, world=world)


def lr_at(tc: TrainConfig, step: int, spikes: list[Injection] = (), iteration: int | None = None) -> float:
    """Linear warmup to tc.lr, times the factors of the learning-rate spikes active at
    `iteration` (the loop pass; the step itself when there are no rewinds)."""
    lr = tc.lr * min(1.0, (step + 1) / tc.warmup)
    it = step if iteration is None else iteration
    return lr * math.prod(j.factor for j in spikes if j.active(it))


def forward_backward(model, x: torch.Tensor, y: torch.Tensor, microbatches: int = 1,
                     world: int = 1) -> torch.Tensor:
    """Forward and backward of one batch in `microbatches` row chunks; returns the loss.

    Each chunk's loss is divided by microbatches * world (world: data-parallel ranks that
    each hold 1/world of the batch), so that summed gradients are those of the global
    batch mean; the returned loss (detached) is this rank's share of that mean.
    """
    scale = microbatches * world
    total = None
    chunks = zip(x.tensor_split(microbatches), y.tensor_split(microbatches))
    for xc, yc in chunks if microbatches > 1 else [(x, y)]:
        _, loss = model(xc, yc)
        part = loss / scale if scale != 1 else loss
        part.backward()
        total = part.detach() if total is None else total + part.detach()
    return total


def backward_and_decide(model, opt, data: Batches, session, tc: TrainConfig, step: int, lr: float):
    """One step up to the optimizer: set the learning rate, draw the batch, forward and
    backward, clip, and ask the session (if any) for its decision. Returns (loss, grad norm,
    decision or None); the caller steps, skips or rewinds as the decision says."""
    for g in opt.param_groups:
        g["lr"] = lr
    if session is not None:
        session.before_step(step)
    x, y = data.next()
    opt.zero_grad(set_to_none=True)
    loss = forward_backward(model, x, y, tc.microbatches)
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
    decision = session.after_backward(step, loss, gnorm) if session is not None else None
    return loss, gnorm, decision


def rewind(ckpt_dir: Path, step: int, decision, session, model, opt, data) -> int | None:
    """Restore the newest checkpoint at least two checks before `step` (model, optimizer,
    data position; the precision map and the controller's memory of what went wrong stay
    as they are now) and skip the decision's batches. Returns the step to go on from, or
    None when there is no such checkpoint. Collective when the checkpoints are sharded."""
    good = [(s, p) for s, p in list_checkpoints(ckpt_dir) if s <= step - 2 * session.monitor.config.check_every]
    if not good:
        return None
    back, path = good[-1]
    info = load_checkpoint(path, model=model, optimizer=opt, restore_rng=False,
                           keep_current=("precision", "controller"))
    data.load_state_dict(info["data_state"])
    data.skip(step - back + decision.skip_batches)
    return back


def _nan_first_column(out: torch.Tensor) -> torch.Tensor:
    """`out` with NaN in its first column. A DTensor output (tensor parallel) gets it in
    the rank(s) that hold global column 0; a partial sum on every rank (NaN either way)."""
    if getattr(out, "device_mesh", None) is None:   # a plain tensor
        out = out.clone()
        out[..., 0] = float("nan")
        return out
    from torch.distributed.tensor import DTensor
    local = out.to_local().clone()
    last = out.ndim - 1
    if all(not (p.is_shard() and p.dim % out.ndim == last) or out.device_mesh.get_local_rank(i) == 0
           for i, p in enumerate(out.placements)):
        local[..., 0] = float("nan")
    return DTensor.from_local(local, out.device_mesh, out.placements, run_check=False,
                              shape=out.shape, stride=out.stride())


def _install(model, inj: list[Injection], step_ref: list[int]):
    hooks = []
    for j in inj:
        if j.kind == "lr_spike":
            continue
        module = model.get_submodule(j.site)
        if j.kind == "nan":
            def hook(mod, args, out, j=j):
                if j.active(step_ref[0], mod):
                    return _nan_first_column(out)
            hooks.append(module.register_forward_hook(hook, prepend=True))
        elif j.kind == "overflow":
            def pre(mod, args, j=j):
                if j.active(step_ref[0], mod):
                    return (args[0] * j.factor,) + tuple(args[1:])
            hooks.append(module.register_forward_pre_hook(pre))
        else:
            raise ValueError(f"unknown injection kind {j.kind!r}: nan, overflow, lr_spike")
    return hooks


def train(cfg: dict, out_dir: str | Path, *, injections: list[Injection] = (), controller: bool = True,
          steps: int | None = None, baseline: dict[int, float] | None = None, resume: bool = False,
          tracker=None) -> RunResult:
    """Train as `cfg` says; `tracker` (a lowprec.tracking.Tracker) gets config, metrics,
    signals, events and the precision map; `baseline` is a {step: loss} curve."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tc = TrainConfig(**(cfg.get("train") or {}))
    n_steps = steps if steps is not None else tc.steps
    torch.manual_seed(tc.seed)
    model = build_gpt(**cfg["model"].get("args", {}))
    plan = PrecisionPlan.from_dict(cfg["precision"])
    state = prepare(model, plan, seed=tc.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.95))
    data = train_batches(tc, model.cfg.block_size)
    evals = None
    if cfg.get("eval"):
        evals = EvalCheckpoints(EvalConfig.from_dict(cfg["eval"]), model, state, tracker=tracker,
                                max_length=model.cfg.block_size)
    session = None
    if controller and cfg.get("rollout"):
        gate = evals.gate if evals is not None and evals.spec is not None else None
        rollout = rollout_section(cfg, baseline)
        ctl = build_controller(rollout, state, model, baseline=baseline, gate=gate)
        session = RolloutSession(state, ctl, monitor=rollout.monitor_config(), event_log=out / "events.jsonl",
                                 on_events=tracker.log_events if tracker is not None else None)
    if session is None:
        state.collect_stats(False)   # no monitor reads them: quantize without statistics
    if tracker is not None:
        tracker.log_config(cfg)
        tracker.log_precision(0, state.formats(), state.flops_share())
    step_ref = [0]
    hooks = _install(model, list(injections), step_ref)
    lr_spikes = [j for j in injections if j.kind == "lr_spike"]
    ckpt_dir = out / "checkpoints"
    res = RunResult()
    step = 0
    if resume and (last := latest_checkpoint(ckpt_dir)) is not None:
        info = load_checkpoint(last, model=model, optimizer=opt, precision=state, controller=session)
        data.load_state_dict(info["data_state"])
        step = info["step"]
        res.losses = list(info["extra"]["losses"])
    t0 = time.perf_counter()
    first = step
    iteration = 0   # counts every loop pass, rewinds included: faults happen once, in time
    while step < n_steps:
        step_ref[0] = iteration
        iteration += 1
        if step % tc.ckpt_every == 0:
            save_checkpoint(ckpt_dir, step, model=model, optimizer=opt, precision=state, controller=session,
                            data_state=data.state_dict(), extra={"losses": list(res.losses)}, keep=5)
        lr = lr_at(tc, step, lr_spikes, step_ref[0])
        loss, gnorm, decision = backward_and_decide(model, opt, data, session, tc, step, lr)
        if decision is not None and decision.rewind:
            back = rewind(ckpt_dir, step, decision, session, model, opt, data)
            if back is not None:
                res.losses = res.losses[:back]
                res.rewinds += 1
                step = back
                continue
        if decision is not None and decision.action in (Action.SKIP_STEP, Action.REWIND):
            opt.zero_grad(set_to_none=True)
        else:
            opt.step()
        res.losses.append(loss.item())
        checked = session is not None and session.monitor.is_check_step(step)
        if checked or step == n_steps - 1:
            res.formats[step] = state.formats()
            res.flops_share[step] = state.flops_share()
        if tracker is not None and ((step + 1) % tc.log_every == 0 or checked or step == n_steps - 1):
            window = res.losses[-tc.log_every:]
            metrics = {"train/loss": sum(window) / len(window), "train/loss_last": res.losses[-1],
                       "train/grad_norm": float(gnorm), "train/lr": lr}
            if baseline and step in baseline:
                metrics["train/baseline_loss"] = sum(baseline.get(s, baseline[step]) for s in
                                                     range(step - len(window) + 1, step + 1)) / len(window)
            tracker.log_metrics(step, metrics)
            if checked and session.last_signals is not None:
                tracker.log_signals(step, session.last_signals)
            if checked or decision is not None and decision.changes:
                tracker.log_precision(step, state.formats(), state.flops_share())
        step += 1
        if evals is not None and evals.due(step) and step < n_steps:
            summary = evals.evaluate(step)   # after `step` updates; the controller hears its verdict
            if session is not None and summary is not None:
                if session.after_eval(step, summary).changes and tracker is not None:
                    tracker.log_precision(step, state.formats(), state.flops_share())
    res.seconds_per_step = (time.perf_counter() - t0) / max(n_steps - first, 1)
    if evals is not None:
        evals.final(n_steps)
        res.evals, res.final_eval = evals.history, evals.last
    res.nonfinite_params = any(not torch.isfinite(p).all() for p in model.parameters())
    for h in hooks:
        h.remove()
    if session is not None:
        res.events = session.events
    (out / "losses.json").write_text(json.dumps(res.losses))
    return res


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("--out", default="runs/train")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--no-controller", action="store_true")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    p.add_argument("--inject", action="append", default=[], metavar="KIND:SITE:START:STOP",
                   help="a fault (nan, overflow, lr_spike) for tests and demonstrations; repeatable")
    args = p.parse_args(argv)
    res = train(load(args.config), args.out, controller=not args.no_controller, steps=args.steps,
                resume=args.resume, injections=[parse_injection(t) for t in args.inject])
    print(f"final loss {res.losses[-1]:.4f}, {len(res.events)} events, {res.seconds_per_step * 1e3:.0f} ms/step")
    for e in res.events:
        print(" ", e.summary())


if __name__ == "__main__":
    main()
