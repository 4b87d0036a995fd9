"""lowprec inside the training loops people already use.

* `lowprec.integrations.hf`: a `transformers.TrainerCallback` (extra `lowprec[hf]`);
* `lowprec.integrations.lightning`: a Lightning `Callback` (extra `lowprec[lightning]`);
* `lowprec.integrations.torchtitan`: a torchtitan model converter and the Trainer that hosts the rollout (extra `lowprec[torchtitan]`).

The framework-neutral part (the config file, the session inside a loop that someone else
steps, eval checkpoints and tracking) is `lowprec.integrations.core`. Importing this package
imports no framework; importing a framework's module without its extra installed is an
ImportError that names the extra (`lowprec.integrations.extras`).

May import: lowprec.runtime, lowprec.config, lowprec.tracking, lowprec.state, lowprec.policy,
lowprec.sites, lowprec.numerics, lowprec.base.
"""
