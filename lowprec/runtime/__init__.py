"""The rollout runtime: `Session` for your own loop; `train` (the one loop) and `run_config` for lowprec's.

    from lowprec.runtime import Session
    session = Session.from_yaml("lowprec.yaml", model, optimizer, scheduler=scheduler)
    ...
    loss = closure()            # forward and backward of this step
    session.step(loss, closure) # the closure replays an anomalous step with sites in high precision

Modules: `session` (Session), `snapshots` (in-memory and disk rewinds), `loop` (train),
`engine` (the engine protocol, one process), `fsdp` (FullyShardedDP: FSDP2 for any model),
`parallel` (the engines under torchrun: FSDP2/HSDP x TP, pipeline), `mesh` (the job's one
DeviceMesh), `gradnorm` (the global gradient norm), `pipeline_forward`
(forwards through pipeline stages outside training), `parallel_run`
(`lowprec run` on several processes: the launch, its checks, each rank's run), `rank_device`
(each rank's backend and device: NCCL on cuda:LOCAL_RANK or gloo), `layout` (`lowprec plan`'s
account of a parallel layout), `site_paths` (per site: fast/slow-path calls, all-gather dtype),
`data` (token batches), `lrprobe` (LRProbe: the loss after a virtual step at lr x2 / x0.5),
`faults` (injected faults), `evals` (eval checkpoints, evaluator
and gate protocols), `run` (a config, end to end), `cli` (`lowprec run`, `lowprec plan`).
Importing this package imports no MLflow.

May import: lowprec.config, lowprec.tracking, lowprec.state, lowprec.policy, lowprec.sites,
lowprec.numerics, lowprec.base.
"""

from lowprec.runtime.faults import FaultKind, Injection, parse_injection
from lowprec.runtime.lrprobe import LRProbe, ProbeResult
from lowprec.runtime.session import Session, SessionSettings, StepResult

__all__ = ["Session", "SessionSettings", "StepResult", "LRProbe", "ProbeResult", "Injection", "FaultKind", "parse_injection"]
