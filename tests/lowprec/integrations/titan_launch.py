"""`torchrun ... titan_launch.py --module M --config F`: torchtitan's `torchtitan.train` on a CPU with gloo.

torchtitan 0.3 refuses a machine without an accelerator in two places, and torch 2.13 lacks
one function it calls; this launcher changes exactly those, in this process, before
torchtitan is imported, and then runs torchtitan's own `main()` (its Trainer, config
registry, data loader, checkpointer):

* the device: `torchtitan.tools.utils` picks "cuda" when torch finds no accelerator
  (`_get_available_device_type() or "cuda"`), then sets that device. Here torch's lookup
  answers "cpu", and the CPU's device module gets the few calls torchtitan makes on a
  device module that `torch.cpu` does not have (memory statistics, device name and
  capacity, used by its memory monitor and MFU logging): they report a device with no
  memory statistics.
* `torch.distributed.set_timeout`, which torchtitan calls after the first step to shorten
  the process groups' timeouts, is not in torch 2.13: the timeouts stay as `init` set them.
* pipeline schedules: torchtitan 0.3 hands `pp_schedule.step` the microbatches already split
  (`arg_mbs=`, `kwarg_mbs=`, `target_mbs=`); torch 2.13's `step` takes the whole batch only
  (`torch/distributed/pipelining/schedules.py`). `step` is given the keyword form: it then does
  what torch's own `step` does around `_step_microbatches`, on the given microbatches.

* `torch._scaled_mm` on CPU tensors (the `torch` backend's FP8 GEMM): torch's CPU kernel is a
  reference loop (4.6 s for one 128x256x768 GEMM on the test machine, against milliseconds
  for the same product in FP32), too slow for torchtitan's debug model. Here it computes the
  product as lowprec's `emulated` backend does: the FP8 operands dequantized by their scales,
  multiplied in FP32 (row-wise scales: the CPU kernel's result bit for bit; tensor-wise: up to
  FP32 summation order), rounded to `out_dtype`. The FP8 bytes, scales and gathers are the
  real ones; only the multiplication of those bytes runs in another kernel.

Two more CPU settings are the job's own (the config module the test writes): FlexAttention
has no backward on CPU (the SDPA attention module instead), and gloo has no PREMUL_SUM
reduction, which FSDP2 uses when torchtitan turns its gradient division off (FSDP then
reduces with SUM: `set_force_sum_reduction_for_comms`, the same numbers).
"""

import sys
import types

import torch
import torch._utils as torch_utils

_find = torch_utils._get_available_device_type
_module = torch_utils._get_device_module
_CPU = types.SimpleNamespace(
    set_device=lambda device: None, device_count=lambda: 1, current_device=lambda: 0, is_available=lambda: True,
    synchronize=lambda device=None: None, empty_cache=lambda: None, reset_peak_memory_stats=lambda device=None: None,
    memory_stats=lambda device=None: {}, get_device_name=lambda device=None: "cpu",
    get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=1 << 40))

torch_utils._get_available_device_type = lambda: _find() or "cpu"
torch_utils._get_device_module = lambda kind: _CPU if kind == "cpu" else _module(kind)

import torch.distributed  # noqa: E402

if not hasattr(torch.distributed, "set_timeout"):
    import torchtitan.distributed.utils as titan_dist  # noqa: E402
    titan_dist.set_pg_timeouts = lambda timeout, parallel_dims: None

from torch.distributed.pipelining import schedules as _schedules  # noqa: E402

_scaled_mm = torch._scaled_mm


def _scaled_mm_fp32(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    """`torch._scaled_mm` with the CPU's product computed in FP32 (see the module docstring)."""
    if a.device.type != "cpu" or scale_result is not None:
        return _scaled_mm(a, b, scale_a, scale_b, bias=bias, scale_result=scale_result, out_dtype=out_dtype,
                          use_fast_accum=use_fast_accum)
    out = (a.float() * scale_a.float()) @ (b.float() * scale_b.float())
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or a.dtype)


torch._scaled_mm = _scaled_mm_fp32


def _premade_microbatches(step):
    """A schedule's `step` that also takes the microbatches already split (`arg_mbs=`,
    `kwarg_mbs=`, `target_mbs=`), as torchtitan 0.3's `pp_forward_backward_step` passes them;
    torch 2.13's `step` takes only the whole batch and splits it itself. What torch's `step`
    does around `_step_microbatches`, with the given microbatches."""
    def run(self, *args, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, return_outputs=True,
            loss_kwargs=None, **kwargs):
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return step(self, *args, losses=losses, return_outputs=return_outputs, loss_kwargs=loss_kwargs, **kwargs)
        stages = getattr(self, "_stages", None) or [self._stage]
        for stage in stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
        last = [s for s in stages if s.is_last]
        return self._merge_outputs(last[0].output_chunks) if last and return_outputs else None
    return run


if "arg_mbs" not in _schedules.PipelineScheduleSingle.step.__code__.co_varnames:
    for _cls in (_schedules.PipelineScheduleSingle, _schedules.PipelineScheduleMulti):
        _cls.step = _premade_microbatches(_cls.step)

from torchtitan.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
