"""`lowprec run` and `lowprec plan`: the command (`cli`), the checks before step 0 and a run end
to end (`run`), the one training loop (`loop`), the run folder, the console and the summary,
token batches, injected faults, the speed estimate, and the same run under torchrun
(`parallel_run`: the launch, its checks, each rank's run; `layout`: the plan's account of it).

Part of the runtime layer: it may import what lowprec.runtime may import (its
`__init__` says)."""
