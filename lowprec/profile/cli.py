"""`lowprec profile CONFIG`: measure every site's sensitivity and write the staged plan it implies.

    lowprec profile CONFIG [--steps N | --checkpoint PATH | --from-profile PROFILE.json]
                           [--batches B] [--formats F,F] [--sample N] [--budget X]
                           [--max-share FORMAT=S ...] [--stages K] [--write PATH] [--out DIR]
                           [--no-tracking] [--distributed]

The model is built as `lowprec run` builds it, trained `--steps` steps in BF16 (or loaded
from a `lowprec run` checkpoint), then every site is profiled in every format of its ladder
(or `--formats`) on `--batches` held batches (lowprec.profile.measure). The ranked table is
printed and written with its picture to `--out`; the config with the profiled `precision:`
and `rollout:` is written to `--write` (default: beside CONFIG, `NAME.profiled.yaml`) and
checked as `lowprec plan` checks it; the profile is an MLflow run (`profile-NAME`) in the
config's experiment. `--distributed` under torchrun splits the pairs over the ranks.
`--from-profile` re-plans from a profile.json written before (another budget, caps or number of
stages) without measuring again: nothing is trained and no pass is run.
Exit status 0, or 2 on a config or an argument that cannot be used (nothing written).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from lowprec.base.parse import ConfigError
from lowprec.state.durable import replace_durably

__all__ = ["register"]

EXIT_OK, EXIT_UNUSABLE = 0, 2
TABLE_ROWS = 40


def register(sub) -> None:
    p = sub.add_parser("profile", help="measure each site's sensitivity per format and write a staged plan from it")
    p.add_argument("config", help="training config YAML (see docs/config.md)")
    p.add_argument("--steps", type=int, default=50,
                   help="BF16 warm-up steps before profiling (default 50; 0 profiles the model as built)")
    p.add_argument("--checkpoint", default=None, help="profile the weights of this `lowprec run` checkpoint instead")
    p.add_argument("--from-profile", default=None, metavar="PROFILE_JSON",
                   help="plan from this profile.json (written by an earlier `lowprec profile` of the same model) "
                        "instead of measuring again")
    p.add_argument("--batches", type=int, default=4, help="held batches every pair runs on (default 4)")
    p.add_argument("--formats", default=None,
                   help="comma-separated formats to profile at every site (default: each site's ladder)")
    p.add_argument("--sample", type=int, default=None,
                   help="profile only N sites, spread over the blocks of each role; the others are estimated")
    p.add_argument("--budget", type=float, default=0.05,
                   help="sensitivity above which a site stays in BF16 (default 0.05, see docs/profile.md)")
    p.add_argument("--max-share", action="append", default=[], metavar="FORMAT=SHARE",
                   help="cap a format's share of GEMM FLOPs in the plan, e.g. nvfp4=0.33; repeatable")
    p.add_argument("--stages", type=int, default=3, help="rollout stages to write (default 3)")
    p.add_argument("--write", default=None, help="where the profiled config goes (default CONFIG's NAME.profiled.yaml)")
    p.add_argument("--out", default=None, help="folder for the table, picture and profile (default runs/profile-NAME-TIME)")
    p.add_argument("--no-tracking", action="store_true", help="do not record the profile in MLflow")
    p.add_argument("--verbose", action="store_true",
                   help="show other libraries' output (progress bars, INFO lines) on the terminal too; it is "
                        "always in the --out folder's lowprec.log")
    p.add_argument("--distributed", action="store_true",
                   help="started by torchrun: split the pairs over the ranks (gloo on CPU, nccl on CUDA)")
    p.set_defaults(func=_cmd_profile)


def _fail(console, msg: str) -> int:
    console.say(msg)
    return EXIT_UNUSABLE


def _parse_caps(items: list[str]) -> dict[str, float]:
    from lowprec.numerics.formats import get_format
    caps = {}
    for item in items:
        name, sep, val = item.partition("=")
        try:
            share = float(val)
        except ValueError:
            share = None
        if not sep or share is None or not 0 <= share <= 1:
            raise ConfigError("--max-share", f"expected FORMAT=SHARE with SHARE in [0, 1] (e.g. nvfp4=0.33), "
                              f"found {item!r}")
        try:
            caps[get_format(name).name] = share
        except (KeyError, ValueError) as e:
            raise ConfigError("--max-share", str(e).strip("'\"")) from None
    return caps


def _check_args(args) -> None:
    if args.steps < 0:
        raise ConfigError("--steps", f"must be >= 0, found {args.steps}")
    if args.batches < 1:
        raise ConfigError("--batches", f"must be >= 1, found {args.batches}")
    if args.stages < 1:
        raise ConfigError("--stages", f"must be >= 1, found {args.stages}")
    if args.sample is not None and args.sample < 1:
        raise ConfigError("--sample", f"must be >= 1, found {args.sample}")
    if not args.budget >= 0:
        raise ConfigError("--budget", f"must be >= 0, found {args.budget}")
    if args.from_profile is not None and (args.checkpoint is not None or args.distributed):
        raise ConfigError("--from-profile", "plans from a profile already measured: it takes no --checkpoint "
                          "and no --distributed")
    if args.checkpoint is not None and not Path(args.checkpoint).exists():
        raise ConfigError("--checkpoint", f"{args.checkpoint} does not exist; give a checkpoint `lowprec run` "
                          f"wrote (RUN/checkpoints/step_*.pt)")


def _site_formats(args, state) -> tuple[dict[str, list[str]], list[str]]:
    """{site: formats to profile} and the pairs left out because the format does not fit the site."""
    from lowprec.numerics.formats import get_format
    from lowprec.numerics.quantize import check_layer_fits
    wanted = None
    if args.formats:
        try:
            wanted = [get_format(f.strip()) for f in args.formats.split(",") if f.strip()]
        except (KeyError, ValueError) as e:
            raise ConfigError("--formats", str(e).strip("'\"")) from None
        for f in wanted:
            ok, why = state.backend.supports(f)
            if not ok:
                raise ConfigError("--formats", f"{f.name}: {why}")
    out, skipped = {}, []
    for fqn, site in state.sites.items():
        out[fqn] = []
        for fmt in (wanted if wanted is not None else site.ladder):
            if fmt.is_high_precision:
                continue
            try:
                check_layer_fits(fmt, site.module.out_features, site.module.in_features, fqn)
            except ValueError:
                skipped.append(f"{fqn}:{fmt.name}")
                continue
            out[fqn].append(fmt.name)
    return out, skipped


def _cmd_profile(args) -> int:
    from lowprec.runtime.trainer.console import Console
    with Console("profile", verbose=args.verbose) as console:   # progress lines; other libraries' output: the log
        try:
            _check_args(args)
            caps = _parse_caps(args.max_share)
            return _profile(args, caps, console)
        except (ConfigError, ValueError, TypeError) as e:
            return _fail(console, str(e))


def _profile(args, caps: dict[str, float], console) -> int:
    import torch.distributed as dist
    from lowprec.config import LowprecConfig
    from lowprec.profile.measure import profile_sites
    from lowprec.profile.planner import choose_formats, order_stages
    from lowprec.runtime.trainer.run import prepare_run

    cfg = LowprecConfig.from_yaml(args.config)
    name = cfg.tracking.run_name or Path(args.config).stem
    if args.from_profile is not None:
        return _replan(args, cfg, name, caps, console)
    rank = 0
    if args.distributed:
        rank = _init_distributed(cfg)
    prepared = prepare_run(replace(cfg, rollout=None, eval=None), controller=False)
    model, state = prepared.model, prepared.state
    formats, skipped = _site_formats(args, state)
    n_pairs = sum(len(v) for v in formats.values())
    if n_pairs == 0:
        raise ConfigError("precision", "no site has a low-precision format to profile on its ladder; give "
                          "--formats (e.g. fp8_tensorwise,nvfp4) or ladders in the plan's rules")
    say = console.print if rank == 0 else (lambda *a, **k: None)
    if args.checkpoint:
        _load_weights(args.checkpoint, model)
        say(f"weights: {args.checkpoint}")
    elif args.steps:
        say(f"warm-up: {args.steps} steps in bf16 ...")
        _warm_up(cfg, prepared, args.steps, console if rank == 0 else None)
    if args.distributed:
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    batches = [prepared.data.next() for _ in range(args.batches)]
    world = dist.get_world_size() if args.distributed else 1
    n_sites = len(state.sites) if args.sample is None else min(args.sample, len(state.sites))
    per_rank = -(-n_pairs * n_sites // len(state.sites) // world)
    say(f"profiling {len(state.sites)} sites{f' ({n_sites} sampled)' if args.sample else ''}, {n_pairs} "
        f"(site, format) pairs{f' ({len(skipped)} more do not fit: {skipped[:3]})' if skipped else ''}; "
        f"{args.batches} held batches of {batches[0][0].numel()} tokens: about "
        f"{args.batches * (1 + per_rank)} forward+backward passes per rank on {world} rank(s)")
    bar = None

    def progress(i, n, cost):
        nonlocal bar
        if rank == 0:
            bar = bar or console.progress(n, unit="pair")
            bar.update(i)
    profile = profile_sites(model, state, batches, formats=formats, sample=args.sample, seed=cfg.train.seed,
                            progress=progress)
    if bar is not None:
        bar.close()
    ladders = {f: [x.name for x in s.ladder] for f, s in state.sites.items()}
    choices = choose_formats(profile, ladders, budget=args.budget, max_share=caps)
    stages = order_stages(choices, profile, args.stages)
    if rank == 0:
        _write_outputs(args, cfg, name, prepared, profile, choices, stages, console)
    if args.distributed:
        dist.barrier()
        dist.destroy_process_group()
    return EXIT_OK


def _read_profile(path: str, state):
    """A profile.json of an earlier `lowprec profile`, checked against this config's sites."""
    from lowprec.profile.measure import Profile
    try:
        profile = Profile.from_dict(json.loads(Path(path).read_text()))
    except FileNotFoundError:
        raise ConfigError("--from-profile", f"{path} does not exist; give the profile.json an earlier "
                          f"`lowprec profile` wrote in its --out folder") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError("--from-profile", f"{path} is not a profile.json written by `lowprec profile` "
                          f"({type(e).__name__}: {e})") from None
    unknown = sorted({e.fqn for e in profile.entries} - set(state.sites))
    missing = sorted(set(state.sites) - {e.fqn for e in profile.entries})
    if unknown or missing:
        raise ConfigError("--from-profile", f"{path} does not profile this config's sites (not in the model: "
                          f"{unknown[:3]}, not in the profile: {missing[:3]}); profile this config again")
    return profile


def _replan(args, cfg, name: str, caps: dict[str, float], console) -> int:
    """The plan, table and written config from a profile measured before: no training, no passes."""
    from lowprec.profile.planner import choose_formats, order_stages
    from lowprec.runtime.trainer.run import prepare_run
    prepared = prepare_run(replace(cfg, rollout=None, eval=None), controller=False, with_data=False)
    profile = _read_profile(args.from_profile, prepared.state)
    console.print(f"profile: {args.from_profile} ({len(profile.entries)} pairs, measured with "
                  f"{profile.passes_per_rank} passes per rank); nothing is measured again")
    ladders = {f: [x.name for x in s.ladder] for f, s in prepared.state.sites.items()}
    choices = choose_formats(profile, ladders, budget=args.budget, max_share=caps)
    _write_outputs(args, cfg, name, prepared, profile, choices, order_stages(choices, profile, args.stages), console)
    return EXIT_OK


def _write_outputs(args, cfg, name, prepared, profile, choices, stages, console) -> None:
    from lowprec.runtime.trainer.console import LOG_NAME
    from lowprec.profile.report import draw, log_to_mlflow, plan_lines, ranked_table, write_csv
    from lowprec.profile.written import check_written, write_config
    out = Path(args.out) if args.out else Path("runs") / f"profile-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg_path = Path(args.config)
    written = Path(args.write) if args.write else cfg_path.with_name(cfg_path.stem + ".profiled.yaml")
    order = [f for f, _ in prepared.model.named_modules() if f in choices]
    pending = written.with_name(f".{written.name}.pending.yaml")   # checked before it takes the name
    try:
        text = write_config(args.config, pending, choices, stages, order, header=_header(args, profile))
        check_written(pending)
    except BaseException:
        pending.unlink(missing_ok=True)
        raise
    replace_durably(pending, written)
    out.mkdir(parents=True, exist_ok=True)
    console.log_to(out / LOG_NAME)
    (out / "profiled.yaml").write_text(text)
    (out / "profile.json").write_text(json.dumps(profile.to_dict(), indent=1, allow_nan=True))
    write_csv(profile, out / "profile.csv")
    table = ranked_table(profile, choices)
    lines = plan_lines(choices, stages, args.budget)
    cost = (f"cost: {profile.passes_per_rank} forward+backward passes per rank on {profile.world} rank(s) "
            f"({profile.batches} batches x {profile.tokens_per_batch} tokens), {profile.seconds:.1f} s")
    if args.from_profile is not None:
        cost = f"cost: no passes now (re-planned from {args.from_profile}; its measurement took: {cost[6:]})"
    (out / "profile.txt").write_text("\n".join([table, "", *lines, cost]) + "\n")
    pic = draw(profile, choices, out / "profile.png", args.budget)
    console.print(ranked_table(profile, choices, limit=TABLE_ROWS))
    console.print("\n".join(["", *lines, cost, f"written: {written} (checked as `lowprec plan` checks it)",
                             f"files: {out} (profile.txt, profile.csv, profile.json, profile.png, {LOG_NAME})"]))
    if cfg.tracking.enabled and not args.no_tracking:
        from lowprec.runtime.session.host import tracking_uri as _tracking_uri
        from lowprec.tracking.records import RunStatus
        from lowprec.tracking.tracker import Tracker
        tracker = Tracker(_tracking_uri(cfg), cfg.tracking.experiment, f"profile-{name}", buffer_dir=out / "tracking")
        tracker.log_config(cfg.to_dict())
        log_to_mlflow(tracker, profile, choices, stages,
                      [out / "profile.txt", out / "profile.csv", out / "profile.json", pic, out / "profiled.yaml"],
                      args.budget)
        tracker.finish(RunStatus.FINISHED, report=False)
        console.print(f"MLflow run {tracker.run_id} (profile-{name}) in {_tracking_uri(cfg)}")


def _header(args, profile) -> list[str]:
    sample = f", {profile.sampled} sites sampled" if profile.sampled is not None else ""
    return [f"Written by `lowprec profile {args.config}` on {time.strftime('%Y-%m-%d %H:%M')}: sensitivity "
            f"budget {args.budget:g}, {args.stages} stages, caps {args.max_share or 'none'}{sample};",
            f"{profile.batches} held batches, {profile.passes_per_rank} passes per rank on {profile.world} rank(s). "
            f"Stages go from the least to the most sensitive per FLOP saved."]


def _warm_up(cfg, prepared, steps: int, console=None) -> None:
    """`steps` steps of the config's training in BF16, no controller, no checkpoints (with a
    progress line when `console` is given)."""
    import tempfile
    from lowprec.runtime.engines.engine import SingleProcess
    from lowprec.runtime.trainer.loop import train
    state = prepared.state
    was = {f: s.format for f, s in state.sites.items()}
    state.set_format(list(state.sites), "bf16")
    bar = console.progress(steps, mix=state.flops_share) if console is not None else None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            train(replace(cfg.train, steps=steps), SingleProcess(prepared.model, cfg.train.microbatches), state,
                  prepared.data, out_dir=tmp, checkpoints=False, progress=bar)
        finally:
            if bar is not None:
                bar.close()
    for f, fmt in was.items():
        state.sites[f].module.set_format(fmt)


def _load_weights(path: str, model) -> None:
    """The model weights of a `lowprec run` checkpoint (its optimizer and rollout are not used)."""
    import torch
    from lowprec.state.checkpoint import load_checkpoint
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    load_checkpoint(path, model=model, optimizer=opt, keep_current=("precision", "controller"), restore_rng=False)


def _init_distributed(cfg) -> int:
    import os
    import torch
    import torch.distributed as dist
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:   # torchrun's rendezvous, not our config
        raise ConfigError("--distributed", "needs the variables torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR); "
                          "start it as `torchrun --nproc-per-node N -m lowprec.cli profile CONFIG --distributed`")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    return dist.get_rank()
