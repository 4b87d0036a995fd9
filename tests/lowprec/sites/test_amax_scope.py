"""`precision.amax_scope` in one process: what each scope asks of the layers and backends.

The numerics under torchrun are in tests/lowprec/sites/fast_path/test_fast_path_distributed.py."""

from __future__ import annotations

import torch
from torch import nn

from lowprec import prepare
from lowprec.sites.amax_scope import AmaxScope
from lowprec.sites.layers import PrecisionLinear
from lowprec.sites.plan import PrecisionPlan


def _plan(backend: str, scope: str) -> PrecisionPlan:
    return PrecisionPlan.from_dict({"backend": backend, "amax_scope": scope, "rules": [
        {"select": {"glob": "*"}, "format": "fp8_tensorwise", "ladder": ["fp8_tensorwise", "bf16"]}]})


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16))


def test_local_scope_reduces_nothing_and_takes_the_plain_fast_path():
    group = object()   # never used: local scales need no collective
    state = prepare(_mlp(), _plan("torch", "local"), amax_group=group)
    layers = [s.module for s in state.sites.values()]
    assert all(isinstance(m, PrecisionLinear) and m.amax_scope is AmaxScope.LOCAL for m in layers)
    assert all(m.operand_quantizer().amax_groups(role, shard_groups=[object()]) == []
               for m in layers for role in ("input", "grad_output", "weight"))
    x = torch.randn(8, 32)
    assert layers[0]._on_fast_path(x, layers[0].weight)   # the amax group plays no part
    out = layers[1](torch.nn.functional.gelu(layers[0](x)))
    out.sum().backward()
    assert [(m.fast_calls, m.slow_calls) for m in layers] == [(1, 0), (1, 0)]


def test_group_scope_keeps_the_data_parallel_group():
    group = object()
    state = prepare(_mlp(), _plan("emulated", "group"), amax_group=group)
    m = next(iter(state.sites.values())).module
    quant = m.operand_quantizer()
    assert m.amax_scope is AmaxScope.GROUP and quant.amax_groups("input") == [group]
    assert quant.amax_groups("weight") == []
    shard = object()   # a DTensor operand's shard group, given by QuantizedLinearFn for the call
    assert quant.amax_groups("input", [shard]) == [shard, group] and quant.amax_groups("weight", [shard]) == [shard]


def test_torchao_accepts_a_data_parallel_group_under_local_scope():
    state = prepare(_mlp(), _plan("torchao", "local"), amax_group=object())
    assert len(state.sites) == 2


def test_the_sites_of_one_model_share_one_amax_memo():
    state = prepare(_mlp(), PrecisionPlan.from_dict({"backend": "torch", "rules": [
        {"select": {"glob": "*"}, "format": "fp8_tensorwise"}]}), amax_group=object())
    layers = [s.module for s in state.sites.values()]
    assert all(m.amax_scope is AmaxScope.LOCAL for m in layers)   # the default: torchao's, no DP reduction
    assert layers[0].shared_amax is layers[1].shared_amax is not None
    assert prepare(_mlp(), _plan("torch", "local")).sites["0"].module.shared_amax is not layers[0].shared_amax


def test_shared_amax_reduces_once_per_tensor():
    from lowprec.sites.shared_amax import SharedAmax
    calls = []

    def reduce(t, groups):
        calls.append(groups)
        return t.abs().amax()

    memo, x, g = SharedAmax(), torch.randn(4, 8), ("tp",)
    a = memo.amax(x.reshape(-1, 8), g, reduce)
    assert memo.amax(x.view(4, 8), g, reduce) is a and len(calls) == 1   # q, k, v read one input: one reduction
    assert memo.amax(x, ("tp", "dp"), reduce) is not a and len(calls) == 2    # other groups: its own
    x.mul_(2)                                                               # changed in place: its version moved
    assert memo.amax(x, ("tp", "dp"), reduce) == 2 * a and len(calls) == 3
    memo.amax(x.clone(), ("tp", "dp"), reduce)                              # equal values, another tensor
    memo.amax(x[:2], ("tp", "dp"), reduce)                                  # a part of it
    assert len(calls) == 5
    with torch.inference_mode():
        y = torch.randn(3)
        memo.amax(y, g, reduce), memo.amax(y, g, reduce)                   # no version counter: never shared
    assert len(calls) == 7
