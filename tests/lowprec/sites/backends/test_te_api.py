"""lowprec/sites/backends/te.py against Transformer Engine 2.20's own Python sources, read with `ast`.

TE's Python package (transformer_engine/common/recipe, transformer_engine/pytorch) ships in
the `transformer-engine-cu13` wheel, and `transformer_engine.pytorch` loads its CUDA core
library at import, so on a CPU machine the sources are parsed, not imported.
`scripts/te_install/download.sh` (the download for a GPU machine) unpacks them into
`.te_dl/src/transformer_engine/`; without that folder every test here skips and says why.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lowprec.sites.backends import te as lte

SRC = Path(__file__).resolve().parents[4] / ".te_dl" / "src" / "transformer_engine"


@pytest.fixture(scope="module")
def te_src() -> Path:
    if not (SRC / "pytorch" / "quantization.py").is_file():
        pytest.skip(f"TE 2.20's Python sources are not at {SRC}: run scripts/te_install/download.sh (it unpacks "
                    f"them there) to check lowprec's te backend against them")
    return SRC


def _tree(root: Path, rel: str) -> ast.Module:
    return ast.parse((root / rel).read_text())


def _top(tree: ast.Module, name: str):
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return node
    raise AssertionError(f"{name} not defined at top level")


def _params(fn: ast.FunctionDef) -> set[str]:
    a = fn.args
    return {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}


def _init(cls: ast.ClassDef) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")


def _fields(cls: ast.ClassDef) -> set[str]:
    out = set()
    for n in cls.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
        elif isinstance(n, ast.Assign):
            out |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    return out


def test_every_recipe_spec_names_a_recipe_class_with_those_fields(te_src):
    tree = _tree(te_src, "common/recipe/__init__.py")
    fmt_members = _fields(_top(tree, "Format"))
    assert {"E4M3", "E5M2", "HYBRID", "E2M1"} <= fmt_members
    seen = set()
    for name in lte.te_format_names():
        spec = lte.recipe_spec(name)
        if spec is None:           # high precision: no recipe
            continue
        cls = _top(tree, spec.cls)
        fields = _fields(cls)
        missing = set(spec.kwargs) - fields
        assert not missing, f"{name}: {spec.cls} has no fields {missing}"
        if "fp8_format" in spec.kwargs:
            assert spec.kwargs["fp8_format"] in fmt_members
        # pins are passed only where present; for 2.20 every one should be there
        assert set(spec.pins) <= fields, f"{name}: {spec.cls} lacks pins {set(spec.pins) - fields}"
        if spec.pow2_scales is not None:
            assert {"fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"} <= fields
        seen.add(spec.cls)
    assert {"DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"} <= seen


def test_pow2_env_variables_are_the_ones_te_reads(te_src):
    text = (te_src / "common/recipe/__init__.py").read_text()
    for var in lte._POW2_ENV.values():
        assert f'"{var}"' in text


def test_autocast_and_availability_probes(te_src):
    q = _tree(te_src, "pytorch/quantization.py")
    assert {"enabled", "recipe", "amax_reduction_group"} <= _params(_init(_top(q, "autocast")))
    assert {"enabled", "fp8_recipe", "fp8_group"} <= _params(_top(q, "fp8_autocast"))
    for kind in ("fp8", "fp8_block_scaling", "mxfp8", "nvfp4"):
        assert "return_reason" in _params(_top(q, f"is_{kind}_available"))
    init = (te_src / "pytorch/__init__.py").read_text()
    for name in ("autocast", "is_fp8_available", "is_fp8_block_scaling_available",
                 "is_mxfp8_available", "is_nvfp4_available", "Linear"):
        assert f"import {name}\n" in init or f" {name}," in init or f"import {name} " in init, name


def test_linear_constructor_and_reset(te_src):
    lin = _top(_tree(te_src, "pytorch/module/linear.py"), "Linear")
    assert {"in_features", "out_features", "bias", "params_dtype", "device", "name"} <= _params(_init(lin))
    base = _top(_tree(te_src, "pytorch/module/base.py"), "TransformerEngineBaseModule")
    methods = {n.name for n in base.body if isinstance(n, ast.FunctionDef)}
    assert "reset_fp8_meta_tensors" in methods
