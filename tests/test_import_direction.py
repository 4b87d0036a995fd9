"""Imports flow one way: gates, eval_suites and experiments use lowprec, never the reverse.

Every .py file under lowprec/ is parsed with `ast` (nothing is imported), so an import
inside a function counts as much as one at the top: a lazy import is still a dependency.
lowprec finds gate, evaluator and command implementations through entry points instead.

The numerics, the model side and the decisions (formats ... rollout) also stay clear of the
tracking layer: no MLflow, no matplotlib, no lowprec.tracking. Tracking reads them, not
the other way round.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lowprec"

OUTSIDE = ("gates", "eval_suites", "experiments")  # the packages built on lowprec
TRACKING = ("mlflow", "matplotlib", "lowprec.tracking")
# Modules (relative to lowprec/) that must not reach the tracking layer; a folder means every file in it.
CORE = ["__init__.py", "formats.py", "quantize.py", "hadamard.py", "delayed.py", "plan.py", "layers.py",
        "quantized_gemms.py", "grid.py", "quant_stats.py", "strenum.py", "rng.py", "durable.py",
        "state.py", "backends", "monitor.py", "controller.py", "events.py", "rollout.py", "fp8_ops.py",
        "fp8_linear.py", "kernels", "weight_cache.py", "ranks.py"]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import in `source`, at any depth, relative
    imports resolved against `module`; `importlib.import_module("x")` / `__import__("x")`
    with a literal name count too."""
    found = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            found += [(node.lineno, f"{name}.{a.name}") for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            fn = node.func
            fname = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if fname in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def _violations(files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    bad = {}  # (file, line) -> message: one per import statement
    for path in files:
        module = _module_name(path)
        for line, name in imported_modules(path.read_text(), module, path.name == "__init__.py"):
            hit = next((f for f in forbidden if name == f or name.startswith(f + ".")), None)
            where = f"{path.relative_to(ROOT)}:{line}"
            if hit and where not in bad:
                bad[where] = f"{where}: imports {name} ({hit} is not allowed here)"
    return sorted(bad.values())


def test_lowprec_never_imports_gates_eval_suites_or_experiments():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20, f"found only {len(files)} files under {PACKAGE}"
    bad = _violations(files, OUTSIDE)
    assert not bad, ("lowprec must not import the packages built on it (declare an entry point in "
                     "pyproject.toml and look it up from lowprec instead):\n" + "\n".join(bad))


def test_numerics_model_and_decisions_do_not_import_tracking():
    files, missing = [], []
    for name in CORE:
        p = PACKAGE / name
        if p.is_dir():
            files += sorted(p.rglob("*.py"))
        elif p.is_file():
            files.append(p)
        else:
            missing.append(name)
    assert not missing, f"{missing} listed in CORE but not under {PACKAGE}: update CORE in {Path(__file__).name}"
    bad = _violations(files, TRACKING)
    assert not bad, ("the numerics, model side and decisions must not import MLflow, matplotlib or "
                     "lowprec.tracking (the tracking layer reads them, not the reverse):\n" + "\n".join(bad))


def test_the_scanner_finds_imports_at_any_depth():
    src = ("import os\n"
           "def f():\n"
           "    from gates.cli import register\n"
           "    import importlib; importlib.import_module('eval_suites.lm')\n"
           "class C:\n"
           "    def g(self):\n"
           "        from ..tracking import tracker\n"
           "        from . import cli\n")
    got = imported_modules(src, "lowprec.x.y")
    assert (3, "gates.cli") in got and (4, "eval_suites.lm") in got
    assert (7, "lowprec.tracking.tracker") in got and (8, "lowprec.x.cli") in got
    assert imported_modules("from . import a", "lowprec.pkg", is_package=True) == [(1, "lowprec.pkg"), (1, "lowprec.pkg.a")]
