"""The weight-quantization cache: bit-identical numerics, reuse across micro-batches, and
invalidation by every way a weight changes (optimizer step, load_state_dict, rewind, switch)."""

import pytest
import torch
from torch import nn

from lowprec.sites.backends import get_backend
from lowprec.numerics.formats import get_format
from lowprec.sites.layers import PrecisionLinear
from lowprec.runtime.session.snapshots import MemorySnapshots

FMTS = ["fp8_tensorwise", "fp8_delayed", "fp8_rowwise"]


def _model(fmt, backend, cache, seed=0):
    torch.manual_seed(seed)
    a, b = nn.Linear(32, 48), nn.Linear(48, 16, bias=False)
    mk = lambda m, i: PrecisionLinear.from_module(  # noqa: E731
        m, get_format(fmt), get_backend(backend), cache_weights=cache, seed=i, fqn=f"l{i}")
    return nn.Sequential(mk(a, 0), nn.GELU(), mk(b, 1))


def _train(fmt, backend, cache, optim="adamw", steps=3, micro=3):
    """Losses, per-step grads, statistics and final weights of `steps` optimizer steps of
    `micro` gradient-accumulation micro-batches; statistics on every other step."""
    model = _model(fmt, backend, cache)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=optim == "adamw",
                             fused=optim == "fused") if optim != "sgd"
           else torch.optim.SGD(model.parameters(), lr=1e-1))
    gen = torch.Generator().manual_seed(1)
    out = []
    for step in range(steps):
        for m in model:
            if isinstance(m, PrecisionLinear):
                m.collect_stats = step % 2 == 0
        opt.zero_grad()
        for _ in range(micro):
            x = torch.randn(4, 8, 32, generator=gen)
            loss = model(x).square().mean()
            loss.backward()
            out.append(loss.detach())
            for m in model:
                if isinstance(m, PrecisionLinear):
                    out.extend(st.packed.clone() for _, st in sorted(m.stats.items()))
                    m.stats.clear()
        out.extend(p.grad.clone() for p in model.parameters())
        opt.step()
    out.extend(p.detach().clone() for p in model.parameters())
    return out, model


@pytest.mark.parametrize("backend", ["emulated", "torch"])
@pytest.mark.parametrize("fmt", FMTS)
def test_cache_is_bit_identical(fmt, backend):
    """Losses, gradients, statistics and weights equal bit for bit with and without the cache
    over 3 optimizer steps of 3 micro-batches each, statistics on and off."""
    with_cache, model = _train(fmt, backend, cache=True)
    without, _ = _train(fmt, backend, cache=False)
    assert len(with_cache) == len(without)
    for a, b in zip(with_cache, without):
        assert torch.equal(a, b)
    hits = sum(m.weight_cache.hits for m in model if isinstance(m, PrecisionLinear))
    if fmt == "fp8_delayed":
        assert hits == 0   # delayed scaling is never cached: its scale moves every call
    else:
        assert hits > 0


@pytest.mark.parametrize("fmt,per_step", [("fp8_tensorwise", 1), ("fp8_rowwise", 2)])
def test_weight_quantized_once_per_update(fmt, per_step):
    """Tensor-wise: the forward's quantization, transposed, serves the backward, so one
    quantization per optimizer step; row-wise: one per layout (forward and backward). With
    statistics off throughout, nothing is ever re-quantized within a step."""
    model = _model(fmt, "emulated", True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for m in model[::2]:
        m.collect_stats = False
    for _ in range(3):
        for _ in range(4):
            model(torch.randn(8, 32, requires_grad=True)).sum().backward()
        opt.step()
    for m in model[::2]:
        assert m.weight_cache.misses == 3 * per_step
        assert m.weight_cache.hits == 3 * (4 * per_step - per_step)


def test_check_step_after_plain_steps_requantizes_with_stats():
    """An entry made with statistics off does not serve a check step: it is replaced by one
    with statistics, and those equal a fresh quantization's."""
    model = _model("fp8_tensorwise", "emulated", True)
    layer = model[0]
    layer.collect_stats = False
    x = torch.randn(8, 32)
    model(x)
    assert "weight" not in layer.stats
    layer.collect_stats = True
    model(x)
    st = layer.stats["weight"].packed.clone()
    assert layer.weight_cache.misses == 2
    model(x)   # now a hit that carries statistics
    assert layer.weight_cache.hits == 1 and torch.equal(layer.stats["weight"].packed, st)
    ref = _model("fp8_tensorwise", "emulated", False)
    ref(x)
    assert torch.equal(ref[0].stats["weight"].packed, st)


@pytest.mark.parametrize("optim", ["sgd", "adamw", "fused"])
def test_every_optimizer_step_invalidates(optim):
    """SGD and foreach AdamW bump the weight's _version; fused AdamW does not (measured on
    torch 2.13 CPU: _fused_adamw_ leaves the counter alone), which is why the key also holds
    the count of torch.optim steps taken in the process. Either way the next forward after a
    step quantizes the updated weight: the outputs equal an uncached layer's."""
    out = []
    for cache in (True, False):
        model = _model("fp8_tensorwise", "emulated", cache)
        opt = (torch.optim.SGD(model.parameters(), lr=0.1) if optim == "sgd"
               else torch.optim.AdamW(model.parameters(), lr=0.1, foreach=optim == "adamw",
                                      fused=optim == "fused"))
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
        for _ in range(3):
            model(x).square().mean().backward()
            opt.step()
            out.append(_out(model, x))
    for a, b in zip(out[:3], out[3:]):
        assert torch.equal(a, b)


def _out(model, x):
    with torch.no_grad():
        return model(x)


def test_load_state_dict_and_rewind_invalidate():
    """load_state_dict and MemorySnapshots.restore (a rewind) copy into the weight in place:
    its _version moves, and the next forward quantizes the restored weight."""
    model = _model("fp8_tensorwise", "torch", True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(8, 32)
    snaps = MemorySnapshots(model, opt, every=1)
    snaps.take(0)
    before = _out(model, x)
    model(x).square().mean().backward()
    opt.step()
    after = _out(model, x)
    assert not torch.equal(before, after)
    v = model[0].weight._version
    assert snaps.restore(1, 0) == 0
    assert model[0].weight._version > v
    assert torch.equal(_out(model, x), before)          # a rewind: the old weight's quantization
    other = _model("fp8_tensorwise", "torch", False, seed=5)
    v = model[0].weight._version
    model.load_state_dict(other.state_dict())
    assert model[0].weight._version > v
    assert torch.equal(_out(model, x), _out(other, x))  # load_state_dict: the loaded weight's


def test_format_switch_and_device_move_clear_the_cache():
    model = _model("fp8_tensorwise", "emulated", True)
    x = torch.randn(8, 32)
    _out(model, x)
    layer = model[0]
    assert len(layer.weight_cache) == 1
    for m in model[::2]:
        m.set_format(get_format("fp8_rowwise"))
    assert len(layer.weight_cache) == 0
    ref = _model("fp8_rowwise", "emulated", False)
    assert torch.equal(_out(model, x), _out(ref, x))
    model.to(torch.float64).to(torch.float32)   # a new tensor behind the Parameter
    assert len(layer.weight_cache) == 0


def test_write_behind_autograd_needs_clear():
    """`.data.copy_` bumps the alias's counter, not the Parameter's: documented, and clear()
    is the remedy."""
    model = _model("fp8_tensorwise", "emulated", True)
    x = torch.randn(8, 32)
    _out(model, x)
    with torch.no_grad():
        model[0].weight.data.copy_(torch.randn(48, 32))
    stale = _out(model, x)
    model[0].weight_cache.clear()
    ref = _model("fp8_tensorwise", "emulated", False)
    ref.load_state_dict(model.state_dict())
    assert torch.equal(_out(model, x), _out(ref, x))
    assert not torch.equal(stale, _out(ref, x))


def test_the_step_count_is_the_caches_own_not_the_process():
    """Issue 55: the optimizer-step count behind the keys is an `OptimizerSteps` each cache is
    given (or makes) at construction, not a module global: a layer made after steps of another
    model's optimizer starts at 0, a collected counter takes its torch hook with it, a copy
    counts on its own, and `lowprec.sites.weight_cache` keeps no mutable state of its own."""
    import ast
    import copy
    import gc
    import weakref
    from pathlib import Path
    from torch.optim.optimizer import _global_optimizer_post_hooks
    from lowprec.sites import weight_cache

    first = _model("fp8_tensorwise", "emulated", True)
    opt = torch.optim.SGD(first.parameters(), lr=0.1)   # no gradients: its step_post hooks still run
    opt.step()
    opt.step()
    assert [m.weight_cache.steps.count for m in first if isinstance(m, PrecisionLinear)] == [2, 2]
    later = _model("fp8_tensorwise", "emulated", True)
    assert later[0].weight_cache.steps.count == 0            # not the process's 2
    twin = copy.deepcopy(later)
    opt.step()
    assert (later[0].weight_cache.steps.count, twin[0].weight_cache.steps.count) == (1, 1)
    assert twin[0].weight_cache.steps is not later[0].weight_cache.steps
    # the four counters' hooks go with them (other tests' collected counters may go too: count ours)
    counters = [weakref.ref(m.weight_cache.steps) for m in [*later, *twin] if isinstance(m, PrecisionLinear)]
    assert len(counters) == 4

    def ours() -> int:
        return sum(any(c.cell_contents is r for c in (fn.__closure__ or ()) for r in counters)
                   for fn in list(_global_optimizer_post_hooks.values()))
    assert ours() == 4
    del later, twin
    gc.collect()
    assert all(r() is None for r in counters) and ours() == 0
    tree = ast.parse(Path(weight_cache.__file__).read_text())
    mutable = [ast.unparse(n) for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
               and not (isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == ["__all__"])]
    assert not mutable, mutable
