"""An eval of a badly diverged model: its perplexities are inf (lm-eval's aggregations raise
OverflowError there) and the in-loop gate fails it with that reason, instead of the eval crashing.

The model is the tiny GPT with its output head scaled x3000 (logits that blew up): each byte
it does not predict costs it thousands of nats, far past the 709.78 at which `math.exp` of a
mean negative log-likelihood overflows. A real lm-eval run (`run_suite`, 3 documents a task)
scores it and the same GPT before the blow-up; `GateFileChecker` (what `EvalCheckpoints`
calls) compares them, and so does `lowprec gate`'s reading of the two runs logged to a real
MLflow store (which keeps inf as the largest float).
"""

from __future__ import annotations

import copy
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from experiments.model import build_gpt  # noqa: E402
from lowprec.evals import ByteTokenizer, EvalSuite, run_suite  # noqa: E402
from lowprec.gates.inloop import GateFileChecker  # noqa: E402
from lowprec.policy.verdicts import Verdict  # noqa: E402
from lowprec.runtime.session.evals import EvalOutcome  # noqa: E402

MAX_LEN = 32
SUITE = EvalSuite("overflow", ("heldout_shakespeare", "cloze_shakespeare"), fast_limit=3)
OVERFLOW_NATS = math.log(1.7976931348623157e308)   # 709.78: math.exp overflows past it
GATES = """\
gates:
  - metric: eval/heldout_shakespeare/byte_perplexity
    direction: lower_is_better
    max_regression: {relative: 0.02}
  - metric: eval/cloze_shakespeare/perplexity
    direction: lower_is_better
    max_regression: {relative: 0.02}
"""


@pytest.fixture(scope="module")
def evals(tmp_path_factory):
    """(healthy results, diverged results, lm-eval's raw per-document log-likelihoods of the diverged)."""
    torch.manual_seed(1234)
    healthy = build_gpt(vocab_size=256, block_size=MAX_LEN, n_layer=1, n_head=2, d_model=16)
    diverged = copy.deepcopy(healthy)
    with torch.no_grad():
        diverged.lm_head.weight.mul_(3000.0)
    cache = tmp_path_factory.mktemp("overflow")
    run = [run_suite(SUITE, m, ByteTokenizer(), MAX_LEN, bootstrap_iters=10, cache_dir=cache)
           for m in (healthy, diverged)]
    return run[0], run[1]


def test_a_diverged_models_perplexities_are_inf_not_an_overflow_error(evals):
    from lm_eval.api.metrics import perplexity, weighted_perplexity
    healthy, diverged = evals
    held, cloze = diverged.results["heldout_shakespeare"], diverged.results["cloze_shakespeare"]
    # the model is that far gone: the mean negative log-likelihood per byte is past math.exp's range
    nats_per_byte = held["bits_per_byte"] * math.log(2)
    assert math.isfinite(nats_per_byte) and nats_per_byte > OVERFLOW_NATS, held
    lls = list(diverged.samples["cloze_shakespeare"]["loglikelihood"].values())
    assert -sum(lls) / len(lls) > OVERFLOW_NATS, lls
    with pytest.raises(OverflowError):   # what lm-eval's own aggregations do with these items
        perplexity(lls)
    with pytest.raises(OverflowError):
        weighted_perplexity([(-nats_per_byte * 1000, 1000)])
    assert held["byte_perplexity"] == math.inf and held["word_perplexity"] == math.inf
    assert cloze["perplexity"] == math.inf
    # the healthy model's numbers are finite and are lm-eval's exp(-mean log-likelihood)
    h_lls = list(healthy.samples["cloze_shakespeare"]["loglikelihood"].values())
    assert healthy.results["cloze_shakespeare"]["perplexity"] == perplexity(h_lls)
    assert math.isfinite(healthy.results["heldout_shakespeare"]["byte_perplexity"])


def test_the_gate_fails_the_diverged_candidate_with_its_reason(evals, tmp_path):
    healthy, diverged = evals
    path = tmp_path / "gates.yaml"
    path.write_text(GATES)
    checker = GateFileChecker(path)
    outcome = checker.check(EvalOutcome(healthy.results, healthy.samples),
                            EvalOutcome(diverged.results, diverged.samples))
    assert outcome.verdict is Verdict.REGRESS, outcome.reason
    assert "2 regress of 2 gates" in outcome.reason and "the candidate's value is inf" in outcome.reason, outcome.reason
    same = checker.check(EvalOutcome(healthy.results, healthy.samples), EvalOutcome(healthy.results, healthy.samples))
    assert same.verdict is not Verdict.REGRESS, same.reason


def test_lowprec_gate_reads_the_logged_inf_back_and_fails_the_candidate(evals, tmp_path, sqlite_store):
    from lowprec.gates.gate import check_all, summarize
    from lowprec.gates.runs import load_scores
    from lowprec.gates.spec import GateSpec
    from lowprec.tracking.tracker import Tracker
    uri = sqlite_store(tmp_path)
    ids = []
    for name, r in zip(("healthy", "diverged"), evals):
        tracker = Tracker(uri, "overflow", name, buffer_dir=tmp_path / name, system_metrics_s=None)
        tracker.log_eval(10, r.results, samples=r.samples)
        assert tracker.finish("FINISHED", timeout=120, report=False)["pending"] == 0
        ids.append(tracker.run_id)
    (tmp_path / "gates.yaml").write_text(GATES)
    spec = GateSpec.from_yaml(tmp_path / "gates.yaml")
    base, cand = (load_scores(uri, i, metrics=spec.metrics) for i in ids)
    assert cand.get("eval/heldout_shakespeare/byte_perplexity").value == math.inf
    summary = summarize(check_all(spec, base, cand))
    assert summary.verdict is Verdict.REGRESS and "the candidate's value is inf" in summary.reason, summary.reason
