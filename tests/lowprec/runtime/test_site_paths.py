"""`lowprec.runtime.trainer.site_paths`: each site's fast- and slow-path calls and the dtype FSDP2
gathers its weight in, as summary.json and MLflow show them (one rank, gloo, FSDP2 with
`fp8_all_gather`; the one-process run's summary: tests/lowprec/runtime/test_cli_run.py)."""

import torch
from torch import nn

from lowprec import prepare
from lowprec.numerics.formats import get_format
from lowprec.runtime.trainer.site_paths import all_gather_tag, path_metrics, site_paths
from lowprec.sites.plan import PrecisionPlan


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)) for _ in range(2)])

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return nn.functional.mse_loss(x, y)


def test_fast_calls_and_the_fp8_all_gather_per_site_and_bf16_after_a_fallback(one_rank):
    from lowprec.runtime.engines.fsdp import FullyShardedDP
    torch.manual_seed(0)
    model = _Blocks()
    plan = PrecisionPlan.from_dict({"backend": "torch", "amax_scope": "local", "rules": [
        {"name": "b0", "select": {"glob": "blocks.0.*"}, "format": "fp8_tensorwise", "ladder": ["fp8_tensorwise", "bf16"]},
        {"name": "b1", "select": {"glob": "blocks.1.*"}, "format": "bf16", "ladder": ["fp8_tensorwise", "bf16"]}]})
    state = prepare(model, plan)
    engine = FullyShardedDP(model, fp8_all_gather=True)
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    engine.forward_backward(x, y)
    engine.forward_backward(x, y)
    paths = site_paths(state, engine)
    fp8, hp = ("blocks.0.0", "blocks.0.2"), ("blocks.1.0", "blocks.1.2")
    assert {f: (paths[f]["fast_calls"], paths[f]["slow_calls"], paths[f]["all_gather"]) for f in fp8 + hp} == {
        **{f: (2, 0, "float8_e4m3fn") for f in fp8}, **{f: (0, 0, "float32") for f in hp}}
    assert path_metrics(paths)["path/blocks.0.0/fast_calls"] == 2.0
    assert all_gather_tag(paths) == {"lowprec.all_gather": "float32: blocks.1.0, blocks.1.2; "
                                                           "float8_e4m3fn: blocks.0.0, blocks.0.2"}
    state.sites["blocks.0.0"].module.set_format(get_format("bf16"))   # a fallback: high precision from the next step
    engine.forward_backward(x, y)
    after = site_paths(state, engine)
    assert after["blocks.0.0"] == {"fast_calls": 2, "slow_calls": 0, "all_gather": "float32"}
    assert after["blocks.0.2"]["fast_calls"] == 3


def test_no_all_gather_without_fsdp2():
    from lowprec.runtime.engines.engine import SingleProcess
    torch.manual_seed(0)
    model = _Blocks()
    state = prepare(model, PrecisionPlan.from_dict({"backend": "emulated", "rules": [
        {"select": {"glob": "*"}, "format": "fp8_tensorwise"}]}))
    engine = SingleProcess(model)
    engine.forward_backward(torch.randn(4, 16), torch.randn(4, 16))
    paths = site_paths(state, engine)
    assert all(p == {"fast_calls": 0, "slow_calls": 1, "all_gather": None} for p in paths.values()), paths
    assert all_gather_tag(paths) == {}


def test_the_counts_persist_through_a_checkpoint(tmp_path):
    """A resumed run's counts are the whole run's: the checkpoint's precision state holds them."""
    from lowprec.runtime.engines.engine import SingleProcess
    from lowprec.state.checkpoint import load_checkpoint, save_checkpoint

    def build():
        torch.manual_seed(0)
        model = _Blocks()
        state = prepare(model, PrecisionPlan.from_dict({"backend": "emulated", "rules": [
            {"select": {"glob": "*"}, "format": "fp8_tensorwise"}]}))
        return model, state, torch.optim.SGD(model.parameters(), lr=0.1)

    model, state, opt = build()
    for _ in range(3):
        SingleProcess(model).forward_backward(torch.randn(4, 16), torch.randn(4, 16))
    path = save_checkpoint(tmp_path, 3, model=model, optimizer=opt, precision=state)
    model, resumed, opt = build()
    assert all(p["slow_calls"] == 0 for p in site_paths(resumed, SingleProcess(model)).values())
    load_checkpoint(path, model=model, optimizer=opt, precision=resumed)
    SingleProcess(model).forward_backward(torch.randn(4, 16), torch.randn(4, 16))
    assert all(p["slow_calls"] == 4 for p in site_paths(resumed, SingleProcess(model)).values())
