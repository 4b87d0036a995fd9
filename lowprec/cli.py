"""The `lowprec` command line: `run`, `plan`, `profile`, `report`, `ui`, `sync`, and the commands other packages register.

The subcommands come from registrars, functions `register(subparsers)` that add one or
more commands: the built-ins listed in `BUILTIN_REGISTRARS` (`plan` and `run` from
lowprec.runtime.trainer.cli; `profile` from lowprec.profile.cli; `report`, `ui`, `sync` from
lowprec.tracking.cli), then every entry point in the group `lowprec.commands` that an installed package declares.
lowprec.gates declares `gate` that way (`gate = "lowprec.gates.cli:register"` in pyproject.toml), so
this module never imports it: imports flow one way, `lowprec.gates -> the core`."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points
from typing import Any, Callable

from lowprec.profile import cli as profile_cli
from lowprec.runtime.trainer import cli as runtime_cli
from lowprec.tracking import cli as tracking_cli

__all__ = ["main", "build_parser", "BUILTIN_REGISTRARS", "ENTRY_POINT_GROUP"]


Registrar = Callable[[Any], None]  # register(subparsers): adds one or more subcommands

# The commands lowprec itself ships, in `--help` order. Another built-in is one more entry here.
BUILTIN_REGISTRARS: tuple[Registrar, ...] = (
    runtime_cli.register,       # plan, run
    profile_cli.register,       # profile
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
