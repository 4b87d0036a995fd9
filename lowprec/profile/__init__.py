"""`lowprec profile`: what each site's precision costs in accuracy and saves in FLOPs, and the plan it implies.

* `lowprec.profile.measure`: one site at a time in each format on held batches (SQNR per
  operand, loss change, gradient cosine to BF16, FLOP share); sampling and ranks.
* `lowprec.profile.planner`: from a profile to `precision:` and `rollout:` sections.
* `lowprec.profile.report`: the ranked table, the picture, MLflow.
* `lowprec.profile.cli`: the command.

May import: lowprec.runtime, lowprec.config, lowprec.tracking, lowprec.state, lowprec.policy,
lowprec.sites, lowprec.numerics, lowprec.base.
"""
