"""Triton's launch path on a machine without a GPU: everything but the driver's launch call.

`nolaunch_driver()` makes a CUDA-like driver Triton's active one for the block (restored on
exit): `kernel[grid](...)` on CPU tensors then runs Triton's whole host path as on an H100 --
argument binding and specialisation, the kernel cache key, compilation for sm_90 with the
ptxas the wheel ships (once per specialisation, cached on disk as on a GPU), the compiled
kernel's handles -- and ends in a launcher that records its arguments instead of calling
`cuLaunchKernelEx`. What it leaves out is the C launcher itself (its per-argument
conversion and the driver call) and CUDA's allocator: `bench_host_noop.py --triton`
adds those per launch from `--launch-us`.

Used by `experiments/bench_host_noop.py --triton` and by the test that holds
`lowprec.numerics.kernels.warm_launch` to Triton's own launches (the same launcher arguments).
Needs Triton with its NVIDIA backend; not under TRITON_INTERPRET=1 (no compiled kernels there).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

__all__ = ["nolaunch_driver", "Launches"]

_HOPPER_SHARED = 232448   # bytes of shared memory per block on an H100/H200


@dataclass
class Launches:
    """What the launcher was called with: one tuple per launch, (grid, the kernel's arguments,
    the launch metadata: None unless Triton built it for a launch hook)."""

    calls: list = field(default_factory=list)
    record: bool = True
    count: int = 0


class _Utils:
    """The driver's utilities Triton calls before a launch: loading a compiled binary (a
    placeholder handle here) and the device's limits (an H100's)."""

    def load_binary(self, name, kernel, shared, device):
        return 1, 1, 32, 0, 1024   # module, function, registers, spills, max threads

    def get_device_properties(self, device):
        return {"max_shared_mem": _HOPPER_SHARED, "multiprocessor_count": 132, "max_num_regs": 65536,
                "warpSize": 32}

    def unload_module(self, module):
        pass


class _NoLaunchDriver:
    """A driver whose target is sm_90 and whose launcher records instead of launching, into
    the `Launches` of the block in force (Triton keeps a compiled kernel's launcher for the
    process, so one driver serves every block)."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget
        self.utils = _Utils()
        self._target = GPUTarget("cuda", 90, 32)
        self.launches = Launches(record=False)

        def launcher_cls(src, metadata):
            def run(grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata, enter_hook,
                    exit_hook, *args):
                launches = self.launches
                launches.count += 1
                if launches.record:
                    launches.calls.append(((grid_x, grid_y, grid_z), args, launch_metadata))
            return run
        self.launcher_cls = launcher_cls

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        return self._target

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


_DRIVER = _NoLaunchDriver()


@contextlib.contextmanager
def nolaunch_driver(record: bool = True):
    """Within this block Triton launches for sm_90 on CPU tensors, recording each launch
    (`Launches.calls`, unless `record` is False: then only counting)."""
    from triton.runtime import driver
    launches = Launches(record=record)
    _DRIVER.launches = launches
    previous = driver._active   # None until a driver was first asked for: restored as it was
    driver.set_active(_DRIVER)
    try:
        yield launches
    finally:
        driver.set_active(previous)
