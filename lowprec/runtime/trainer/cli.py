"""`lowprec run CONFIG` and `lowprec plan CONFIG` (registered by lowprec.cli).

    lowprec plan CONFIG                      validate the config as `run` does; print the plan and the
                                             runtime inputs (baseline run, data) still missing
    lowprec run CONFIG [--out DIR] [--resume] [--steps N] [--inject KIND:SITE:START:STOP]
                       [--as-baseline] [--run-name NAME] [--no-controller] [--tracking-optional]
                       [--nproc-per-node N]      (N processes under torchrun: lowprec.runtime.trainer.parallel_run)

Exit status 0 when it trained (or the plan is usable: a missing baseline run or data is listed,
not a failure, since `plan` needs only the config and the model), 2 on a config or input that
cannot be used: the message names the config path, what was found, what is allowed and the fix; 3 when
`run` trained but its tracking records could not all be sent (its last line says how many
wait in the outbox and the `lowprec sync` command that sends them; `--tracking-optional`
makes that exit 0); 4 when `run` stopped because the disk is full (a checkpoint or another
file could not be written: one line names it, its folder and the space free there; the
earlier checkpoints are kept, the MLflow run is marked KILLED with the tag `lowprec.stopped`
saying why; free space and continue with `--resume`); 130 or 143 when `run` was stopped by
SIGINT (Ctrl-C) or SIGTERM: it wrote a checkpoint at the next step, marked the MLflow run KILLED
with the reason and said the command that continues it (`lowprec.runtime.trainer.stop_request`).

`--resume` says which checkpoint and step it continues from; with `--steps N` it trains up to
N (below the checkpoint's step: refused, exit 2), as `lowprec.runtime.trainer.resume_check` says.

A run folder has one writer: `run` locks `--out` (`run.lock`, an OS lock that dies with the
process) before it writes anything there, and refuses, exit 2, a folder that a live process
writes (naming its pid and host), a finished run, and a stopped run without `--resume`, each
in words that say which it is (`lowprec.runtime.trainer.run_folder`); a `--resume` whose config
differs from the one the run started with is refused before an MLflow run is touched
(`lowprec.runtime.trainer.resume_check`). `backend: torch` on a device without FP8 tensor cores is
named at start (`run`) and beside the plan (`plan`) (`lowprec.runtime.trainer.device_note`).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

from lowprec.base.parse import ConfigError

__all__ = ["register"]

EXIT_OK, EXIT_UNUSABLE = 0, 2


def register(sub) -> None:
    p = sub.add_parser("plan", help="validate a training config as `run` does, print its precision plan and the "
                       "runtime inputs (baseline run, data) still missing")
    p.add_argument("config", help="training config YAML (see docs/config.md)")
    p.add_argument("--verbose", action="store_true", help="show other libraries' output and INFO lines too")
    p.add_argument("--model-factory", default=None, metavar="MODULE:FUNCTION",
                   help="check a framework callback's YAML (no model: section; docs/integrations.md) against the "
                        "model this function returns, as LowprecCallback.from_yaml does")
    p.add_argument("--speed-table", default=None, metavar="NAME",
                   help="price the rollout's expected tokens/s with this device's measured layer table "
                        "(lowprec.runtime.trainer.speed_estimate.TABLES; default: the model's device's own, if there is one)")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("run", help="train a config: staged rollout, monitors, fallbacks, evals, MLflow tracking")
    p.add_argument("config", help="training config YAML (see docs/config.md)")
    p.add_argument("--out", default=None, help="run folder: checkpoints, events, losses (default runs/<name>-<time>)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    p.add_argument("--steps", type=int, default=None, help="override train.steps")
    p.add_argument("--run-name", default=None, help="override tracking.run_name")
    p.add_argument("--as-baseline", action="store_true",
                   help="train the config's high-precision baseline: every site bf16, no rollout, no in-loop gate")
    p.add_argument("--no-controller", action="store_true", help="run the plan as it is: no promotions, no fallbacks")
    p.add_argument("--tracking-optional", action="store_true",
                   help="exit 0 even when tracking records could not be sent (they wait in the run's outbox for "
                        "`lowprec sync`); without it such a run exits 3")
    p.add_argument("--inject", action="append", default=[], metavar="KIND:SITE:START:STOP[:FACTOR[:EVERY]]",
                   help="inject a fault (nan, nan_one, overflow, input, router, lr_spike, loss_spike, random_tokens) to see the controller act; repeatable")
    p.add_argument("--verbose", action="store_true",
                   help="show other libraries' output (progress bars, INFO lines) on the terminal too; it is "
                        "always in the run folder's lowprec.log")
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="train on N processes of this machine under torchrun, as the config's parallel: section "
                        "splits the model (docs/parallel.md); every check runs before any process starts")
    # the ranks that `--nproc-per-node` starts: the launcher (this pid) holds the run folder for them
    p.add_argument("--launcher-pid", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_run)


def _load(path: str, args=None):
    from lowprec.config import LowprecConfig
    cfg = LowprecConfig.from_yaml(path)
    if args is not None:
        if args.steps is not None:
            if args.steps < 1:
                raise ConfigError("--steps", f"must be >= 1, got {args.steps}")
            cfg = replace(cfg, train=replace(cfg.train, steps=args.steps))
        if args.run_name:
            cfg = replace(cfg, tracking=replace(cfg.tracking, run_name=args.run_name))
        if args.as_baseline:
            from lowprec.runtime.trainer.run import high_precision_baseline
            cfg = high_precision_baseline(cfg)
    return cfg


def _fail(console, e: Exception) -> int:
    console.say(str(e))
    return EXIT_UNUSABLE


def _cmd_plan(args) -> int:
    from lowprec.runtime.trainer.console import Console
    with Console("plan", verbose=args.verbose) as console:   # other libraries' chatter: not shown
        return _plan(args, console)


def _plan(args, console) -> int:
    from lowprec.runtime.trainer.run import prepare_run
    if getattr(args, "model_factory", None):
        return _plan_framework(args, console)
    missing: dict[str, str] = {}
    try:
        if getattr(args, "speed_table", None):
            from lowprec.runtime.trainer.speed_estimate import table_for
            table_for(args.speed_table)      # a misspelt name: refused before the model is built
        cfg = _load(args.config)
    except (ConfigError, ValueError) as e:
        if isinstance(e, ConfigError) and e.path == "model" and _framework_yaml(args.config):   # a callback's YAML: the model is the user's
            e = ConfigError("model", f"{e.message}. This looks like a framework callback's YAML (no model:, data:, "
                            f"train:): check it against your model with `lowprec plan {args.config} "
                            f"--model-factory MODULE:FUNCTION` (a function that builds the model you train)")
        return _fail(console, e)
    try:
        prepared = prepare_run(cfg, missing=missing)
        if cfg.parallel.world > 1:   # the model's own plan takes these degrees (as `run` checks)
            from lowprec.runtime.trainer.parallel_run import check_prepared
            check_prepared(prepared, cfg.parallel)
    except (ConfigError, ValueError, TypeError) as e:
        return _fail(console, e)
    console.print(_table(prepared))
    from lowprec.runtime.trainer.layout import layout_lines
    for line in [""] + layout_lines(cfg, args.config) if cfg.parallel.world > 1 else []:
        console.print(line)
    note = _fast_path_note(prepared)
    if note:
        console.print(f"\nbackend: {note}")
    if prepared.controller is not None:
        console.print("\nrollout stages:")
        for st in prepared.controller.stages:
            console.print(f"  {st.name}: {len(st.sites)} sites -> {st.format}")
    try:
        from lowprec.runtime.trainer.speed_estimate import plan_lines
        console.print(plan_lines(prepared, args.speed_table))
    except ValueError as e:
        return _fail(console, e)
    if missing:
        console.print(f"\nstill missing before `lowprec run` ({len(missing)}; the plan does not need them):")
        for key, why in missing.items():
            console.print(f"  {key}: {why}")
    else:
        console.print("\nevery runtime input is here (baseline, data): `lowprec run` can start")
    console.print("\n" + _shares(prepared))
    return EXIT_OK


def _framework_yaml(path: str) -> bool:
    """Whether the file holds none of the sections a framework owns (`model`, `data`, `train`)."""
    import yaml
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(doc, dict) and not {"model", "data", "train"} & set(doc)


def _fast_path_note(prepared) -> str | None:
    from lowprec.runtime.trainer.device_note import fast_path_note, model_device
    return fast_path_note(prepared.config.precision.backend, model_device(prepared.model))


def _plan_framework(args, console) -> int:
    """`plan --model-factory`: a callback's YAML checked as `LowprecCallback.from_yaml` checks it
    (baseline read, stages resolved against the model, evaluator and gates found)."""
    from types import SimpleNamespace
    from lowprec.config import ConfigRole, LowprecConfig
    from lowprec.runtime.session.framework_check import check_framework_config
    from lowprec.runtime.trainer.run import load_factory
    from lowprec.sites.precision_state import prepare
    try:
        cfg = LowprecConfig.from_yaml(args.config, role=ConfigRole.FRAMEWORK)
        build = load_factory(args.model_factory, "--model-factory", [Path(args.config).resolve().parent, Path.cwd()])
        model = build()
        state = prepare(model, cfg.precision)
        _, controller = check_framework_config(cfg, state, model)
    except (ConfigError, ValueError, TypeError) as e:
        return _fail(console, e)
    console.print(_table(SimpleNamespace(state=state, model=model)))
    if controller is not None:
        console.print("\nrollout stages:")
        for st in controller.stages:
            console.print(f"  {st.name}: {len(st.sites)} sites -> {st.format}")
    console.print("\n" + _shares(SimpleNamespace(state=state, model=model)))
    console.print("\nthe callback's config is valid for this model: LowprecCallback.from_yaml will accept it")
    return EXIT_OK


def _table(prepared) -> str:
    from lowprec.sites.resolution import SitePlan, format_plan_table
    from lowprec.numerics.formats import get_format
    state, bf16 = prepared.state, get_format("bf16")
    sites = {f: SitePlan(f, s.module, s.format, s.ladder, s.reason) for f, s in state.sites.items()}
    sites.update({f: SitePlan(f, prepared.model.get_submodule(f), bf16, (bf16,), why)
                  for f, why in state.kept_high_precision.items()})
    order = [f for f, _ in prepared.model.named_modules() if f in sites]
    return format_plan_table([sites[f] for f in order])


def _shares(prepared) -> str:
    """GEMM FLOPs by kind (experts against the rest) and by format, every GEMM of the model."""
    from lowprec.sites.flop_count import describe_shares
    return describe_shares(prepared.state, dict(prepared.model.named_modules()))


def _cmd_run(args) -> int:
    started = time.perf_counter()   # telemetry: start-up is the time until the first step
    from lowprec.runtime.trainer.console import Console
    from lowprec.runtime.trainer.parallel_run import rank_env
    from lowprec.runtime.trainer.stop_request import StopRequest, stopped_exit
    env = rank_env()   # the console: the progress line (other libraries' output: the log)
    try:
        with Console("run", verbose=args.verbose) as console, StopRequest(console.say, rank=env and env.rank) as stop:
            result = _run(args, console, started, stop)   # Ctrl-C, SIGTERM: it stops at a step, with a checkpoint
    except KeyboardInterrupt:   # a second Ctrl-C (or one where no handler could be installed): at once
        print("lowprec run: stopped at once by Ctrl-C; `--resume` continues from the newest checkpoint",
              file=sys.stderr)
        return stopped_exit(signal.SIGINT)
    # --nproc-per-node: the ranks start once every check passed, outside the console (they write to the terminal)
    return result() if callable(result) else result


def _refuse(console, e: Exception | str, env) -> int:
    """A refused run: one line, from rank 0 only under torchrun (the others wait a moment, so
    that torchrun, which stops every rank at the first exit, lets rank 0 say it)."""
    if env is None or env.rank == 0:
        console.say(str(e))
        return EXIT_UNUSABLE
    from lowprec.runtime.trainer.parallel_run import REFUSED_GRACE_S
    time.sleep(REFUSED_GRACE_S)
    return EXIT_UNUSABLE


def _run(args, console, started: float, stop=None):
    from lowprec.runtime.trainer.faults import parse_injection
    from lowprec.runtime.trainer.parallel_run import rank_env
    from lowprec.runtime.trainer.run_folder import RunFolder, RunFolderBusyError
    env = rank_env()   # under torchrun: this rank's place in the job
    parallel = env is not None or args.nproc_per_node is not None
    try:
        cfg = _load(args.config, args)
        if parallel or cfg.parallel.world > 1:
            from lowprec.runtime.trainer.parallel_run import check_launch
            check_launch(cfg, args.nproc_per_node, env)
            if env is not None and env.world > 1 and not args.out:
                raise ConfigError("--out", "is needed under torchrun: every rank must name the same run folder")
        faults = [parse_injection(t) for t in args.inject]
        name = cfg.tracking.run_name or Path(args.config).stem
        out = Path(args.out) if args.out else Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        if args.resume and not args.out:
            raise ConfigError("--resume", "needs --out DIR: the folder of the run to continue")
    except (ConfigError, ValueError, TypeError) as e:
        return _refuse(console, e, env)
    store = None
    if env is not None and env.world > 1:   # every rank of the job has come before anything is written
        from lowprec.runtime.trainer.parallel_run import PeersMissing, join
        try:
            store = join(env, cfg.parallel.peer_timeout_s)
        except PeersMissing as e:
            console.say(str(e))
            return EXIT_UNUSABLE
    try:   # one writer per run folder (rank 0's for a job): taken before anything is written, held until the end
        folder = RunFolder.take(out, rank=env.rank if env is not None else 0, held_by=args.launcher_pid)
    except RunFolderBusyError as e:
        return _refuse(console, e, env)
    except OSError as e:   # a file where the folder should be, a folder that cannot be written
        return _refuse(console, f"--out {out}: cannot be a run folder ({e.strerror or e}); give a folder you can "
                                f"write", env)
    try:
        result = _run_locked(args, console, started, folder, cfg, faults, name, env, store, stop)
    except BaseException:
        folder.release()
        raise
    finally:
        if store is not None:   # the process group _run_locked joined, left on every path
            from lowprec.runtime.trainer.parallel_run import end_group
            end_group()
    if not callable(result):   # a Launch holds the folder until its last rank exits
        folder.release()
    return result


def _run_locked(args, console, started: float, folder, cfg, faults, name: str, env, store, stop=None):
    """`lowprec run` once this process holds the run folder (rank 0 under torchrun): refuse
    what the folder's state does not allow (saying what that state is), check a resume's
    config, then train: here, on this rank of a torchrun job, or by starting torchrun
    (`--nproc-per-node`, once every check passed; the ranks take the folder themselves)."""
    from lowprec.runtime.trainer.resume_check import record_config, resume_line, resume_mismatch, send_finished
    from lowprec.runtime.trainer.parallel_run import PeersMissing
    from lowprec.runtime.trainer.run import prepare_run
    from lowprec.runtime.trainer.run_folder import FolderState, refusal
    out, tracked = folder.folder, cfg.tracking.enabled
    lead = env is None or env.rank == 0   # the rank that writes the folder
    status = folder.status()
    if lead and args.resume and tracked and status.state is FolderState.FINISHED \
            and (sent := send_finished(out, console)) is not None:
        return sent
    line = refusal(status, resume=args.resume, config=args.config, tracked=tracked, nproc=cfg.parallel.world)
    if line is None and args.resume:
        line = resume_mismatch(out, cfg, args.config)
    if line is not None:
        return _refuse(console, line, env)
    placed = layout = None
    try:
        if env is not None and env.world > 1:   # this rank's GPU (or the CPU), before the model is built
            from lowprec.runtime.trainer.parallel_run import place_rank, start_group
            placed = place_rank(cfg.parallel, env)
            layout = start_group(cfg.parallel, env, placed, store)   # the mesh's amax group goes to prepare
        elif args.nproc_per_node is not None:   # the launcher: every rank it starts can have its device
            from lowprec.runtime.engines.rank_device import cuda_devices, rank_device
            rank_device(cfg.parallel.device, args.nproc_per_node - 1, cuda_devices())
        if tracked and lead:  # the run folder's MLflow run: continued only by --resume, never once finished
            from lowprec.tracking.resume import check_buffer
            check_buffer(out / "tracking", resume=args.resume)
        prepared = prepare_run(cfg, controller=not args.no_controller, amax_group=getattr(layout, "amax_group", None))
        names = dict(prepared.model.named_modules())
        bad = [j.site for j in faults if j.kind.needs_site and j.site not in names]
        if bad:
            raise ConfigError("--inject", f"names no module of the model: {bad}; sites: "
                              f"{', '.join(list(prepared.state.sites)[:6])} ...")
        if cfg.parallel.world > 1:
            from lowprec.runtime.trainer.parallel_run import check_prepared
            check_prepared(prepared, cfg.parallel)
    except (ConfigError, ValueError, TypeError) as e:
        return _refuse(console, e, env)
    except PeersMissing as e:   # start_group: a peer went away before the group was up
        return console.say(str(e)) or EXIT_UNUSABLE
    chosen = None
    if args.resume and env is None and args.nproc_per_node is None:   # one process: chosen once, here
        from lowprec.state.checkpoint import NoUsableCheckpointError, checkpoint_to_resume, list_checkpoints
        try:
            with warnings.catch_warnings(record=True) as skipped:   # said once each, unless none is usable
                warnings.simplefilter("always")
                chosen = checkpoint_to_resume(out / "checkpoints")
        except NoUsableCheckpointError as e:
            return _refuse(console, f"--resume: {e}", env)   # one line naming every one
        for w in skipped:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if args.resume and (line := resume_mismatch(out, cfg, args.config, model=prepared.model,
                                                checkpoint=chosen)) is not None:
        return _refuse(console, line, env)   # its checkpoint against this model, before MLflow is touched
    if chosen is not None:
        step = next(s for s, p in list_checkpoints(out / "checkpoints") if p == chosen)
        line, note = resume_line(out, cfg, chosen, step)
        if line is not None:
            return _refuse(console, line, env)
        console.say(note)
    if lead and (note := _fast_path_note(prepared)):
        console.say(note)
    if lead and status.state is FolderState.NEW:
        record_config(out, cfg)
    if args.nproc_per_node is not None:
        from lowprec.runtime.trainer.launcher import Launch, launch_argv
        return Launch(args.nproc_per_node, *launch_argv(args, out), folder=folder)
    if env is not None and env.world > 1:
        from lowprec.runtime.trainer.parallel_run import train_ranks
        return train_ranks(prepared, out, name=name, env=env, placed=placed, layout=layout, resume=args.resume,
                           faults=faults, console=console, started=started,
                           tracking_optional=args.tracking_optional, stop=stop, config_path=args.config)
    from lowprec.runtime.trainer.run import train_prepared
    return train_prepared(prepared, out, name=name, resume=chosen or args.resume, faults=faults, started=started,
                          tracking_optional=args.tracking_optional, console=console, stop=stop, config_path=args.config)
