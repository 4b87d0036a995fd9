"""How one step's forward and backward run, the engine the loop is given: one process
(`engine`), DP x TP, FSDP2 x TP, HSDP and pipeline stages under torchrun (`parallel`, `fsdp`),
FSDP2's FP8 all-gather (`fsdp_fp8`), the global gradient norm (`gradnorm`), forwards through
pipeline stages (`pipeline_forward`) and each rank's backend and device (`rank_device`).

Part of the runtime layer: it may import what lowprec.runtime may import (its
`__init__` says)."""
