"""A framework callback's config checked whole against its model, before any training.

`LowprecCallback.from_yaml` (Hugging Face, Lightning: `lowprec.integrations.core.HostedRollout`)
and `lowprec plan --model-factory` run the same check, so that what fails later at
`trainer.train()` fails here instead, as a ConfigError naming the key: the baseline loss curve
`rollout.baseline` names is read (a losses file, or the MLflow run looked up in the
`tracking:` store), every stage is resolved against the prepared model (each must select a
site), and the `eval:` section's evaluator and gate file are found.
"""

from __future__ import annotations

from lowprec.base.parse import ConfigError

__all__ = ["check_framework_config"]


def check_framework_config(cfg, state, model, baseline: dict[int, float] | None = None):
    """(the baseline curve, the controller it builds or None) for `cfg` over `state` (the
    prepared `model`); raises ConfigError. `baseline`: a curve the caller passes itself."""
    if baseline is None and cfg.rollout is not None and cfg.rollout.baseline is not None:
        from lowprec.runtime.session.host import read_baseline
        try:
            baseline = read_baseline(cfg)
        except (LookupError, FileNotFoundError) as e:
            raise ConfigError("rollout.baseline", str(e).strip("'\"")) from None
    controller = None
    if cfg.rollout is not None:
        from lowprec.policy.rollout import build_controller
        controller = build_controller(cfg.rollout, state, model, baseline=baseline)
    if cfg.eval is not None:
        from lowprec.runtime.session.evals import (EVALUATORS, GATE_CHECKERS, check_gated_tasks, eval_config_errors,
                                                   load_entry_point)
        with eval_config_errors():
            ev_cls = load_entry_point(EVALUATORS, cfg.eval.evaluator)
            if hasattr(ev_cls, "check_config"):
                ev_cls.check_config(cfg.eval)
            if cfg.eval.gates:
                checker = load_entry_point(GATE_CHECKERS, "default")(cfg.eval.gates)
                if hasattr(ev_cls, "task_names"):
                    check_gated_tasks(checker.metrics, ev_cls.task_names(cfg.eval), cfg.eval)
    return baseline, controller
