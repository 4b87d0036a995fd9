"""State that must survive a crash: checkpoints, atomic writes (`durable`), integrity
manifests, RNG states, ranks.

May import: lowprec.policy, lowprec.sites, lowprec.numerics, lowprec.base. Never tracking
(no MLflow).
"""
