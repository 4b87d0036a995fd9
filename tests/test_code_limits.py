"""The size limits of lowprec/: no module over 400 lines, no function over 80 lines.

Read with the AST only (nothing is imported), so the check costs milliseconds.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lowprec"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def _rel(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


def test_no_module_over_400_lines():
    over = []
    for path in _modules():
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_MODULE_LINES:
            over.append(f"{_rel(path)}: {n} lines")
    assert not over, (f"modules over {MAX_MODULE_LINES} lines (split them by job): "
                      + "; ".join(over))


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_no_function_over_80_lines():
    over = []
    for path in _modules():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for fn in _functions(tree):
            start = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
            n = fn.end_lineno - start + 1
            if n > MAX_FUNCTION_LINES:
                over.append(f"{_rel(path)}:{fn.lineno} {fn.name}: {n} lines")
    assert not over, (f"functions over {MAX_FUNCTION_LINES} lines (split them): "
                      + "; ".join(over))


def test_the_check_sees_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    fn = next(_functions(ast.parse(f"def long():\n{body}\n")))
    assert fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES
