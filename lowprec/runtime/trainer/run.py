"""`lowprec run CONFIG` and `lowprec plan CONFIG`: one set of checks, then train or print.

`prepare_run(config)` does everything `run` does before step 0, and `plan` calls exactly
it: the config is parsed and typed (`lowprec.config.LowprecConfig`), the model factory is
imported and called (it must be the user's own code and return an `nn.Module`), the
precision plan is resolved against the model and prepared, the rollout's stages are
resolved to sites, the loss-gap baseline is read, the data factory is called, the
evaluator and the in-loop gate are found through their entry points and checked. `plan`
needs only the config and the model: it makes the same checks, but the inputs that exist only
at run time (the loss-gap baseline run, the data the data factory reads) are listed as still
missing instead of failing (`prepare_run(..., missing={})`); a config that `run` would reject
for any other reason is rejected by `plan` with the same message (exit 2).

`run` then trains through the one loop (`lowprec.runtime.trainer.loop`), tracks the run in MLflow
(the config, metrics, signals, the precision map, events, evals, `losses.json`), and prints
a summary: the loss, its gap to the baseline, the FLOP share per format, every event.
"""

from __future__ import annotations

import importlib
import signal
import sys
import sysconfig
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from lowprec.base.parse import ConfigError
from lowprec.runtime.session.host import read_baseline, tracking_uri as _tracking_uri
from lowprec.runtime.trainer.resume_check import STEPS_TAG, logged_config
from lowprec.runtime.session.run_life import STOPPED_TAG   # the MLflow tag saying why a run was stopped (KILLED)
from lowprec.runtime.trainer.run_summary import summary_text
from lowprec.runtime.trainer.stop_request import RunStopped, stopped_exit
from lowprec.tracking.records import RunStatus

# `lowprec run`'s exit status: trained (and tracked); a config or input it cannot use (nothing
# written); trained, but tracking records could not be sent (they wait in the outbox); stopped
# because the disk is full (the earlier checkpoints kept: free space, then --resume)
EXIT_OK, EXIT_UNUSABLE, EXIT_UNSENT, EXIT_NO_SPACE = 0, 2, 3, 4   # and RunStopped.exit_code: 130, 143

__all__ = ["EXIT_OK", "EXIT_UNUSABLE", "EXIT_UNSENT", "EXIT_NO_SPACE", "STOPPED_TAG", "unsent_line", "PreparedRun", "prepare_run", "load_factory",
           "high_precision_baseline", "execute", "run_config",
           "train_prepared", "summary_text", "stopped_line", "stopped_reason"]


@dataclass
class PreparedRun:
    config: Any                      # LowprecConfig
    model: nn.Module
    state: Any                       # PrecisionState
    controller: Any                  # RolloutController | None
    data: Any                        # BatchSource
    baseline: dict[int, float] | None
    evals: Any = None                # EvalCheckpoints, when the config has an eval: section


def _stdlib_dirs() -> list[Path]:
    paths = sysconfig.get_paths()
    return [Path(paths[k]).resolve() for k in ("stdlib", "platstdlib") if k in paths]


def load_factory(spec: str, what: str, search_paths: list[Path] = ()) -> Callable:
    """`package.module:function` from the user's own code (not the standard library, not a
    builtin), importable from `search_paths` (the config's folder, the working directory)."""
    mod_name, sep, fn_name = str(spec).partition(":")
    if not sep or not mod_name or not fn_name:
        raise ConfigError(what, f"expected 'package.module:function', found {spec!r}")
    for p in reversed([str(Path(p).resolve()) for p in search_paths]):
        if p not in sys.path:
            sys.path.append(p)   # after the installed packages: a config never shadows them
    top = mod_name.split(".")[0]
    if top in sys.builtin_module_names or top in getattr(sys, "stdlib_module_names", ()):
        raise ConfigError(what, f"{spec!r} names the standard library ({top}); a factory must be a function of "
                          f"your own code, e.g. mymodels:build (mymodels.py beside the config)")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(what, f"cannot import {mod_name!r} ({e}); the module must be importable from the "
                          f"config's folder, the working directory or the installed packages") from None
    file = getattr(module, "__file__", None)
    if file is None or any(Path(file).resolve().is_relative_to(d) and "site-packages" not in Path(file).parts
                           for d in _stdlib_dirs()):
        raise ConfigError(what, f"{spec!r} is not your own code (it is part of Python); point it at a function "
                          f"in your own module")
    fn = getattr(module, fn_name, None)
    if fn is None or not callable(fn) or isinstance(fn, type(len)):
        raise ConfigError(what, f"{mod_name} has no function {fn_name!r}")
    return fn


def _call(fn: Callable, args: dict, what: str):
    try:
        return fn(**args)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{what}.args", f"{fn.__module__}.{fn.__name__}({', '.join(args)}) failed: {e}") from None
    except OSError as e:   # a file the factory reads is absent or unreadable (e.g. a data cache not prepared)
        raise ConfigError(what, f"{fn.__module__}.{fn.__name__}({', '.join(args)}) could not read what it needs: "
                          f"{e}") from None


def _search_paths(cfg) -> list[Path]:
    src = getattr(cfg, "source", None)
    return [p for p in (Path(src).parent if src and src != "<dict>" else None, Path.cwd()) if p is not None]


def high_precision_baseline(cfg):
    """The same run with every site held in bf16, no rollout and no in-loop gate."""
    from lowprec.sites.plan import PrecisionPlan
    d = cfg.precision.to_dict()
    for rule in d.get("rules", []):
        rule["format"], rule["ladder"] = "bf16", ["bf16"]
    ev = cfg.eval
    if ev is not None:
        ev = replace(ev, every=0, high_precision=False, gates=None)
    return replace(cfg, precision=PrecisionPlan.from_dict(d), rollout=None, eval=ev)


def _takes_labels(model: nn.Module) -> bool:
    """A Hugging Face causal LM: `forward(input_ids, attention_mask, ..., labels, ...)`, whose
    second positional parameter is not the targets."""
    import inspect
    try:
        params = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return False
    return params[:1] == ["input_ids"] and "labels" in params[2:]


def _as_labels(module, args, kwargs):
    """The loop's `model(x, y)` as a Hugging Face causal LM's call: `input_ids=x` and `labels`
    that the model's own one-token shift turns into the targets y (labels[t + 1] = y[t]; HF
    pads the last position, so each row's last target is not counted)."""
    if len(args) == 2 and "labels" not in kwargs:
        x, y = args
        return (), {**kwargs, "input_ids": x, "labels": torch.cat([y[:, :1], y[:, :-1]], dim=1)}
    return None


def _batch_source(cfg, raw):
    """The data factory's result as the loop's batch source (ConfigError where it cannot be one)."""
    from lowprec.runtime.trainer.data import as_batch_source
    if isinstance(raw, torch.Tensor) and cfg.data.block_size is None:
        raise ConfigError("data.block_size", f"{cfg.data.factory} returns a token tensor, which is cut into "
                          f"windows of block_size tokens: give data.block_size (e.g. the model's context length)")
    try:
        return as_batch_source(raw, batch_size=cfg.train.batch_size, block_size=cfg.data.block_size,
                               seed=cfg.train.seed)
    except (TypeError, ValueError) as e:
        raise ConfigError("data.factory", str(e)) from None


def prepare_run(cfg, *, controller: bool = True, with_data: bool = True,
                missing: dict[str, str] | None = None, amax_group=None) -> PreparedRun:
    """Everything before step 0 (see the module docstring); raises ConfigError. With `missing`
    (a dict, for `plan`), a runtime input that cannot be had yet (the loss-gap baseline, the
    data the data factory reads) is recorded there, {config key: why}, instead of raised.
    amax_group: the data-parallel group of a rank under torchrun (its mesh's), for `prepare`."""
    from lowprec.policy.rollout import build_controller
    from lowprec.sites.precision_state import prepare

    paths = _search_paths(cfg)
    tc = cfg.train
    torch.manual_seed(tc.seed)
    model = _call(load_factory(cfg.model.factory, "model.factory", paths), dict(cfg.model.args or {}), "model")
    if not isinstance(model, nn.Module):
        raise ConfigError("model.factory", f"{cfg.model.factory} returned a {type(model).__name__}, not a "
                          f"torch.nn.Module")
    if _takes_labels(model):
        model.register_forward_pre_hook(_as_labels, with_kwargs=True)
    try:
        state = prepare(model, cfg.precision, seed=tc.seed, amax_group=amax_group)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError("precision", str(e)) from None
    ctl, baseline, rollout = None, None, cfg.rollout
    try:
        baseline = read_baseline(cfg)
    except ConfigError as e:
        if missing is None:
            raise
        missing[e.path or "rollout.baseline"] = e.message
        # the plan's controller only shows its stages: built without the loss gap it cannot read yet
        rollout = replace(rollout, thresholds=replace(rollout.thresholds, loss_gap=None),
                          baseline=None)
    if controller and rollout is not None:
        ctl = build_controller(rollout, state, model, baseline=baseline)
    data = None
    if with_data:
        if cfg.data is None:
            raise ConfigError("data", "`lowprec run` needs a `data:` section with factory (returning a 1-D "
                              "token tensor or a batch source) and block_size; see docs/config.md")
        fn = load_factory(cfg.data.factory, "data.factory", paths)
        try:
            raw = _call(fn, dict(cfg.data.args or {}), "data")
        except ConfigError as e:
            if missing is None or e.path != "data":   # at "data": the factory could not read what it needs
                raise
            missing["data"] = e.message
        else:
            data = _batch_source(cfg, raw)
    prepared = PreparedRun(cfg, model, state, ctl, data, baseline)
    if cfg.eval is not None:
        from lowprec.runtime.session.evals import eval_checkpoints
        max_len = cfg.data.block_size if cfg.data is not None and cfg.data.block_size else 256
        from lowprec.runtime.session.baseline import baseline_evals
        prepared.evals = eval_checkpoints(cfg.eval, model, state, max_length=max_len, baseline=baseline_evals(cfg))
        if cfg.parallel.pp > 1 and not callable(getattr(prepared.evals.evaluator, "with_forward", None)):
            raise ConfigError("eval.evaluator", (
                f"{cfg.eval.evaluator!r} has no with_forward(forward) method, which parallel: {{pp: {cfg.parallel.pp}}} "
                f"needs (no rank holds the whole model's forward; the run hands the pipeline's): give the evaluator "
                f"one, or use lm_eval"))
        checker = prepared.evals.checker
        if checker is not None and hasattr(checker, "plan_checks"):
            # a checker that shares one error budget over the run's checks needs their number:
            # one before each stage promotion, one per periodic eval, the final one
            every = cfg.eval.every or 0
            stages = len(cfg.rollout.stages) if controller and cfg.rollout is not None else 0
            checker.plan_checks(stages + ((tc.steps - 1) // every if every else 0) + 1)
    return prepared


def execute(prepared: PreparedRun, out: str | Path, *, life=None, resume: bool = False, faults=(),
            steps: int | None = None, started: float | None = None, progress=None, stop=None):
    """Train a prepared run through the one loop (single process); returns its RunResult.
    life: the run's `RunLife` (its tracker, evals; default: untracked); the caller ends it.
    started: `time.perf_counter()` when the run began (telemetry's start-up; default: now).
    progress: the progress line (`lowprec.runtime.trainer.console.Progress`), told after every pass.
    stop: a `lowprec.runtime.trainer.stop_request.StopRequest` (the loop raises RunStopped once it asks)."""
    from lowprec.runtime.engines.engine import SingleProcess
    from lowprec.runtime.trainer.loop import train
    from lowprec.runtime.session.run_life import RunLife
    from lowprec.tracking.telemetry import Telemetry

    cfg = prepared.config
    life = life if life is not None else RunLife.around(cfg, None)
    tracker, evals = life.tracker, life.evals(prepared.evals) if prepared.evals is not None else None
    device = next((p.device for p in prepared.model.parameters()), torch.device("cpu"))
    telemetry = Telemetry(cfg.telemetry, device=device, model=prepared.model, state=prepared.state, started=started)
    engine = SingleProcess(prepared.model, cfg.train.microbatches, clock=telemetry.clock)
    return train(cfg.train, engine, prepared.state, prepared.data,
                 out_dir=out, controller=prepared.controller, rollout=cfg.rollout, tracker=tracker, evals=evals,
                 baseline=prepared.baseline, resume=resume, faults=faults, steps=steps, telemetry=telemetry,
                 progress=progress, stop=stop)


def run_config(config, out_dir: str | Path, *, faults=(), controller: bool = True, steps: int | None = None,
               resume: bool = False, tracker=None):
    """Train a config (a LowprecConfig, a dict of sections, or a YAML path) in this process, as
    `lowprec run` does without its tracking; pass a `lowprec.tracking.tracker.Tracker` to track."""
    from lowprec.config import LowprecConfig
    if isinstance(config, (str, Path)):
        cfg = LowprecConfig.from_yaml(config)
    elif isinstance(config, dict):
        cfg = LowprecConfig.from_dict(config)
    else:
        cfg = config
    from lowprec.runtime.session.run_life import RunLife
    if tracker is not None:
        tracker.log_config(cfg.to_dict())
    return execute(prepare_run(cfg, controller=controller), Path(out_dir), life=RunLife.around(cfg, tracker),
                   resume=resume, faults=faults, steps=steps)


def train_prepared(prepared: PreparedRun, out: Path, *, name: str, resume: bool | Path = False, faults=(),
                   print_summary: bool = True, started: float | None = None, tracking_optional: bool = False,
                   console=None, stop=None, config_path: str | Path | None = None) -> int:
    """`lowprec run`: train a prepared run tracked in MLflow, print the summary; the exit status
    (2, with nothing written, when resuming finds checkpoints and every one is corrupt; 3 when
    tracking records could not be sent and wait in the outbox, unless `tracking_optional`; 4
    when the disk filled up: one line, the MLflow run KILLED with the reason, the earlier
    checkpoints kept). resume: True (the newest usable checkpoint) or the checkpoint chosen.
    console: the command's `lowprec.runtime.trainer.console.Console` (its log goes to `out`/lowprec.log,
    the progress line and the summary through it); None prints to sys.stdout/sys.stderr.
    stop: the command's `StopRequest`: a signal stops the run at a step with a checkpoint, the
    MLflow run KILLED with the reason, one line naming the command that continues it
    (`config_path`'s), exit 128 + the signal's number."""
    from lowprec.state.checkpoint import NoUsableCheckpointError
    say = console.say if console is not None else (lambda text: print(f"lowprec run: {text}", file=sys.stderr))
    show = console.print if console is not None else print
    cfg = prepared.config
    if (refused := _before_start(out, resume, stop, say)) is not None:
        return refused
    out.mkdir(parents=True, exist_ok=True)
    progress = None
    if console is not None:
        from lowprec.runtime.trainer.console import LOG_NAME
        console.log_to(out / LOG_NAME)
        progress = console.progress(cfg.train.steps, mix=prepared.state.flops_share)
    from lowprec.runtime.session.run_life import RunLife
    from lowprec.tracking.resume import BufferInUseError
    try:   # resume: the MLflow run of a killed `lowprec run` is continued (never a finished one)
        life = RunLife(cfg, name, out / "tracking", resume=resume, logged=logged_config(cfg, out, resume),
                       tags={STEPS_TAG: str(cfg.train.steps)}, system_metrics=True, warn_unsent=False)
    except BufferInUseError as e:   # a live writer took the buffer since the checks (a `lowprec sync`)
        if progress is not None:
            progress.close()
        say(str(e))
        return EXIT_UNUSABLE
    tracker, status, why = life.tracker, RunStatus.FAILED, None
    try:
        res = execute(prepared, out, life=life, resume=resume, faults=faults, started=started, progress=progress,
                      stop=stop)
        status = RunStatus.FINISHED
    except RunStopped as e:
        status, why = RunStatus.KILLED, stopped_reason(e)
        if progress is not None:
            progress.close()
        say(stopped_line(e, out, config_path))
        return e.exit_code
    except NoUsableCheckpointError as e:   # went bad between the check above and the loop
        say(f"--resume: {e}")
        return EXIT_UNUSABLE
    except OSError as e:
        from lowprec.state.durable import NO_SPACE
        if e.errno not in NO_SPACE:
            raise
        status, why = RunStatus.KILLED, f"the disk is full: {e}"
        if progress is not None:
            progress.close()
        say(f"stopped, {why}; the earlier checkpoints are kept: free space there and continue with --resume "
            f"(exit {EXIT_NO_SPACE})")
        return EXIT_NO_SPACE
    finally:
        close_run(progress, life, status, out, why)   # unsent records: said below, last
    run_id = tracker.run_id if tracker is not None else None
    if run_id:
        (out / "run_id").write_text(run_id + "\n")
    if print_summary:
        show(summary_text(name, res, prepared, out, run_id, _tracking_uri(cfg)))
    unsent = unsent_line(tracker)
    if unsent:
        say(unsent + ("" if tracking_optional else f" (exit {EXIT_UNSENT}; --tracking-optional exits 0)"))
        return EXIT_OK if tracking_optional else EXIT_UNSENT
    return EXIT_OK


def _before_start(out: Path, resume, stop, say) -> int | None:
    """`train_prepared`'s exit status when it must not start (None: it may): a resume whose
    checkpoints are all corrupt; a signal that came while the run was being prepared."""
    import warnings
    from lowprec.state.checkpoint import NoUsableCheckpointError, checkpoint_to_resume
    if resume is True:
        try:
            with warnings.catch_warnings():   # the error names every one; the loop warns on skipping
                warnings.simplefilter("ignore")
                checkpoint_to_resume(out / "checkpoints")
        except NoUsableCheckpointError as e:
            say(f"--resume: {e}")
            return EXIT_UNUSABLE
    if stop is not None and stop.requested:   # before the MLflow run exists: nothing to keep
        say(f"stopped by {signal.Signals(stop.requested).name} before training began: nothing was trained or "
            f"tracked (exit {stopped_exit(stop.requested)})")
        return stopped_exit(stop.requested)
    return None


def stopped_reason(e: RunStopped) -> str:
    """The reason a stopped run's MLflow run is tagged with (`lowprec.stopped`)."""
    return f"{e.signal_name} at step {e.step}: a checkpoint was written there; continue with --resume"


def stopped_line(e: RunStopped, out: Path, config_path: str | Path | None, nproc: int = 1) -> str:
    """What `lowprec run` says when a signal stopped it: where, and the command that continues it."""
    from lowprec.runtime.trainer.run_folder import run_command
    cmd = (run_command(config_path, out, nproc=nproc, resume=True) if config_path is not None
           else f"`lowprec run CONFIG --out {out} --resume`")
    return (f"stopped by {e.signal_name} at step {e.step}, with a checkpoint there; the MLflow run is marked "
            f"KILLED. Continue it with {cmd} (exit {e.exit_code})")


def close_run(progress, life, status, out: Path, why: str | None = None) -> None:
    """The end of a `lowprec run` (one process or rank 0 of a job), however the training ended:
    the progress line closed; the run's life ended (`RunLife.end`: a finished run's losses
    uploaded, a KILLED one tagged with `why`; unsent records are the caller's to say, last)."""
    if progress is not None:
        progress.close()
    from lowprec.runtime.session.baseline import LOSSES_ARTIFACT
    life.end(status, losses=out / LOSSES_ARTIFACT, reason=why)


def unsent_line(tracker) -> str | None:
    """What a run whose tracking failed says last: how many records wait in its outbox, why,
    and the command that sends them; None when everything reached the store."""
    if tracker is None or not tracker.enabled:
        return None
    pending = tracker.outbox.n_pending()
    if not pending:
        return None
    why = f" ({tracker.last_error.splitlines()[0][:400]})" if tracker.last_error else ""
    return (f"tracking failed{why}: {pending} records wait in the outbox {tracker.run_dir}; "
            f"send them with `lowprec sync {tracker.run_dir}`")
