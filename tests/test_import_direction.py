"""Imports flow one way: experiments use lowprec, never the reverse; inside lowprec, the core never
imports lowprec.gates or lowprec.evals.

Every .py file under lowprec/ is parsed with `ast` (nothing is imported), so an import
inside a function counts as much as one at the top: a lazy import is still a dependency.
The core (lowprec/cli.py, the runtime) finds gate, evaluator and command implementations
through entry points instead.

The folders under lowprec/ are its layers. Each folder's `__init__` docstring says which
other folders it may import ('May import: ...'); the tests read those rules from the
folders, hold every import to them, and find no cycle between modules or between packages.
The lower layers (base, numerics, sites, policy, state) stay clear of the tracking layer:
no MLflow, no matplotlib. Tracking reads them, not the other way round.

What imports cannot show, one object writing another's state at run time (an autograd
function writing onto its layer, a private attribute set from outside), is held by
tests/test_object_boundaries.py.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lowprec"

OUTSIDE = ("experiments", "gates", "eval_suites")  # built on lowprec; the last two are data folders, not packages
PLUGINS = ("lowprec.gates", "lowprec.evals")     # reached from the core only through entry points
TRACKING = ("mlflow", "matplotlib", "lowprec.tracking")

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


def test_lowprec_never_imports_experiments_or_the_data_folders():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20, f"found only {len(files)} files under {PACKAGE}"
    bad = _violations(files, OUTSIDE)
    assert not bad, ("lowprec must not import what is built on it, nor the top-level data folders (their "
                     "files are the package data lowprec.gates.files and lowprec.evals.texts):\n" + "\n".join(bad))


def test_the_core_never_imports_gates_or_evals():
    """Only lowprec.gates and lowprec.evals import themselves: the CLI and the runtime find them
    through entry points (pyproject.toml), so the core runs and installs without them."""
    files = [p for p in sorted(PACKAGE.rglob("*.py"))
             if not any(p.is_relative_to(PACKAGE / plugin.split(".")[1]) for plugin in PLUGINS)]
    assert PACKAGE / "cli.py" in files and PACKAGE / "runtime" / "session" / "evals.py" in files and len(files) > 60, len(files)
    bad = _violations(files, PLUGINS)
    assert not bad, ("the core must not import lowprec.gates or lowprec.evals (declare an entry point in "
                     "pyproject.toml and look it up instead):\n" + "\n".join(bad))
    for a, b in (PLUGINS, PLUGINS[::-1]):   # and neither imports the other
        own = sorted((PACKAGE / a.split(".")[1]).rglob("*.py"))
        assert own and not (cross := _violations(own, (b,))), cross


def _may_import() -> dict[str, set[str]]:
    """package -> the lowprec packages it may import, read from the 'May import:' paragraph of
    each folder's `__init__` docstring (the folders are the layers)."""
    rules = {}
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        m = re.search(r"May import:(.*?)(?:\n\n|$)", doc, re.S)
        assert m, f"{init.relative_to(ROOT)}: its docstring must say what the package may import ('May import: ...')"
        rules[init.parent.name] = set(re.findall(r"lowprec\.(\w+)", m.group(1)))
    return rules


def _package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else ""


def _graph() -> dict[str, dict[str, str]]:
    """module -> {imported lowprec module: 'file:line'}, every import at any depth."""
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        edges = graph.setdefault(module, {})
        for line, name in imported_modules(path.read_text(), module, path.name == "__init__.py"):
            if name == "lowprec" or name.startswith("lowprec."):
                # `from lowprec.x import Name` also lists lowprec.x.Name: keep the longest real module
                while name not in _ALL_MODULES and "." in name:
                    name = name.rpartition(".")[0]
                if name != module:
                    edges.setdefault(name, f"{path.relative_to(ROOT)}:{line}")
    return graph


_ALL_MODULES = {_module_name(p) for p in PACKAGE.rglob("*.py")}


def test_every_folder_is_a_layer_that_imports_only_what_its_docstring_allows():
    rules = _may_import()
    assert {"base", "numerics", "sites", "policy", "state", "tracking", "config", "runtime", "gates", "evals"} <= set(rules), sorted(rules)
    assert not [(a, b) for a in rules for b in rules[a] if f"lowprec.{b}" in PLUGINS and a != b], \
        "no layer's 'May import' may name lowprec.gates or lowprec.evals"
    bad = []
    for module, edges in _graph().items():
        src = _package_of(module)
        if not src:
            continue  # lowprec/__init__.py and lowprec/cli.py sit above every layer
        for name, where in edges.items():
            dst = _package_of(name)
            if dst and dst != src and dst not in rules[src]:
                bad.append(f"{where}: lowprec.{src} imports {name}; lowprec/{src}/__init__.py allows "
                           f"{', '.join(sorted(rules[src])) or 'nothing from lowprec'}")
    assert not bad, "imports go only downwards:\n" + "\n".join(sorted(bad))


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of `graph` as a list of nodes, or []."""
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        state[n] = 2
        stack.pop()
        return []

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return []


def test_the_layer_rules_have_no_cycle():
    rules = _may_import()
    assert not (c := _cycle(rules)), f"the folders' 'May import' rules form a cycle: {' -> '.join(c)}"


def test_no_import_cycle_between_modules_or_packages():
    graph = _graph()
    modules = {m: {n for n in edges if n != "lowprec"} for m, edges in graph.items()}
    # a package's __init__ importing its own submodules is how a package exposes them, not a cycle
    modules = {m: {n for n in e if not (m and n.startswith(m + ".") and (PACKAGE / Path(*m.split(".")[1:])).is_dir())}
               for m, e in modules.items()}
    assert not (c := _cycle(modules)), f"module import cycle: {' -> '.join(c)}"
    packages = {}
    for m, edges in graph.items():
        for n in edges:
            a, b = _package_of(m), _package_of(n)
            if a and b and a != b:
                packages.setdefault(a, set()).add(b)
    assert not (c := _cycle(packages)), f"package import cycle: {' -> '.join(c)}"


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_numerics_sites_policy_and_state_do_not_import_tracking():
    files = [p for layer in ("base", "numerics", "sites", "policy", "state") for p in sorted((PACKAGE / layer).rglob("*.py"))]
    files.append(PACKAGE / "__init__.py")
    assert len(files) > 30, f"found only {len(files)} files in the lower layers"
    bad = _violations(files, TRACKING)
    assert not bad, ("the numerics, sites, policy and state layers must not import MLflow, matplotlib or "
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
