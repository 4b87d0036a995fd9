"""Backend 'te' without Transformer Engine: the probe, the clear errors, the recipe mapping.

These run on any machine. Where TE does run (a GPU with it installed), the tests that
need its absence skip; tests/gpu/test_te_backend.py covers that side. The last test
drives TELinearSite's bookkeeping through a stand-in for TE, so CI exercises it too.
"""

import contextlib
import dataclasses
import enum
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from lowprec.sites.backends import get_backend
from lowprec.sites.backends import te as te_backend
from lowprec.numerics.formats import FORMATS, DelayedScalingConfig, get_format

TE_RUNS, _ = te_backend.probe()
needs_no_te = pytest.mark.skipif(TE_RUNS, reason="Transformer Engine runs here")


@pytest.fixture
def fresh_probe():
    te_backend.probe.cache_clear()
    yield te_backend.probe
    te_backend.probe.cache_clear()


def test_import_does_not_import_transformer_engine():
    code = ("import sys, lowprec.sites.backends.te, lowprec.sites.backends; "
            "assert 'transformer_engine' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


@needs_no_te
def test_probe_says_why_not(fresh_probe):
    ok, reason = fresh_probe()
    assert ok is False
    assert reason and ("CUDA" in reason or "transformer_engine" in reason)
    assert "lowprec[te]" in reason                      # and how to fix it


def test_probe_never_raises(fresh_probe, monkeypatch):
    def broken():
        raise RuntimeError("driver exploded")
    monkeypatch.setattr(torch.cuda, "is_available", broken)
    ok, reason = fresh_probe()
    assert ok is False and "driver exploded" in reason


def test_probe_reports_the_import_failure(fresh_probe, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)      # as on a GPU machine
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)   # so importing it fails
    ok, reason = fresh_probe()
    assert ok is False
    assert "transformer_engine.pytorch does not import: ModuleNotFoundError" in reason

    def no_driver():
        raise OSError("libcuda.so.1: cannot open shared object file: No such file or directory")
    monkeypatch.setattr(te_backend, "_te", no_driver)
    te_backend.probe.cache_clear()
    ok, reason = te_backend.probe()
    assert ok is False and "OSError: libcuda.so.1" in reason


def test_recipe_spec_maps_each_format():
    spec = te_backend.recipe_spec
    assert spec("bf16") is None
    d = spec("fp8_delayed")
    assert (d.cls, d.capability) == ("DelayedScaling", "fp8")
    assert d.kwargs == {"fp8_format": "HYBRID", "margin": 0, "amax_history_len": 1024,
                        "amax_compute_algo": "max"}
    t = spec("fp8_tensorwise")
    assert (t.cls, t.kwargs, t.pow2_scales) == ("Float8CurrentScaling", {"fp8_format": "HYBRID"}, False)
    b = spec("fp8_blockwise")
    assert b.cls == "Float8BlockScaling" and b.pow2_scales is True
    assert b.kwargs == {"fp8_format": "E4M3", "x_block_scaling_dim": 1, "w_block_scaling_dim": 2,
                        "grad_block_scaling_dim": 1}
    assert b.pins["use_f32_scales"] is False
    m = spec("mxfp8")
    assert (m.cls, m.kwargs, m.capability) == ("MXFP8BlockScaling", {"fp8_format": "E4M3"}, "mxfp8")
    n = spec("nvfp4")
    assert n.cls == "NVFP4BlockScaling" and n.capability == "nvfp4"
    assert n.kwargs == {"disable_rht": False, "disable_stochastic_rounding": False,
                        "disable_2d_quantization": False}
    for s in (d, t, b, m, n):                             # the environment must not flip the backward
        assert s.pins["backward_override"] is None


def test_recipe_spec_follows_the_format_fields():
    delayed = dataclasses.replace(FORMATS["fp8_delayed"],
                                  delayed=DelayedScalingConfig(history_len=16, algo="most_recent", margin=2))
    assert te_backend.recipe_spec(delayed).kwargs == {
        "fp8_format": "HYBRID", "margin": 2, "amax_history_len": 16, "amax_compute_algo": "most_recent"}
    nv = FORMATS["nvfp4"]
    plain = dataclasses.replace(nv, input_wgrad=dataclasses.replace(nv.input_wgrad, hadamard=False),
                                grad_output_wgrad=dataclasses.replace(nv.grad_output_wgrad, hadamard=False))
    assert te_backend.recipe_spec(plain).kwargs["disable_rht"] is True
    one_sided = dataclasses.replace(nv, input_wgrad=dataclasses.replace(nv.input_wgrad, hadamard=False))
    with pytest.raises(te_backend.UnsupportedFormatError, match="Hadamard"):
        te_backend.recipe_spec(one_sided)


@pytest.mark.parametrize("name", ["fp8_rowwise", "mxfp4", "fp4_tensorwise"])
def test_unsupported_formats_fail_clearly_without_te(name):
    with pytest.raises(te_backend.UnsupportedFormatError) as info:
        te_backend.recipe_spec(name)
    message = str(info.value)
    assert name in message and "emulated" in message and "fp8_tensorwise" in message
    with pytest.raises(te_backend.UnsupportedFormatError):
        te_backend.recipe_for(name)                       # fails on the mapping, before any TE import
    ok, reason = te_backend.supports(name)
    assert ok is False and reason == message
    assert isinstance(info.value, ValueError)


def test_te_format_names():
    assert te_backend.te_format_names() == ["bf16", "fp8_tensorwise", "fp8_delayed", "fp8_blockwise",
                                            "mxfp8", "nvfp4"]


def test_supports_unknown_name_suggests():
    ok, reason = te_backend.supports("fp8_tensorwse")
    assert ok is False and "Did you mean 'fp8_tensorwise'" in reason


@needs_no_te
@pytest.mark.parametrize("name", ["bf16", "fp8_tensorwise", "nvfp4"])
def test_supported_formats_report_the_probe_reason(name):
    ok, reason = te_backend.supports(get_format(name))
    assert ok is False and reason == te_backend.probe()[1]


@needs_no_te
def test_require_te_raises_with_the_reason():
    with pytest.raises(RuntimeError) as info:
        te_backend.require_te()
    assert te_backend.probe()[1] in str(info.value) and "backend 'te'" in str(info.value)
    with pytest.raises(RuntimeError, match="lowprec\\[te\\]"):
        te_backend.recipe_for("fp8_tensorwise")
    with pytest.raises(RuntimeError, match="not available"):
        te_backend.TELinearSite(torch.nn.Linear(32, 32), "fp8_tensorwise")


def test_backend_registry_gives_the_te_backend():
    backend = get_backend("te")
    assert backend.name == "te"
    assert backend.supports("fp8_rowwise")[0] is False
    assert not hasattr(backend, "gemm")  # te sites are whole te.Linear modules (make_site)
    assert callable(backend.make_site)


class _StandInLinear(torch.nn.Module):
    """Just enough of te.Linear for the site's bookkeeping: weight/bias, fp8_meta, reset."""

    def __init__(self, in_features, out_features, bias=True, params_dtype=None, device="cuda", name=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, device=device))
        self.bias = torch.nn.Parameter(torch.empty(out_features, device=device)) if bias else torch.Tensor()
        self.fp8_meta = {"scaling_fwd": types.SimpleNamespace(scale=torch.full((3,), 7.0),
                                                              amax_history=torch.ones(4, 3))}

    def reset_fp8_meta_tensors(self):
        self.fp8_meta["scaling_fwd"].scale.fill_(1.0)
        self.fp8_meta["scaling_fwd"].amax_history.zero_()

    def forward(self, x):
        return 2 * F.linear(x, self.weight, self.bias)


@pytest.fixture
def stand_in_te(monkeypatch, fresh_probe):
    """A fake transformer_engine on a fake sm_90 GPU: tests the site's glue, not TE's numerics."""
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Format = enum.Enum("Format", "E2M1 E4M3 E5M2 HYBRID")
    recipe.DelayedScaling = recipe.Float8CurrentScaling = lambda **kw: types.SimpleNamespace(**kw)
    autocasts = []
    pt = types.ModuleType("transformer_engine.pytorch")
    pt.Linear = _StandInLinear
    pt.autocast = lambda **kw: autocasts.append(kw) or contextlib.nullcontext()
    for kind in ("fp8", "fp8_block_scaling", "mxfp8", "nvfp4"):
        setattr(pt, f"is_{kind}_available", lambda return_reason, k=kind: (k == "fp8", "needs sm_100"))
    for name, module in [("transformer_engine", types.ModuleType("transformer_engine")),
                         ("transformer_engine.common", types.ModuleType("transformer_engine.common")),
                         ("transformer_engine.common.recipe", recipe), ("transformer_engine.pytorch", pt)]:
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(sys.modules["transformer_engine.common"], "recipe", recipe, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stand-in")
    return autocasts


def test_site_bookkeeping_with_a_stand_in_te(stand_in_te):
    assert te_backend.probe()[0] is True
    lin, x = torch.nn.Linear(32, 48), torch.randn(4, 32)
    site = te_backend.TELinearSite(lin, "fp8_delayed", name="blocks.0.fc")
    te_lin = site.te_module()
    assert te_lin.weight is lin.weight and te_lin.bias is lin.bias         # re-bound, not copied
    assert [p is q for p, q in zip(site.parameters(), lin.parameters())] == [True, True]
    assert torch.equal(site(x), 2 * lin(x))                              # ran the te module
    assert stand_in_te[-1]["enabled"] is True and stand_in_te[-1]["recipe"].amax_history_len == 1024
    site.set_format("bf16")
    assert torch.equal(site(x), lin(x))                                  # BF16 bypasses TE
    site.set_format("fp8_tensorwise")
    site.set_format("fp8_delayed")
    assert site.te_module() is te_lin                                    # one module per format...
    assert torch.all(te_lin.fp8_meta["scaling_fwd"].amax_history == 0)   # ...reset on re-promotion
    with pytest.raises(RuntimeError, match="blocks.0.fc.*MXFP8BlockScaling.*sm_100"):
        site.set_format("mxfp8")
    lin.weight = torch.nn.Parameter(lin.weight.detach() + 1)            # a parameter swap
    site.weight = lin.weight
    site(x)
    assert te_lin.weight is lin.weight
    with pytest.raises(ValueError, match="% 16"):
        te_backend.TELinearSite(torch.nn.Linear(24, 40), "fp8_tensorwise")
