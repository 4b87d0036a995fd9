"""Eager launches of the fast path's kernels without Triton's per-launch argument binding.

`kernel[grid](*args, **kwargs)` runs Triton's `JITFunction.run` on every call: it binds the
arguments to the signature, specialises each one (dtype and 16-byte alignment of every
pointer, divisibility of every integer), builds the kernel cache key from all of that and
the options, checks the kernel's globals, and only then calls the compiled kernel's
launcher. For `_ct_kernel`'s 19 runtime arguments and 20 constexprs that costs about 19 us
of host time per launch on a 2-core EPYC VM (the amax pass's 3 arguments: 7 us), most of a
cast's host time on a GPU.

`warm_launch(kernel, grid, warm, vary)` does that work once per specialisation: the first
launch goes through `kernel[grid]`, which returns the `CompiledKernel` it launched; later
launches whose arguments specialise the same way (the same dtypes, the same 16-byte
alignment of every pointer, the same integers: the plan fixes all but `vary`'s) call that
kernel's launcher (`CompiledKernel.run`, what
`JITFunction.run` calls last) with the same arguments in the same order, on the current
device's current stream (the launcher, its function handle and packed metadata, and the
grid padded to three dimensions are read once, at that first launch: a plan's grid is
fixed). The arguments are those of Triton 3.6 to 3.9's `JITFunction.run`:
the grid, stream, function, packed metadata, launch metadata, the two launch hooks, then every
parameter's value in signature order, constexprs included. `warm` is a dict its caller keeps per launch plan (a shape and
recipe: the constexprs are the plan's), so the key holds only what can change between two
calls of one plan. Triton's own path is kept wherever the shortcut could differ from it: a
kernel Triton returned no `CompiledKernel` for (the interpreter), and a launch hook being
set (a profiler such as proton reads launch metadata from it).
"""

from __future__ import annotations

import functools

import torch
from triton.runtime import driver
from triton.runtime.jit import JITFunction

try:   # Triton >= 3.4 keeps the launch hooks in its knobs, older versions on CompiledKernel
    from triton.knobs import runtime as _hooks
except ImportError:  # pragma: no cover - older Triton
    from triton.compiler import CompiledKernel as _hooks

__all__ = ["warm_launch", "specialisation_key"]


def specialisation_key(vary: tuple) -> tuple:
    """What Triton specialises a launch on among the arguments `vary`: each tensor's dtype and
    whether its address is a multiple of 16, each other value itself (integers are
    specialised on their value: 1, divisibility by 16, width)."""
    return tuple([(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a for a in vary])


def _hooked(hook) -> bool:
    """Whether a launch hook is set: Triton >= 3.9 holds a chain of hooks (possibly empty),
    older versions a callable or None."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _launchable(ck) -> bool:
    """Whether `ck` is a compiled kernel whose launcher can be called as `JITFunction.run` does."""
    return all(hasattr(ck, a) for a in ("run", "function", "packed_metadata"))


class _Warm:
    """One launch of `kernel` on `grid` through the compiled kernel cached in `warm`."""

    __slots__ = ("kernel", "grid", "warm", "vary", "kw")

    def __init__(self, kernel, grid, warm: dict, vary: tuple, kw: dict):
        self.kernel, self.grid, self.warm, self.vary, self.kw = kernel, grid, warm, vary, kw

    def __call__(self, *args):
        drv = driver.active
        enter = getattr(_hooks, "launch_enter_hook", None)
        hooked = _hooked(enter)
        device = drv.get_current_device()
        key = (id(self.kernel), device, specialisation_key(self.vary))
        hit = None if hooked else self.warm.get(key)
        if hit is None:
            kwargs = self.kw
            ck = self.kernel[self.grid](*args, **kwargs)
            rest = self.kernel.arg_names[len(args):]
            if not hooked and _launchable(ck) and all(n in kwargs for n in rest):
                grid = (*self.grid, 1, 1)[:3]
                self.warm[key] = (ck, ck.run, ck.function, ck.packed_metadata, grid, tuple(kwargs[n] for n in rest))
            return ck
        ck, run, function, packed, grid, consts = hit
        # no launch metadata: it is built only for the enter hook, which is not set (an empty
        # chain is passed on as Triton passes it: calling it calls nothing)
        run(grid[0], grid[1], grid[2], drv.get_current_stream(device), function, packed, None, enter,
            getattr(_hooks, "launch_exit_hook", None), *args, *consts)
        return ck


def warm_launch(kernel, grid, warm: dict | None = None, vary: tuple = (), kw: dict | None = None):
    """A callable of the kernel's positional arguments that launches `kernel[grid](*args, **kw)`;
    with `warm` (the caller's per-plan dict), one that binds and specialises its arguments
    through Triton once per specialisation (module docstring). `kw`: the plan's keyword
    arguments (its constexprs and launch options), the plan's own dict, not copied per call.
    Every call of one plan must pass the same `kw` and the same positional arguments but for
    `vary`: the arguments whose dtype, alignment or value may change between two calls of the
    plan (a caller's tensors; not the outputs the caller allocates, whose dtypes the plan fixes
    and whose addresses the allocator aligns)."""
    kw = {} if kw is None else kw
    if warm is None or not isinstance(kernel, JITFunction):   # the interpreter's kernels: Triton's path
        return functools.partial(kernel[grid], **kw)
    return _Warm(kernel, grid, warm, vary, kw)
