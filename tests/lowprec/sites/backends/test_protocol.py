"""Closed sets as types: every backend implements `Backend`, every backend's site satisfies `SiteModule`,
and the package defines one `UnsupportedFormatError` and one `suggest`.

The te site needs Transformer Engine (skipped here with the probe's reason where it is absent);
the torchao site runs in torchao's CPU emulation.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
from torch import nn

from lowprec import prepare
from lowprec.numerics.formats import get_format
from lowprec.sites.backends import (BACKEND_NAMES, Backend, BackendName, SiteModule, UnsupportedFormatError,
                                    get_backend)
from lowprec.sites.backends import protocol
from lowprec.sites.layers import PrecisionLinear
from lowprec.sites.plan import PrecisionPlan

PACKAGE = Path(__file__).resolve().parents[4] / "lowprec"


def _definitions(kind: type, name: str) -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, kind) and node.name == name:
                found.append(str(path.relative_to(PACKAGE.parent)))
    return found


@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_every_backend_implements_the_protocol(name):
    backend = get_backend(name)
    assert isinstance(backend, Backend), name
    assert isinstance(backend.fast_path, bool) and isinstance(backend.fp8_storage, bool)
    declared = inspect.signature(Backend.make_site).parameters
    got = inspect.signature(backend.make_site).parameters
    # the same keywords, by name, for every backend: prepare calls make_site one way
    assert list(got) == [p for p in declared if p != "self"], (name, list(got))
    assert all(got[k].kind is inspect.Parameter.KEYWORD_ONLY for k in ("name", "seed", "amax_group", "fused", "layer_cls"))


def test_only_the_torch_backend_takes_the_fast_path():
    assert [n for n in BACKEND_NAMES if get_backend(n).fast_path] == ["torch"]
    assert [n for n in BACKEND_NAMES if get_backend(n).fp8_storage] == ["torch"]


@pytest.mark.parametrize("name", ["emulated", "torch", "torchao"])
def test_every_backends_site_satisfies_the_site_protocol(name):
    if name == "torchao":
        pytest.importorskip("torchao", reason="backend 'torchao' needs torchao: pip install 'lowprec[torchao]'")
    backend = get_backend(name) if name != "torchao" else get_backend(name).__class__(emulate=True)
    lin = nn.Linear(32, 16)
    site = backend.make_site(lin, get_format("fp8_tensorwise"), name="blocks.0.fc")
    assert isinstance(site, SiteModule) and isinstance(site, nn.Module), type(site)
    assert site.weight is lin.weight and site.format is get_format("fp8_tensorwise")
    assert (site.in_features, site.out_features) == (32, 16)
    assert isinstance(site.stats, dict) and isinstance(site.histories, dict) and isinstance(site.collect_stats, bool)
    site.set_format(get_format("bf16"))
    assert site.format.is_high_precision and site(torch.randn(4, 32)).shape == (4, 16)


def test_the_te_site_satisfies_the_site_protocol():
    from lowprec.sites.backends.te import probe
    ok, why = probe()
    if not ok:
        pytest.skip(why)
    site = get_backend("te").make_site(nn.Linear(32, 16).cuda(), "bf16", name="fc")
    assert isinstance(site, SiteModule)


def test_a_plain_module_is_not_a_site():
    assert not isinstance(nn.Linear(4, 4), SiteModule)


def test_layer_cls_reaches_precision_linear_backends_and_is_refused_by_the_others():
    class Mine(PrecisionLinear):
        pass

    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    state = prepare(model, PrecisionPlan(backend="emulated"), layer_cls=Mine)
    assert all(type(s.module) is Mine for s in state.sites.values()) and len(state.sites) == 2
    for name in ("te", "torchao"):
        with pytest.raises(ValueError, match=f"the {name} backend makes its own layers; layer_cls=Mine"):
            get_backend(name).make_site(nn.Linear(16, 16), "bf16", name="fc", layer_cls=Mine)
    with pytest.raises(ValueError, match="not a subclass of PrecisionLinear"):
        get_backend("emulated").make_site(nn.Linear(16, 16), "bf16", name="fc", layer_cls=nn.Linear)


def test_one_unsupported_format_error_for_te_and_torchao():
    from lowprec.sites.backends import te, torchao_backend
    assert te.UnsupportedFormatError is torchao_backend.UnsupportedFormatError is UnsupportedFormatError
    assert UnsupportedFormatError is protocol.UnsupportedFormatError and issubclass(UnsupportedFormatError, ValueError)
    assert _definitions(ast.ClassDef, "UnsupportedFormatError") == ["lowprec/sites/backends/protocol.py"]
    with pytest.raises(UnsupportedFormatError):   # te's refusal, caught by the shared class
        te.recipe_spec(get_format("fp8_rowwise"))
    with pytest.raises(UnsupportedFormatError):   # torchao's
        torchao_backend.recipe_name(get_format("mxfp4"))


def test_one_suggest():
    assert _definitions(ast.FunctionDef, "suggest") == ["lowprec/base/parse.py"]


def test_backend_names_are_an_enum_the_factory_takes():
    assert {BackendName(n) for n in BACKEND_NAMES} == set(BackendName)
    with pytest.raises(ValueError, match="Did you mean 'emulated'"):
        get_backend("emulate")
