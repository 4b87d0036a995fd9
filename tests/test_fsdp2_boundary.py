"""No lowprec module writes FSDP2's own state (issue 52): FSDP2 is reached through its public API only.

FSDP2 (`torch.distributed.fsdp.fully_shard`) keeps its per-parameter and per-module state in
the attributes of its internal classes (`FSDPParam.all_gather_outputs`,
`FSDPParam._unsharded_param`, `FSDPParamGroup.fsdp_params`, ...); nothing promises that the
next torch release keeps them. lowprec's FP8 all-gather (`lowprec.sites.fp8_allgather`) uses
FSDP2's tensor extension point (`fsdp_pre_all_gather` / `fsdp_post_all_gather`) instead.

The names are read from the installed torch's FSDP2 sources (every `self.name = ...` there),
less the names lowprec's own classes assign on `self` (attributes lowprec owns, such as
`device`). A write is `obj.name = ...`, `obj.name += ...`, `del obj.name`, `setattr(obj,
"name", ...)` or `delattr(obj, "name")` with `obj` not `self` / `cls`; calling FSDP2's private
`_get_fsdp_state()` counts too (the way to its state). Read from the source with `ast`.
"""

from __future__ import annotations

import ast
import importlib.util
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lowprec"
_OWN = {"self", "cls"}


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _self_assigned(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for e in ast.walk(t):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    names.add(e.attr)
    return names


@cache
def fsdp2_state_names() -> frozenset[str]:
    """What FSDP2's classes keep on themselves, less what lowprec's classes keep on theirs."""
    torch_dir = Path(importlib.util.find_spec("torch").origin).parent   # found, not imported
    src = torch_dir / "distributed" / "fsdp" / "_fully_shard"
    fsdp = set().union(*(_self_assigned(_tree(p)) for p in src.glob("*.py")))
    assert {"all_gather_outputs", "_unsharded_param", "fsdp_params"} <= fsdp, "FSDP2's sources moved"
    own = set().union(*(_self_assigned(_tree(p)) for p in PACKAGE.rglob("*.py")))
    return frozenset((fsdp - own) | {"_get_fsdp_state"})


def fsdp2_writes(source: str | ast.Module, names: set[str]) -> list[tuple[int, str]]:
    """(line, text) of each write to (or `_get_fsdp_state()` call for) FSDP2's state in `source`."""
    found = []
    for node in ast.walk(ast.parse(source) if isinstance(source, str) else source):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for e in ast.walk(t):
                if (isinstance(e, ast.Attribute) and e.attr in names and e.ctx.__class__ in (ast.Store, ast.Del)
                        and not (isinstance(e.value, ast.Name) and e.value.id in _OWN)):
                    found.append((node.lineno, ast.unparse(e)))
        if isinstance(node, ast.Call):
            fn = ast.unparse(node.func)
            if (fn in ("setattr", "delattr", "object.__setattr__") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in names):
                found.append((node.lineno, ast.unparse(node)))
            if isinstance(node.func, ast.Attribute) and node.func.attr == "_get_fsdp_state":
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_lowprec_module_writes_fsdp2_state():
    names = fsdp2_state_names()
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 60
    bad = [f"{p.relative_to(ROOT)}:{line}: {text}" for p in files for line, text in fsdp2_writes(_tree(p), names)]
    assert not bad, "lowprec writes FSDP2's internal state (use its public API or tensor extension point):\n" + \
        "\n".join(bad)


def test_the_scan_catches_the_writes_it_names():
    """The three writes and the private call the FP8 all-gather made before issue 52 (as in
    d588cb5's lowprec/runtime/engines/fsdp_fp8.py), setattr and delattr; a read and `self`'s own are no writes."""
    names = fsdp2_state_names()
    old = '''
def refresh(model):
    for m in model.modules():
        group = m._get_fsdp_state()._fsdp_param_group
        for fp in group.fsdp_params:
            fp.all_gather_outputs = []
            fp._unsharded_inner_tensors = []
            if hasattr(fp, "_unsharded_param"):
                del fp._unsharded_param
            setattr(fp, "sharded_param", None)
            delattr(fp, "all_gather_outputs")
            self.all_gather_outputs = []
            x = fp.all_gather_outputs
'''
    got = sorted(text for _, text in fsdp2_writes(old, names))
    assert got == sorted(["m._get_fsdp_state()", "fp.all_gather_outputs", "fp._unsharded_inner_tensors",
                   "fp._unsharded_param", "setattr(fp, 'sharded_param', None)",
                   "delattr(fp, 'all_gather_outputs')"]), got
