"""Policy: signals and detectors, per-step anomalies, attribution by replay, the controller
(stages, fallback, rollback, cooldown, quarantine), decisions, verdicts and events.

May import: lowprec.sites, lowprec.numerics, lowprec.base. Never tracking (no MLflow).
"""
