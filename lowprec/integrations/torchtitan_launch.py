"""torchtitan 0.3's entry point with the three changes torch 2.13 and a CPU need, as a launcher.

    torchrun --nproc-per-node 2 -m lowprec.integrations.torchtitan_launch --module my_configs --config fn

runs `torchtitan.train`'s own `main()` (its config registry, Trainer, data loader and
checkpointer) after changing, in this process and before torchtitan is imported, exactly:

* pipeline schedules (`adapt_pipeline_schedules`, every machine): torchtitan 0.3's
  `pp_forward_backward_step` hands `pp_schedule.step` the micro-batches already split
  (`arg_mbs=`, `kwarg_mbs=`, `target_mbs=`), which torch 2.13's `step` does not take ("Expecting
  2 arg_mbs but got 1"): a version mismatch, so a GPU job on these versions needs it too. `step`
  gets the keyword form and does around `_step_microbatches` what torch's own `step` does.
  Nothing changes where torch's `step` already takes `arg_mbs`.
* process-group timeouts (`keep_timeouts`): torchtitan calls `torch.distributed.set_timeout`
  after the first step, which torch 2.13 lacks; the timeouts stay as `init` set them.
* the device (`run_on_cpu`, only where torch finds no accelerator): `torchtitan.tools.utils`
  picks "cuda" when torch finds none and then sets that device; torch's lookup answers "cpu"
  instead, and the CPU's device module gets the calls torchtitan's memory monitor and MFU
  logging make (device name and capacity, memory statistics), reporting no memory statistics.

Each function can be called on its own by a launcher of the user's; `main` calls all three,
and turns a lowprec `ConfigError` into one line from rank 0 and exit status 2.
The job's own CPU settings (SDPA attention, FSDP's SUM reduction under gloo) stay in its config
function: docs/integrations.md, "How it was tested, and what a CPU run needs".
"""

import sys
import types

__all__ = ["adapt_pipeline_schedules", "keep_timeouts", "run_on_cpu", "main"]


def run_on_cpu() -> bool:
    """Let torchtitan run on a CPU where torch finds no accelerator; whether it was needed."""
    import torch._utils as torch_utils

    find, module = torch_utils._get_available_device_type, torch_utils._get_device_module
    if find() is not None:
        return False
    cpu = types.SimpleNamespace(
        set_device=lambda device: None, device_count=lambda: 1, current_device=lambda: 0, is_available=lambda: True,
        synchronize=lambda device=None: None, empty_cache=lambda: None, reset_peak_memory_stats=lambda device=None: None,
        memory_stats=lambda device=None: {}, get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=1 << 40))
    torch_utils._get_available_device_type = lambda: find() or "cpu"
    torch_utils._get_device_module = lambda kind: cpu if kind == "cpu" else module(kind)
    return True


def keep_timeouts() -> bool:
    """torchtitan's timeout change made a no-op where torch lacks `set_timeout`; whether it was needed."""
    import torch.distributed

    if hasattr(torch.distributed, "set_timeout"):
        return False
    import torchtitan.distributed.utils as titan_dist
    titan_dist.set_pg_timeouts = lambda timeout, parallel_dims: None
    return True


def _premade_microbatches(step):
    """A schedule's `step` that also takes the micro-batches already split, as torchtitan 0.3 passes them."""
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


def adapt_pipeline_schedules() -> bool:
    """torch's single- and multi-stage schedules given the keyword form torchtitan 0.3 calls; whether it was needed."""
    from torch.distributed.pipelining import schedules

    if "arg_mbs" in schedules.PipelineScheduleSingle.step.__code__.co_varnames:
        return False
    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        cls.step = _premade_microbatches(cls.step)
    return True


def main() -> int | None:
    """The three changes, then torchtitan's `main()` (its command line: `--module M --config F ...`).
    A lowprec setting that cannot be used (a `ConfigError`: the converter checks the whole file
    against the model, built on the meta device, before torchtitan builds anything) ends the job
    with one line from rank 0 and exit status 2 on every rank, no traceback."""
    import os

    from lowprec.base.parse import ConfigError
    run_on_cpu()
    keep_timeouts()
    adapt_pipeline_schedules()
    from torchtitan.train import main as titan_main
    try:
        return titan_main()
    except ConfigError as e:
        if os.environ.get("RANK", "0") == "0":   # torchrun's rank: one line per job
            print(f"lowprec: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
