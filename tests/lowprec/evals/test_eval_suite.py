"""run_suite against lm-eval itself: the numbers EvalResult reports are lm-eval's, and the
per-example scores add up to them; suites and names are checked; the training RNG is untouched."""

from __future__ import annotations

import math
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import lm_eval  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from lowprec.evals import (SUITES, ByteTokenizer, DataUnavailable, EvalSuite, LMAdapter, build_docs,  # noqa: E402
                           get_suite, run_suite, tasks)
from experiments.data import SHARED  # noqa: E402
from experiments.model import build_gpt  # noqa: E402

N = 12
MAX_LEN = 32
HAVE_BIGBENCH = (SHARED / "eval" / "bigbench" / "strategyqa.json").is_file()
PARITY_TASKS = ("cloze_shakespeare", "heldout_shakespeare") + (("bigbench_strategyqa",) if HAVE_BIGBENCH else ())


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(1234)
    return build_gpt(vocab_size=256, block_size=MAX_LEN, n_layer=1, n_head=2, d_model=16)


@pytest.fixture(scope="module")
def parity(gpt):
    """The same tasks, the same model: run_suite, and lm_eval.simple_evaluate called directly."""
    suite = EvalSuite("parity", PARITY_TASKS)
    states = (torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    ours = run_suite(suite, gpt, ByteTokenizer(), MAX_LEN, limit=N, bootstrap_iters=20, batch_size=16,
                     data_dir=SHARED if HAVE_BIGBENCH else None)
    after = (torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1])
    theirs = lm_eval.simple_evaluate(
        model=LMAdapter(gpt, ByteTokenizer(), MAX_LEN, batch_size=16), tasks=list(PARITY_TASKS),
        task_manager=TaskManager(include_path=str(tasks.default_cache_dir()), include_defaults=False),
        limit=N, bootstrap_iters=20, log_samples=True,
        random_seed=None, numpy_random_seed=None, torch_random_seed=None)   # leave other tests' RNG alone
    return ours, theirs, states, after


def test_results_are_lm_evals_numbers(parity, monkeypatch):
    """lm-eval's numbers; a perplexity's stderr (lm-eval bootstraps only its own aggregation, and
    the tasks aggregate with lowprec's saturating one) is lm-eval's bootstrap of its own
    `perplexity` over the logged items, the same draws."""
    from lm_eval.api.metrics import bootstrap_stderr, perplexity
    ours, theirs, _, _ = parity
    assert set(ours.results) == set(PARITY_TASKS) and ours.n == {t: N for t in PARITY_TASKS}
    monkeypatch.setenv("DISABLE_MULTIPROC", "1")
    for task in PARITY_TASKS:
        lm = {k.removesuffix(",none"): v for k, v in theirs["results"][task].items()
              if k.endswith(",none") and v != "N/A"}
        if "perplexity" in lm:
            assert "perplexity_stderr" not in lm   # lm-eval's "N/A" for a callable it does not know
            lm["perplexity_stderr"] = bootstrap_stderr(perplexity, [ex["perplexity"] for ex in theirs["samples"][task]],
                                                       20)
        assert ours.results[task] == lm, task
    assert {"acc", "acc_stderr", "perplexity", "perplexity_stderr"} <= set(ours.results["cloze_shakespeare"])
    assert {"bits_per_byte", "byte_perplexity", "word_perplexity"} <= set(ours.results["heldout_shakespeare"])
    assert ours.higher_is_better["heldout_shakespeare"]["bits_per_byte"] is False


def test_per_example_scores_add_up(parity):
    ours, theirs, _, _ = parity
    for task in PARITY_TASKS:
        for metric in ("acc", "acc_norm"):
            if metric in ours.results[task]:
                per = ours.samples[task][metric]
                assert set(per.values()) <= {0.0, 1.0} and len(per) == N
                assert sum(per.values()) / N == pytest.approx(ours.results[task][metric], abs=1e-12)
                ids = [str(ex["doc"]["id"]) for ex in theirs["samples"][task]]
                assert sorted(per) == sorted(ids)                   # keyed by the documents' ids
    cloze = ours.samples["cloze_shakespeare"]["loglikelihood"]
    assert math.exp(-sum(cloze.values()) / N) == pytest.approx(ours.results["cloze_shakespeare"]["perplexity"],
                                                               rel=1e-9)
    bpb = ours.samples["heldout_shakespeare"]["bits_per_byte"]
    n_bytes = {d["id"]: len(d["text"].encode()) for d in build_docs("heldout_shakespeare")[:N]}
    weighted = sum(bpb[k] * n_bytes[k] for k in bpb) / sum(n_bytes.values())
    assert weighted == pytest.approx(ours.results["heldout_shakespeare"]["bits_per_byte"], rel=1e-9)


def test_training_rng_is_untouched(parity):
    _, _, before, after = parity
    assert torch.equal(before[0], after[0]) and before[1] == after[1] and np.array_equal(before[2], after[2])


@pytest.mark.skipif(not HAVE_BIGBENCH, reason=f"{SHARED}/eval/bigbench is absent: the multiple-choice "
                                              f"tasks (opt-in data) cannot run here")
def test_multiple_choice_task_has_both_accuracies(parity):
    ours, _, _, _ = parity
    assert {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"} <= set(ours.results["bigbench_strategyqa"])


def test_fast_mode_uses_each_tasks_fast_size(gpt):
    suite = EvalSuite("tiny", ("heldout_shakespeare", "cloze_shakespeare"), fast_limit=3)
    assert suite.limits("fast") == {"heldout_shakespeare": 3, "cloze_shakespeare": 3}
    assert suite.limits("full") is None
    assert get_suite("default").limits("fast") == {t: tasks.get_task(t).fast_docs for t in get_suite("default").tasks}
    r = run_suite(suite, gpt, ByteTokenizer(), MAX_LEN, mode="fast", bootstrap_iters=0)
    assert r.n == {"heldout_shakespeare": 3, "cloze_shakespeare": 3} and r.mode == "fast"
    assert "acc_stderr" not in r.results["cloze_shakespeare"]         # bootstrap_iters=0: no stderrs
    assert r.seconds > 0


def test_limit_caps_each_tasks_documents_in_either_mode(gpt):
    """`limit` (eval.limit) caps each task's set, never raises it: in fast mode a task keeps the smaller
    of its fast size and the limit, in full mode each task scores the first `limit` documents."""
    suite = EvalSuite("tiny", ("heldout_shakespeare", "cloze_shakespeare"), fast_limit=3)
    r = run_suite(suite, gpt, ByteTokenizer(), MAX_LEN, mode="fast", limit=5, bootstrap_iters=0)
    assert r.n == {"heldout_shakespeare": 3, "cloze_shakespeare": 3}
    r = run_suite(suite, gpt, ByteTokenizer(), MAX_LEN, mode="fast", limit=2, bootstrap_iters=0)
    assert r.n == {"heldout_shakespeare": 2, "cloze_shakespeare": 2}
    r = run_suite(suite, gpt, ByteTokenizer(), MAX_LEN, mode="full", limit=4, bootstrap_iters=0)
    assert r.n == {"heldout_shakespeare": 4, "cloze_shakespeare": 4} and r.mode == "full"
    assert {len(v) for per in r.samples.values() for v in per.values()} == {4}   # per-example scores of 4 each


def test_named_suites():
    assert {"shakespeare", "shift", "default", "multiple_choice"} <= set(SUITES)
    assert set(get_suite("default").tasks) == set(get_suite("shakespeare").tasks) | {"shift_milton"}
    assert {"shift_austen", "shift_kjv", "shift_mobydick"} <= set(get_suite("shift").tasks)
    assert len(get_suite("multiple_choice").tasks) == 9


def test_unknown_names_raise(gpt):
    with pytest.raises(KeyError, match=r"unknown suite 'defualt'; did you mean 'default'\?.*multiple_choice"):
        get_suite("defualt")
    with pytest.raises(KeyError, match=r"unknown task 'cloze'.*cloze_shakespeare"):
        EvalSuite("mine", ("cloze",))
    with pytest.raises(KeyError, match="unknown suite"):
        run_suite("nope", gpt, ByteTokenizer(), MAX_LEN)
    with pytest.raises(ValueError, match="mode must be 'fast' or 'full'"):
        run_suite("default", gpt, ByteTokenizer(), MAX_LEN, mode="slow")
    with pytest.raises(ValueError, match="non-empty tuple"):
        EvalSuite("empty", ())


def test_opt_in_tasks_without_data_are_an_error_not_a_warning(gpt, tmp_path, recwarn):
    suite = EvalSuite("partly", ("heldout_shakespeare", "hellaswag"))
    with pytest.raises(DataUnavailable, match=r"1 of the tasks asked for need data that is not here: hellaswag: "
                                              r".*absent/eval/hellaswag/hellaswag_val_part_a.jsonl is not there"):
        run_suite(suite, gpt, ByteTokenizer(), MAX_LEN, limit=2, cache_dir=tmp_path / "cache",
                  data_dir=tmp_path / "absent")
    with pytest.raises(DataUnavailable, match="no eval data folder was given"):
        run_suite("multiple_choice", gpt, ByteTokenizer(), MAX_LEN, cache_dir=tmp_path / "cache")
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]


def test_an_evaluation_outside_a_git_repository_prints_no_git_error(gpt, tmp_path, monkeypatch, capfd):
    """lm-eval records the working directory's git commit; outside a repository git's "fatal: not
    a git repository" is not printed (once per evaluation, it was). torch's `collect_env` (about ten
    subprocesses per evaluation) is not run, the bootstrap stderr runs without a process pool, and
    lm-eval's functions and the environment are put back after."""
    import lm_eval.evaluator as ev
    import torch.utils.collect_env as collect_env
    before = ev.get_git_commit_hash, ev.add_env_info
    collected, pooled = [], []
    monkeypatch.setattr(collect_env, "get_pretty_env_info", lambda: collected.append(1) or "")
    monkeypatch.setattr("multiprocessing.Pool", lambda *a, **k: pooled.append(1))
    monkeypatch.delenv("DISABLE_MULTIPROC", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))   # no repository above it either
    suite = EvalSuite("tiny", ("cloze_shakespeare",), fast_limit=4)   # its perplexity's stderr is bootstrapped
    capfd.readouterr()
    r = run_suite(suite, gpt, ByteTokenizer(), MAX_LEN, mode="fast", bootstrap_iters=10, cache_dir=tmp_path / "cache")
    err = capfd.readouterr().err
    assert "not a git repository" not in err, err
    assert r.results["cloze_shakespeare"]["perplexity_stderr"] > 0
    assert collected == [] and pooled == []
    assert (ev.get_git_commit_hash, ev.add_env_info) == before and "DISABLE_MULTIPROC" not in os.environ


def test_a_torchrun_rank_other_than_local_rank_0_runs_the_same_forwards_and_gets_none(gpt, monkeypatch):
    # lm-eval builds results only where LOCAL_RANK is 0; a sharded model needs every rank's forwards alike
    suite = EvalSuite("tiny", ("heldout_shakespeare", "cloze_shakespeare"), fast_limit=3)
    shapes = {}

    def counted(rank):
        seen = shapes.setdefault(rank, [])

        def forward(x):
            seen.append(tuple(x.shape))
            return gpt(x)
        return forward

    monkeypatch.setenv("LOCAL_RANK", "0")
    r = run_suite(suite, counted(0), ByteTokenizer(), MAX_LEN, mode="fast", bootstrap_iters=0, model=gpt)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert run_suite(suite, counted(1), ByteTokenizer(), MAX_LEN, mode="fast", bootstrap_iters=0, model=gpt) is None
    assert r.n == {"heldout_shakespeare": 3, "cloze_shakespeare": 3}
    assert shapes[0] and shapes[1] == shapes[0]


def test_sigterm_during_an_evaluation_reaches_the_runs_handler(gpt):
    """`lowprec run`'s StopRequest stays the SIGTERM handler while lm-eval runs: a scheduler's
    SIGTERM during an eval checkpoint is a stop request (a checkpoint at the next step), not the
    instant kill the default handler lowprec swapped in made it (lm-eval's bootstrap pool, which
    the swap was for, is not forked: DISABLE_MULTIPROC)."""
    import signal

    from lowprec.runtime.trainer.stop_request import StopRequest
    suite = EvalSuite("tiny", ("heldout_shakespeare",), fast_limit=2)
    sent = []

    def forward(x):
        if not sent:
            sent.append(signal.raise_signal(signal.SIGTERM))
        return gpt(x)

    with StopRequest() as stop:
        r = run_suite(suite, forward, ByteTokenizer(), MAX_LEN, mode="fast", bootstrap_iters=0, model=gpt)
    assert sent and stop.requested == signal.SIGTERM and r.n == {"heldout_shakespeare": 2}
