"""The `lowprec` command line: `lowprec plan CONFIG`, `gate`, `report RUN_ID`, `ui`, `sync RUN_DIR`.

(`report`, `ui` and `sync` live in lowprec.tracking.cli; more commands land with their features.)

`gate` compares a candidate run with a baseline run stored in MLflow (exit 0 pass, 1
regression, 2 unusable input). Its arguments are declared here; the work is done by the
`gates` package, imported inside `_cmd_gate` only. That handler is the one place where
lowprec reaches `gates` (imports otherwise flow `gates -> lowprec`): `lowprec gate` is the
command the design names, and `import lowprec` never loads gates.

`plan` builds the config's model (its `model.factory`, "package.module:function", with
`model.args`), resolves the `precision:` section against it and prints every linear
layer: FQN, shape, format now, ladder, and why. A plan that cannot be used exits with
status 2 and the error (which names the config path, what was found, and the fix).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import yaml

__all__ = ["main", "load_config", "build_model"]


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


def _cmd_gate(args) -> int:
    from gates.cli import main as gate_main  # the one place lowprec reaches gates (see the module doc)
    return gate_main(args)


def _add_gate_command(sub) -> None:
    p = sub.add_parser("gate", help="compare a candidate run with a baseline run, gate by gate (exit 0 pass, "
                       "1 regression, 2 unusable input)",
                       description="Compare a candidate run's eval metrics with a baseline run's, stored in "
                       "MLflow, against the gates of a gate file (see docs/gates.md). Exit status: 0 pass, "
                       "1 regression, 2 unusable input.")
    p.add_argument("--baseline", required=True, metavar="RUN", help="baseline MLflow run id (or unique run name)")
    p.add_argument("--candidate", required=True, metavar="RUN", help="candidate MLflow run id (or unique run name)")
    p.add_argument("--gates", required=True, metavar="FILE", help="gate file (YAML), e.g. gates/default.yaml")
    p.add_argument("--tracking-uri", default=None, metavar="URI",
                   help="MLflow tracking URI (default: sqlite:///<current directory>/mlflow.db)")
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="compare the evals at step N in both runs (default: each run's last step at which "
                   "every gated metric was evaluated)")
    p.add_argument("--markdown", default=None, metavar="FILE",
                   help="append a Markdown summary to FILE (e.g. \"$GITHUB_STEP_SUMMARY\")")
    p.add_argument("--junit", default=None, metavar="FILE", help="write JUnit XML (one testcase per gate) to FILE")
    p.add_argument("--inconclusive", choices=("pass", "fail"), default="pass",
                   help="whether an inconclusive gate fails the command (default: pass; in JUnit it is skipped)")
    p.set_defaults(func=_cmd_gate)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lowprec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_plan = sub.add_parser("plan", help="print the precision plan of a config's model")
    p_plan.add_argument("config", help="training config YAML with model: and precision: sections")
    p_plan.set_defaults(func=_cmd_plan)
    _add_gate_command(sub)
    from lowprec.tracking.cli import add_tracking_commands  # report, ui, sync
    add_tracking_commands(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
