"""The `lowprec` command line: `plan`, `report`, `ui`, `sync`, and the commands other packages register.

The subcommands come from registrars, functions `register(subparsers)` that add one or
more commands: the built-ins listed in `BUILTIN_REGISTRARS` (`plan` here; `report`, `ui`,
`sync` from lowprec.tracking.cli), then every entry point in the group `lowprec.commands`
that an installed package declares. The `gates` package declares `gate` that way
(`gate = "gates.cli:register"` in pyproject.toml), so lowprec never imports gates: imports
flow one way, `gates -> lowprec`.

`plan` builds the config's model (its `model.factory`, "package.module:function", with
`model.args`), resolves the `precision:` section against it and prints every linear
layer: FQN, shape, format now, ladder, and why. A plan that cannot be used exits with
status 2 and the error (which names the config path, what was found, and the fix)."""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable

import yaml

from lowprec.tracking import cli as tracking_cli

__all__ = ["main", "build_parser", "load_config", "build_model", "BUILTIN_REGISTRARS", "ENTRY_POINT_GROUP"]


class ConfigError(ValueError):
    pass


def load_config(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        cfg = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{p} is not valid YAML: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{p} must hold a mapping with sections model:, precision:, ...; "
                          f"found {type(cfg).__name__}")
    return cfg


def build_model(model_cfg: dict, search_path: Path | None = None):
    """Instantiate `model.factory` ("pkg.module:function") with `model.args`."""
    if not isinstance(model_cfg, dict) or "factory" not in model_cfg:
        raise ConfigError("the config needs a `model:` section with `factory: package.module:function` "
                          "(e.g. experiments.model:build_gpt) and optional `args:`")
    target = model_cfg["factory"]
    mod_name, sep, fn_name = str(target).partition(":")
    if not sep:
        raise ConfigError(f"model.factory must look like 'package.module:function', got {target!r}")
    if search_path is not None and str(search_path) not in sys.path:
        sys.path.insert(0, str(search_path))
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot load model.factory {target!r}: {e}") from None
    return fn(**(model_cfg.get("args") or {}))


def _cmd_plan(args) -> int:
    from lowprec.backends import get_backend
    from lowprec.plan import PlanError, PrecisionPlan, format_plan_table, resolve

    try:
        cfg = load_config(args.config)
        if "precision" not in cfg:
            raise ConfigError(f"{args.config} has no `precision:` section")
        plan = PrecisionPlan.from_dict(cfg["precision"])
        model = build_model(cfg.get("model"), search_path=Path.cwd())
        backend = get_backend(plan.backend)
        sites = resolve(model, plan, supported=backend.supports)
    except (ConfigError, PlanError, ValueError) as e:
        print(f"lowprec plan: {e}", file=sys.stderr)
        return 2
    print(format_plan_table(sites))
    return 0


def add_plan_command(sub) -> None:
    p = sub.add_parser("plan", help="print the precision plan of a config's model")
    p.add_argument("config", help="training config YAML with model: and precision: sections")
    p.set_defaults(func=_cmd_plan)


Registrar = Callable[[Any], None]  # register(subparsers): adds one or more subcommands

# The commands lowprec itself ships, in `--help` order. Another built-in is one more entry here.
BUILTIN_REGISTRARS: tuple[Registrar, ...] = (
    add_plan_command,
    tracking_cli.add_commands,  # report, ui, sync
)

ENTRY_POINT_GROUP = "lowprec.commands"


def _plugin_registrars(taken: set[str]) -> list[Registrar]:
    """Every `register(subparsers)` declared in the entry point group `lowprec.commands`, by name.

    A command that cannot be loaded, or whose name a built-in already uses, is left out with
    a warning on stderr: one broken package does not take the other commands down with it.
    """
    found = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        where = f"entry point {ep.name} = {ep.value!r} (group {ENTRY_POINT_GROUP!r})"
        if ep.name in taken:
            print(f"lowprec: ignoring {where}: `{ep.name}` is already a lowprec command; "
                  f"rename the entry point in the package that declares it", file=sys.stderr)
            continue
        try:
            register = ep.load()
        except Exception as e:  # noqa: BLE001 - any error in someone else's import
            print(f"lowprec: cannot load the `{ep.name}` command ({where}): {type(e).__name__}: {e}; "
                  f"reinstall the package that declares it, or uninstall it", file=sys.stderr)
            continue
        found.append(register)
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lowprec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for register in BUILTIN_REGISTRARS:
        register(sub)
    for register in _plugin_registrars(set(sub.choices)):
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
