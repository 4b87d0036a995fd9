"""Warm launches call the compiled kernel's launcher exactly as Triton's own launch does.

`experiments.triton_nolaunch` runs Triton's whole launch path on this CPU for sm_90 (binding,
specialisation, compilation with the wheel's ptxas) and records what reaches the launcher.
Each cast is launched through Triton (`kernel[grid]`) and warm (`eager_launch` with the plan's
dict: the first call fills it, the second calls the compiled kernel directly); the launcher
must get the same grid, the same arguments in the same order (the casts' own tensors, the
same dtypes and shapes; the caller's tensors themselves; every other value equal).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

from experiments.triton_nolaunch import nolaunch_driver  # noqa: E402
from lowprec.numerics.formats import E4M3, E5M2  # noqa: E402
from lowprec.numerics.kernels import cast_transpose as ct  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="TRITON_INTERPRET=1: the kernels are interpreted, there is no launcher")


def _triton(kernel, grid, warm=None, vary=(), kw=None):
    return lambda *args: kernel[grid](*args, **(kw or {}))


def _same(a, b, mine: tuple) -> None:
    """One launch's recorded (grid, args) against another's: `mine`, the caller's tensors,
    are the same objects; the cast's own allocations alike in dtype and shape."""
    assert a[0] == b[0] and len(a[1]) == len(b[1])
    for u, v in zip(a[1], b[1]):
        if isinstance(u, torch.Tensor):
            assert isinstance(v, torch.Tensor) and (u.dtype, u.shape) == (v.dtype, v.shape)
            assert any(u is t for t in mine) == any(v is t for t in mine)
            if any(u is t for t in mine):
                assert u is v
        else:
            assert type(u) is type(v) and u == v


def _three(cast):
    """The launches of `cast(launch)` through Triton, then warm twice (fill, then direct)."""
    with nolaunch_driver() as rec:
        cast(_triton)
        n = len(rec.calls)
        cast(ct.eager_launch)
        cast(ct.eager_launch)
    calls = rec.calls
    assert len(calls) == 3 * n
    return calls[:n], calls[n:2 * n], calls[2 * n:]


def test_tensorwise_warm_launch_equals_tritons():
    stats = True   # the statistics buffer is the caller's: one more argument the plan does not fix
    x = torch.randn(96, 80, dtype=torch.bfloat16)
    out = torch.zeros(8, dtype=torch.float64)
    triton_, fill, direct = _three(lambda launch: ct.tensorwise(x, E4M3, True, stats, launch,
                                                                out if stats else None))
    for a, b, c in zip(triton_, fill, direct):
        _same(a, b, (x, out))
        _same(a, c, (x, out))
    assert len(ct._plan(96, 80, E4M3, x.dtype, True, stats, ct._TILE).warm) == 2   # one per kernel


def test_delayed_and_rowwise_warm_launches_equal_tritons():
    x = torch.randn(64, 48, dtype=torch.float32)
    state = (torch.zeros(16), torch.zeros((), dtype=torch.int64), torch.zeros(()),
             torch.zeros((), dtype=torch.int32))
    overflow = torch.zeros(3, dtype=torch.float64)
    for cast in (lambda launch: ct.delayed(x, E5M2, state, 0, False, overflow, 2, True, False, launch),
                 lambda launch: ct.rowwise(x, E4M3, True, False, launch)):
        for a, b, c in zip(*_three(cast)):
            _same(a, b, (x, *state, overflow))
            _same(a, c, (x, *state, overflow))


def test_paired_warm_launches_equal_tritons():
    """The input+weight pair (`cast_pair`), row-wise (the paired kernels with the most
    arguments; the statistics' buffers are among them on plain steps too, as stand-ins): a BF16
    input beside an FP32 weight."""
    from lowprec.numerics.kernels import cast_pair
    x = torch.randn(80, 48, dtype=torch.bfloat16)
    w = torch.randn(40, 48, dtype=torch.float32)
    for a, b, c in zip(*_three(lambda launch: cast_pair.pair(x, w, E4M3, True, launch, rowwise=True))):
        _same(a, b, (x, w))
        _same(a, c, (x, w))


def test_a_new_specialisation_goes_through_triton_and_is_kept_apart():
    """An operand 2 bytes off a 16-byte boundary specialises differently: Triton launches it
    (its own path, a new entry in the plan's dict) and the aligned operand's kernel is kept."""
    base = torch.randn(64 * 32 + 1, dtype=torch.bfloat16)
    aligned, off = base[:-1].view(64, 32), base[1:].view(64, 32)
    plan = ct._plan(64, 32, E4M3, torch.bfloat16, False, False, ct._TILE)
    with nolaunch_driver() as rec:
        ct.tensorwise(aligned, E4M3, False, False)
        ct.tensorwise(off, E4M3, False, False)
        ct.tensorwise(off, E4M3, False, False)
        ct.tensorwise(aligned, E4M3, False, False)
    assert len(plan.warm) == 4   # two kernels x two alignments
    ct_kernels = {k[2]: v[0] for k, v in plan.warm.items() if k[0] == id(ct._ct_kernel)}
    assert len(ct_kernels) == 2 and len(set(map(id, ct_kernels.values()))) == 2
    firsts = [c[1][0] for c in rec.calls[1::2]]   # each cast: the amax pass, then _ct_kernel
    assert all(a is b for a, b in zip(firsts, [aligned, off, off, aligned]))


def test_a_launch_hook_takes_tritons_path():
    """With a launch hook set (a profiler), every launch is Triton's own: Triton builds the
    launch metadata the hook reads, which a warm launch never does."""
    from lowprec.numerics.kernels import warm_launch as wl
    hook = wl._hooks.launch_enter_hook
    if not hasattr(hook, "add"):
        pytest.skip("this Triton's launch hook is not a chain")
    x = torch.randn(32, 32, dtype=torch.bfloat16)

    def seen(metadata):
        pass
    with nolaunch_driver() as rec:
        ct.tensorwise(x, E4M3, True, False)   # warm
        ct.tensorwise(x, E4M3, True, False)
        hook.add(seen)
        try:
            assert wl._hooked(hook)
            ct.tensorwise(x, E4M3, True, False)
        finally:
            hook.remove(seen)
    assert [c[2] is None for c in rec.calls[2:]] == [True, True, False, False]
