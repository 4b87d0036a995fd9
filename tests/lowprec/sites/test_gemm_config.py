"""The per-GEMM config (`precision.gemm`, lowprec.sites.gemm_config): parsed and validated with
the plan, defaults as torchao's, and each GEMM's `use_fast_accum` handed to its `_scaled_mm`."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lowprec.base.parse import ConfigError
from lowprec.numerics.formats import get_format
from lowprec.sites.backends import get_backend
from lowprec.sites.gemm_config import GemmConfig, LinearGemmConfig, misaligned
from lowprec.sites.layers import PrecisionLinear
from lowprec.sites.plan import PlanError, PrecisionPlan
from lowprec.sites.precision_state import prepare


def test_defaults_are_torchaos():
    float8 = pytest.importorskip("torchao.float8")
    ao = float8.Float8LinearConfig()
    ours = LinearGemmConfig()
    assert ours.fast_accum() == (ao.gemm_config_output.use_fast_accum, ao.gemm_config_grad_input.use_fast_accum,
                                 ao.gemm_config_grad_weight.use_fast_accum)
    assert ours.pad_inner_dim == ao.pad_inner_dim


def test_plan_parses_and_round_trips_the_section():
    d = {"backend": "torch", "gemm": {"fprop": {"use_fast_accum": False}, "wgrad": {"use_fast_accum": True},
                                      "pad_inner_dim": True}}
    plan = PrecisionPlan.from_dict(d)
    assert plan.gemm == LinearGemmConfig(fprop=GemmConfig(False), wgrad=GemmConfig(True), pad_inner_dim=True)
    assert PrecisionPlan.from_dict(plan.to_dict()) == plan
    assert PrecisionPlan.from_dict({}).gemm == LinearGemmConfig()


@pytest.mark.parametrize("gemm, path, words", [
    ({"fprop": {"use_fast_acum": True}}, "precision.gemm.fprop.use_fast_acum", "Did you mean 'use_fast_accum'"),
    ({"dgard": {}}, "precision.gemm.dgard", "Did you mean 'dgrad'"),
    ({"pad_inner_dim": "yes"}, "precision.gemm.pad_inner_dim", "true or false"),
    ({"wgrad": True}, "precision.gemm.wgrad", "mapping"),
])
def test_bad_values_name_the_key(gemm, path, words):
    with pytest.raises(PlanError) as e:
        PrecisionPlan.from_dict({"gemm": gemm})
    assert isinstance(e.value, ConfigError) and e.value.path == path and words in str(e.value)
    assert "\n" not in str(e.value)


class _ScaledMMCalls(TorchDispatchMode):
    """The `use_fast_accum` of every aten._scaled_mm call, in order."""

    def __init__(self):
        super().__init__()
        self.fast_accum = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._scaled_mm.default:
            self.fast_accum.append(bool(kwargs.get("use_fast_accum", args[7] if len(args) > 7 else False)))
        return func(*args, **kwargs)


@pytest.mark.parametrize("fmt", ["fp8_tensorwise", "fp8_delayed", "fp8_rowwise"])
@pytest.mark.parametrize("flags", [(True, False, False), (False, True, True)], ids=["default", "flipped"])
def test_each_gemm_gets_its_flag(fmt, flags):
    """fprop in the forward, then dgrad and wgrad in the backward, each with its own flag; on
    CPU the flag changes no bit (FP32 accumulation), so the results equal the defaults'."""
    gemm = LinearGemmConfig(*(GemmConfig(f) for f in flags))
    out = []
    for cfg in (gemm, LinearGemmConfig()):
        torch.manual_seed(0)
        layer = PrecisionLinear.from_module(nn.Linear(32, 48, dtype=torch.bfloat16), get_format(fmt),
                                            get_backend("torch"), gemm=cfg)
        x = torch.randn(24, 32, dtype=torch.bfloat16, requires_grad=True)
        with _ScaledMMCalls() as calls:
            y = layer(x)
            y.backward(torch.ones_like(y))
        out.append((y, x.grad, layer.weight.grad))
        if cfg is gemm:
            assert calls.fast_accum == list(flags)
    for a, b in zip(*out):
        assert torch.equal(a, b)


def test_prepare_hands_the_plan_section_to_every_layer():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    plan = PrecisionPlan.from_dict({"backend": "torch", "default": "fp8_tensorwise",
                                    "gemm": {"dgrad": {"use_fast_accum": True}}})
    state = prepare(model, plan)
    layers = [s.module for s in state.sites.values()]
    assert len(layers) == 2 and all(layer.gemm == plan.gemm for layer in layers)
    assert all(layer._fast[0].gemm == plan.gemm for layer in layers)


def test_misaligned_says_what_and_how_to_fix():
    assert misaligned("fprop", 37, 128, 256) is None            # M is free
    msg = misaligned("wgrad", 128, 256, 37)
    assert "wgrad" in msg and "K 37" in msg and "pad_inner_dim: true" in msg and "\n" not in msg
    assert "M 37" in misaligned("fprop", 37, 128, 256, rowwise=True)
