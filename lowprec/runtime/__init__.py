"""The rollout runtime: `Session` for your own loop; `train` (the one loop) and `run_config` for lowprec's.

    from lowprec.runtime import Session
    session = Session.from_yaml("lowprec.yaml", model, optimizer, scheduler=scheduler)
    ...
    loss = closure()            # forward and backward of this step
    session.step(loss, closure) # the closure replays an anomalous step with sites in high precision

Folders, one job each (each `__init__` says what is in it): `session/` (the rollout every host
drives: Session, AfterStep, evals, RunLife), `trainer/` (`lowprec run` and `lowprec plan`: the
command, the one loop, the run folder, the launch under torchrun), `engines/` (how a step's
forward and backward run: one process, DP x TP, FSDP2, HSDP, pipeline stages).
Importing this package imports no MLflow.

May import: lowprec.config, lowprec.tracking, lowprec.state, lowprec.policy, lowprec.sites,
lowprec.numerics, lowprec.base.
"""

from lowprec.runtime.trainer.faults import FaultKind, Injection, parse_injection
from lowprec.runtime.session.lrprobe import LRProbe, ProbeResult
from lowprec.runtime.session.session import Session, SessionSettings, StepResult

__all__ = ["Session", "SessionSettings", "StepResult", "LRProbe", "ProbeResult", "Injection", "FaultKind", "parse_injection"]
