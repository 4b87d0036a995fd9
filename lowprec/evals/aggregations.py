"""Perplexity aggregations for lowprec's eval tasks that saturate to inf instead of raising.

lm-eval's `perplexity` and `weighted_perplexity` aggregations (lm_eval/api/metrics.py) return
`math.exp` of a mean negative log-likelihood; past about 709.78 nats (per item, per word or
per byte) `math.exp` raises `OverflowError: math range error`, and the whole evaluation fails
with it. A badly diverged candidate gets there (a model whose logits blew up scores each byte
at thousands of nats), so an eval meant to fail that candidate crashed the run instead.
These are the same expressions over lm-eval's own `mean` / `weighted_mean` (the same value
wherever lm-eval's is finite) and `inf` past the range of a float. A gate reads an infinite
candidate value as a regression beyond any tolerance (`lowprec.gates.gate`), so the candidate
fails with that reason and the run goes on.

A task's YAML names them through lm-eval's `!function` tag (its documented way to give a
callable aggregation), which loads `<module>.py` from the YAML's own folder: the task cache
holds `SHIM_MODULE` (`lowprec.evals.tasks` writes it, one import of this module), so the
YAML works the same under `lm_eval --include_path`.

lm-eval bootstraps a perplexity's stderr only for its own function (`stderr_for_metric`
checks identity); `perplexity_stderr` draws the same bootstrap (lm-eval's `bootstrap_stderr`,
its seeded resamples) over this one, so a task keeps the stderr it had.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["perplexity", "weighted_perplexity", "perplexity_stderr", "bootstrap_perplexities", "SHIM_MODULE",
           "SHIM_SOURCE"]

SHIM_MODULE = "lowprec_aggregations"
SHIM_SOURCE = ('"""lm-eval loads this file for the `!function` aggregations of the task YAML beside it."""\n'
               "from lowprec.evals.aggregations import perplexity, weighted_perplexity  # noqa: F401\n")


def _exp(x: float) -> float:
    """math.exp(x), inf where it overflows (NaN stays NaN)."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def perplexity(items: Sequence[float]) -> float:
    """exp(-mean log-likelihood) of per-item log-likelihoods; inf past a float's range."""
    from lm_eval.api.metrics import mean
    return _exp(-mean(items))


def weighted_perplexity(items: Sequence[tuple[float, float]]) -> float:
    """exp(-sum log-likelihood / sum weight) of (log-likelihood, words or bytes) pairs; inf past a float's range."""
    from lm_eval.api.metrics import weighted_mean
    return _exp(-weighted_mean(items))


def perplexity_stderr(items: Sequence[float], iters: int) -> float:
    """The bootstrap standard error of `perplexity` over `items`, as lm-eval draws it for its own
    perplexity (`iters` resamples; in this process when `DISABLE_MULTIPROC` is set)."""
    from lm_eval.api.metrics import bootstrap_stderr
    return bootstrap_stderr(perplexity, list(items), iters)


def bootstrap_perplexities(res: dict, iters: int) -> None:
    """Fill in lm-eval's results `res` (in place) the `perplexity_stderr` that lm-eval left "N/A"
    for a task whose per-item `perplexity` (log-likelihoods) it logged (`log_samples=True`)."""
    for task, metrics in res["results"].items():
        if metrics.get("perplexity_stderr,none") != "N/A" or "perplexity,none" not in metrics:
            continue
        items = [float(ex["perplexity"]) for ex in res["samples"].get(task, ()) if "perplexity" in ex]
        if iters > 0 and len(items) > 1:
            metrics["perplexity_stderr,none"] = perplexity_stderr(items, iters)
