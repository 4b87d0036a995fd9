"""Objects do not reach into each other at run time (docs/architecture.md, "Who writes whose state").

The import graph (tests/test_import_direction.py) cannot show one object writing another's
state; these rules can, read from the source with `ast` (nothing is imported):

1. An autograd Function writes onto nothing but its `ctx`. In `forward`, `backward`,
   `setup_context`, `jvp` and `vjp` of every `torch.autograd.Function` subclass under
   lowprec/, the only attribute assignments are `ctx.name = ...`: an argument (a layer, a
   module, a recipe) and anything taken back out of `ctx` is not written to. What the layer
   keeps comes back as an output, or goes into a holder the layer passed in (a tensor
   written in place, a state object's dict), as torchao's `matmul_with_hp_or_float8_args`
   takes tensors and configs. A runtime check adds that no Function is given an `nn.Module`.
2. Nobody writes another object's private attribute: `obj._name = ...` and
   `setattr(obj, "_name", ...)` only where `obj` is `self` or `cls` (or `ctx` in a
   Function), and no write goes through another object's private attribute
   (`obj._part.name = ...`).
3. An object of a lowprec class with behaviour (not a dataclass or NamedTuple record) has
   its attributes written only by the module that defines the class. A write
   `obj.name = ...` is checked where `obj`'s class can be read from the source: a parameter
   annotated with the class, a local bound to a call of it (`obj = Session(...)`), or a name
   an `isinstance(obj, Class)` check narrows (`for m in model.modules(): if isinstance(m,
   PrecisionLinear): m.amax_group = group`, the setter issue 55 removed: `prepare` takes
   `amax_group=`). An owner hands a part what it needs at construction or through the part's
   own methods.
4. Nothing is wired after it was built (docs/architecture.md: built in dependency order). No
   `obj.use_*(...)` call on anything but `self`/`cls` (a setter that hands a part what it
   should have had at construction), and no write into a part of another object: `a.b.name =
   ...`, `a.parts[k].name = ...`, or `x.name = ...` where `x` was bound in the function to such
   a part (`x = a.b`). An object's own private parts (`self._part.name`) are its own business.
5. No `del obj.name` and no `obj.__class__ = ...` on anything but `self`.

`ALLOWED` lists what is let through, each with its reason.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lowprec"

_FUNCTION_METHODS = {"forward", "backward", "setup_context", "jvp", "vjp"}
_OWN = {"self", "cls"}

# "file:line-free target" -> why it is allowed. Keys are `path: target` as `_where` writes them.
ALLOWED: dict[str, str] = {
    "lowprec/numerics/delayed.py: t._dynamo_static_input_type":
        "torch.compile's own marker for a static input (what torch._dynamo.mark_static_address sets); "
        "torch has no public setter for a tensor that is not a Parameter or buffer",
    "lowprec/integrations/torchtitan.py: layer._param_init":
        "torchtitan's Module protocol: a module carries its initialisation and sharding in these two "
        "attributes, and torchtitan's own builders set them from outside the same way "
        "(torchtitan/protocols/module.py); here in TitanPrecisionLinear's constructor",
    "lowprec/integrations/torchtitan_launch.py: torch_utils._get_available_device_type":
        "torchtitan 0.3 picks its device from this torch function at import ('cuda' where it answers "
        "None); the launcher makes it answer 'cpu' on a machine without an accelerator, before "
        "torchtitan is imported (docs/integrations.md, 'what a CPU run needs')",
    "lowprec/integrations/torchtitan_launch.py: torch_utils._get_device_module":
        "torchtitan 0.3 calls memory and device queries on the module this returns; on a CPU the "
        "launcher returns one that answers them (as torch_utils._get_available_device_type)",
    "lowprec/integrations/torchtitan.py: layer._sharding_config":
        "torchtitan's Module protocol (as layer._param_init)",
    "lowprec/integrations/torchtitan.py: site.module._param_init":
        "torchtitan's Module protocol (as layer._param_init), for a torchao site given the Module mixin",
    "lowprec/integrations/torchtitan.py: site.module._sharding_config":
        "torchtitan's Module protocol (as layer._param_init)",
    "lowprec/integrations/torchtitan.py: site.module.__class__":
        "torchtitan's Module protocol: a site prepare built gets torchtitan's Module mixin as a subclass of "
        "its own class (torchtitan/protocols/module.py); the object and its parameters stay the same",
    "lowprec/integrations/torchtitan_trainer.py: config.training.max_norm":
        "torchtitan's Trainer reads the clip norm from its own config object; lowprec clips before the "
        "optimizers and hands torchtitan inf (torchtitan/trainer.py)",
    "lowprec/integrations/torchtitan_trainer.py: self.checkpointer.exclude_from_loading":
        "torchtitan's CheckpointManager takes the states not to load as this attribute "
        "(torchtitan/components/checkpoint.py)",
    "lowprec/integrations/torchtitan_trainer.py: self.checkpointer.load":
        "torchtitan's CheckpointManager has no hook after a load; the trainer wraps its load to restore the "
        "rollout's state (torchtitan/components/checkpoint.py)",
    "lowprec/sites/backends/te.py: module.weight":
        "the TE site's own te.Linear (built by the site, never handed out) is re-bound to the shared "
        "Parameter after a swap; Transformer Engine has no API to share a Parameter",
    "lowprec/sites/backends/te.py: module.bias": "as module.weight",
    "lowprec/sites/precision_state.py: module.histories":
        "PrecisionState owns the sites prepare built: high_precision() puts a site's amax history back "
        "(SiteModule protocol)",
    "lowprec/sites/precision_state.py: s.module.collect_stats":
        "PrecisionState owns its sites: collect_stats switches their statistics (SiteModule protocol)",
    "lowprec/sites/precision_state.py: module.collect_stats":
        "PrecisionState owns its sites: collecting_stats() restores their statistics switch (SiteModule protocol)",
    "lowprec/sites/precision_state.py: module.stats":
        "PrecisionState owns its sites: collecting_stats() restores their last statistics (SiteModule protocol)",
    "lowprec/policy/monitor.py: sites[fqn].overflow_steps":
        "the monitor fills in the SiteSignals record it is building for the check it returns",
    "lowprec/base/yaml_read.py: stack[-1].size":
        "the YAML reader adds a closed node's size to its parent's frame: frames it made itself, in a local stack",
    "lowprec/sites/experts.py: module.__class__":
        "wrap_experts gives a grouped-experts module (torchtitan's GroupedExperts, transformers' fused experts) a "
        "subclass that runs its experts as sites, keeping the object, its parameters and its FSDP/DTensor state; "
        "unwrap_experts puts the original class back",
    "lowprec/runtime/engines/fsdp_fp8.py: m.weight":
        "re-binding a module's Parameter to a tensor subclass over the same storage is nn.Module's own "
        "protocol for it, as torchao's float8 FSDP2 all-gather wraps Float8Linear weights "
        "(torchao/float8/float8_linear_utils.py); done once, before fully_shard and the optimizer",
    "lowprec/runtime/session/window.py: self.entries[step].applied":
        "the window replayer's own record of a step (a dataclass it made in record())",
}


def _files() -> list[Path]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 60, f"found only {len(files)} files under {PACKAGE}"
    return files


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()


def _targets(node: ast.AST) -> list[ast.expr]:
    """The plain targets an assignment writes (tuples unpacked)."""
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    else:
        return []
    out = []
    while found:
        t = found.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            found += t.elts
        else:
            out.append(t)
    return out


def _attribute_writes(tree: ast.AST):
    """(node, object expression, attribute name, text) of every `obj.name = ...`,
    `setattr(obj, "name", ...)` and `object.__setattr__(obj, "name", ...)` (a literal name) under `tree`."""
    for node in ast.walk(tree):
        for t in _targets(node):
            if isinstance(t, ast.Attribute):
                yield node, t.value, t.attr, ast.unparse(t)
        if (isinstance(node, ast.Call) and ast.unparse(node.func) in ("setattr", "object.__setattr__")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)):
            yield node, node.args[0], node.args[1].value, f"{ast.unparse(node.args[0])}.{node.args[1].value}"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _where(path: Path, text: str) -> str:
    return f"{_rel(path)}: {text}"


def _report(found: list[tuple[str, int, str]], rule: str) -> list[str]:
    """Lines for the writes not on the allow-list; `found`: (key, line, message)."""
    return [f"{key.split(':')[0]}:{line}: {msg} ({rule})" for key, line, msg in found if key not in ALLOWED]


# ----------------------------------------------------------------------------- rule 1: autograd Functions

def _is_autograd_function(cls: ast.ClassDef) -> bool:
    for base in cls.bases:
        text = ast.unparse(base)
        if text in ("Function", "torch.autograd.Function", "autograd.Function"):
            return True
    return False


def autograd_function_writes(path: Path) -> list[tuple[str, int, str]]:
    found = []
    for cls in ast.walk(_tree(path)):
        if not (isinstance(cls, ast.ClassDef) and _is_autograd_function(cls)):
            continue
        for fn in cls.body:
            if not (isinstance(fn, ast.FunctionDef) and fn.name in _FUNCTION_METHODS):
                continue
            for node, obj, name, text in _attribute_writes(fn):
                if not (isinstance(obj, ast.Name) and obj.id == "ctx"):
                    found.append((_where(path, text), node.lineno,
                                  f"{cls.name}.{fn.name} writes {text}: an autograd Function writes only onto ctx; "
                                  f"return what the caller keeps, or write into a holder it passes in"))
    return found


def test_autograd_functions_write_onto_nothing_but_ctx():
    functions = [p for p in _files() if "autograd.Function" in p.read_text()]
    assert len(functions) >= 4, [_rel(p) for p in functions]   # quantized_gemms, fp8_linear, fp8_parallel, fp8_sequence
    bad = _report([w for p in functions for w in autograd_function_writes(p)], "rule 1")
    assert not bad, "autograd Functions write onto their arguments:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------- rule 2: private attributes

def private_writes(path: Path) -> list[tuple[str, int, str]]:
    found = []
    for node, obj, name, text in _attribute_writes(_tree(path)):
        own = isinstance(obj, ast.Name) and obj.id in _OWN | {"ctx"}
        through = obj
        via_private = False
        while isinstance(through, (ast.Attribute, ast.Subscript)):
            if isinstance(through, ast.Attribute) and _private(through.attr):
                root = through.value
                via_private |= not (isinstance(root, ast.Name) and root.id in _OWN)
            through = through.value
        if (_private(name) and not own) or via_private:
            found.append((_where(path, text), node.lineno,
                          f"writes {text}: another object's private state; give its class a method"))
    return found


def test_nobody_writes_another_objects_private_attribute():
    bad = _report([w for p in _files() for w in private_writes(p)], "rule 2")
    assert not bad, "private attributes written from outside their object:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------- rule 3: typed objects

def _classes() -> dict[str, list[tuple[Path, bool]]]:
    """class name -> [(its module, whether it is a record: a dataclass or NamedTuple)]."""
    out: dict[str, list[tuple[Path, bool]]] = {}
    for path in _files():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ClassDef):
                deco = {ast.unparse(d).split("(")[0].rsplit(".", 1)[-1] for d in node.decorator_list}
                bases = {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}
                record = "dataclass" in deco or bases & {"NamedTuple", "TypedDict", "Enum", "IntEnum", "StrEnum"}
                out.setdefault(node.name, []).append((path, bool(record)))
    return out


def _annotation_names(ann: ast.expr | None) -> set[str]:
    if ann is None:
        return set()
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        try:
            ann = ast.parse(ann.value, mode="eval").body
        except SyntaxError:
            return set()
    names = set()
    for node in ast.walk(ann):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
    return names


def _typed_names(fn: ast.FunctionDef | ast.AsyncFunctionDef, classes) -> dict[str, set[str]]:
    """name -> the lowprec classes it holds, in `fn`: annotated parameters and locals bound
    to a call of a class."""
    typed: dict[str, set[str]] = {}
    a = fn.args
    for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
        if arg.arg not in _OWN and (names := _annotation_names(arg.annotation) & classes.keys()):
            typed[arg.arg] = names
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value, name = node.value, node.targets[0].id
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            value, name = node.value, node.target.id
        else:
            continue
        if isinstance(value, ast.Call):
            func = value.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if called in classes:
                typed.setdefault(name, set()).add(called)
    for node in ast.walk(fn):   # narrowed by a check: `if isinstance(m, PrecisionLinear): m.amax_group = ...`
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
                and len(node.args) == 2 and isinstance(node.args[0], ast.Name) and node.args[0].id not in _OWN
                and (names := _annotation_names(node.args[1]) & classes.keys())):
            typed.setdefault(node.args[0].id, set()).update(names)
    return typed


def foreign_writes(path: Path, classes) -> list[tuple[str, int, str]]:
    found = []
    for fn in ast.walk(_tree(path)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        typed = _typed_names(fn, classes)
        for node, obj, name, text in _attribute_writes(fn):
            if not (isinstance(obj, ast.Name) and obj.id in typed):
                continue
            for cls in sorted(typed[obj.id]):
                homes = classes[cls]
                if any(home == path for home, _ in homes) or all(record for _, record in homes):
                    continue
                found.append((_where(path, text), node.lineno,
                              f"writes {text} of a {cls} ({', '.join(_rel(h) for h, _ in homes)}) from outside "
                              f"its module; hand it over at construction or through a method of {cls}"))
    return sorted(set(found))


def test_objects_are_written_only_by_their_own_module():
    classes = _classes()
    assert {"Session", "RolloutController", "PrecisionLinear", "Engine"} <= classes.keys()
    bad = _report([w for p in _files() for w in foreign_writes(p, classes)], "rule 3")
    assert not bad, "objects written from outside the module of their class:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------- rule 4: no wiring after construction

def _bound_to_parts(fn: ast.AST) -> set[str]:
    """Names bound in `fn` to another object's part: `x = a.b` or `x = a.parts[k]`."""
    return {node.targets[0].id for node in ast.walk(fn)
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, (ast.Attribute, ast.Subscript))}


def _own_private_part(obj: ast.expr) -> bool:
    """`self._part` (or deeper through it): the object's own private state."""
    while isinstance(obj, (ast.Attribute, ast.Subscript)):
        if isinstance(obj, ast.Attribute) and isinstance(obj.value, ast.Name) and obj.value.id in _OWN:
            return _private(obj.attr)
        obj = obj.value
    return False


def wiring(path: Path) -> list[tuple[str, int, str]]:
    found = []
    for fn in ast.walk(_tree(path)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        parts = _bound_to_parts(fn)
        for node, obj, name, text in _attribute_writes(fn):
            into_part = (isinstance(obj, (ast.Attribute, ast.Subscript)) and not _own_private_part(obj)) or (
                isinstance(obj, ast.Name) and obj.id in parts)
            if into_part:
                found.append((_where(path, text), node.lineno,
                              f"writes {text}: a part of another object, after it was built; hand it over at "
                              f"construction (build in dependency order) or through a method of its class"))
        for node in ast.walk(fn):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr.startswith("use_")
                    and not (isinstance(node.func.value, ast.Name) and node.func.value.id in _OWN)):
                text = ast.unparse(node.func)
                found.append((_where(path, text), node.lineno,
                              f"calls {text}(...): wiring after construction; pass it to the constructor"))
    return sorted(set(found))


def test_nothing_is_wired_after_it_was_built():
    bad = _report([w for p in _files() for w in wiring(p)], "rule 4")
    assert not bad, "objects wired after construction:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------- rule 5: del and __class__

def identity_writes(path: Path) -> list[tuple[str, int, str]]:
    found = []
    for node in ast.walk(_tree(path)):
        targets = node.targets if isinstance(node, ast.Delete) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and not (isinstance(t.value, ast.Name) and t.value.id in _OWN):
                text = f"del {ast.unparse(t)}"
                found.append((_where(path, text), node.lineno,
                              f"{text}: removes another object's attribute; give its class a method"))
        for t in _targets(node):
            if (isinstance(t, ast.Attribute) and t.attr == "__class__"
                    and not (isinstance(t.value, ast.Name) and t.value.id in _OWN)):
                text = ast.unparse(t)
                found.append((_where(path, text), node.lineno,
                              f"writes {text}: changes another object's class; build the object as that class"))
    return found


def test_nobody_deletes_another_objects_attribute_or_changes_its_class():
    bad = _report([w for p in _files() for w in identity_writes(p)], "rule 5")
    assert not bad, "attributes deleted or classes changed from outside:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------- the rules catch what they name

_CAUGHT = '''
import torch
class Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layer):
        layer._groups = {}
        ctx.layer = layer
        return x
    @staticmethod
    def backward(ctx, g):
        layer = ctx.layer
        layer.seen = True
        setattr(layer, "count", 1)
        return g, None
def host(session: "Session", engine: Engine | None, other):
    session.clock = 1
    engine.clock = 2
    other._private = 3
    setattr(other, "_also", 4)
    object.__setattr__(other, "_frozen", 8)
    other._part.name = 5
    made = Session()
    made.step_index = 6
    for m in other.modules():
        if isinstance(m, (Engine, int)):
            m.amax_group = None
    own_record = Record()
    own_record.value = 7
class Own:
    def __init__(self):
        self._fine = 1
        self._part = Own()
        self._part.name = 2
def wire(prepared, run, tracker):
    evals = prepared.evals
    evals.tracker = tracker
    prepared.controller.gate = evals.gate
    run.sites["a"].module.collect_stats = False
    evals.evaluator.use_forward(run.forward)
    made = Own()
    made.name = 9
    del made.name
    del run._buffer
    made.__class__ = Own
    self_like = 1
'''


def test_the_rules_catch_the_cases_they_name(tmp_path):
    path = tmp_path / "sample.py"
    path.write_text(_CAUGHT)
    fn = [msg.split(" writes ")[1].split(":")[0] for _, _, msg in autograd_function_writes(path)]
    assert fn == ["layer._groups", "layer.seen", "layer.count"], fn
    private = sorted(key.split(": ")[1] for key, _, _ in private_writes(path))
    assert private == ["layer._groups", "other._also", "other._frozen", "other._part.name", "other._private"], private
    classes = {"Session": [(Path("runtime/session/session.py"), False)], "Engine": [(Path("runtime/engines/engine.py"), False)],
               "Record": [(Path("runtime/record.py"), True)]}
    foreign = sorted(key.split(": ")[1] for key, _, _ in foreign_writes(path, classes))
    assert foreign == ["engine.clock", "m.amax_group", "made.step_index", "session.clock"], foreign
    wired = sorted(key.split(": ")[1] for key, _, _ in wiring(path))
    assert wired == ["evals.evaluator.use_forward", "evals.tracker", "layer.count", "layer.seen", "other._part.name",
                     "prepared.controller.gate", "run.sites['a'].module.collect_stats"], wired
    identity = sorted(key.split(": ")[1] for key, _, _ in identity_writes(path))
    assert identity == ["del made.name", "del run._buffer", "made.__class__"], identity


def test_every_allowed_entry_is_still_needed():
    """An entry whose write is gone is removed, so the list only shrinks."""
    classes = _classes()
    seen = {key for p in _files()
            for key, _, _ in [*autograd_function_writes(p), *private_writes(p), *foreign_writes(p, classes),
                              *wiring(p), *identity_writes(p)]}
    stale = sorted(set(ALLOWED) - seen)
    assert not stale, "ALLOWED entries that nothing needs any more (remove them):\n" + "\n".join(stale)


# ----------------------------------------------------------------------------- at run time: no module goes in

def _modules_in(value, depth: int = 0) -> list[str]:
    """What in an argument is an nn.Module, or a method bound to one (one level into
    tuples, lists, dicts and objects' attributes)."""
    if isinstance(value, nn.Module) or isinstance(getattr(value, "__self__", None), nn.Module):
        return [type(value).__name__]
    if depth > 1 or isinstance(value, (torch.Tensor, str, int, float, bool, type(None))):
        return []
    items = (list(value.values()) if isinstance(value, dict) else list(value) if isinstance(value, (tuple, list))
             else [getattr(value, s) for s in getattr(value, "__slots__", ()) if hasattr(value, s)]
             + list(getattr(value, "__dict__", {}).values()))
    return [m for v in items for m in _modules_in(v, depth + 1)]


@pytest.mark.parametrize("backend,fmt", [("emulated", "fp8_tensorwise"), ("emulated", "fp8_delayed"),
                                         ("emulated", "nvfp4"), ("torch", "fp8_tensorwise"),
                                         ("torch", "fp8_delayed")])
def test_no_autograd_function_is_given_a_module(monkeypatch, backend, fmt):
    from lowprec.numerics.formats import get_format
    from lowprec.sites.backends import get_backend
    from lowprec.sites.layers import PrecisionLinear
    from lowprec.sites import fp8_linear, fp8_parallel, quantized_gemms

    calls = []
    for cls in (quantized_gemms.QuantizedLinearFn, fp8_linear.FP8LinearFn, fp8_parallel.GroupFP8LinearFn):
        original = cls.apply

        def apply(*args, _cls=cls, _original=original):
            calls.append((_cls.__name__, [m for a in args for m in _modules_in(a)]))
            return _original(*args)
        monkeypatch.setattr(cls, "apply", apply)
    torch.manual_seed(0)
    base = nn.Linear(32, 16)
    layer = PrecisionLinear(base.weight, base.bias, get_format(fmt), get_backend(backend))
    x = torch.randn(4, 32, requires_grad=True)
    layer(x).sum().backward()
    assert calls and x.grad is not None and base.weight.grad is not None
    assert all(not modules for _, modules in calls), calls
