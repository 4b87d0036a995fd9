"""Named eval suites and `run_suite`: lm-eval over local tasks, through the LM adapter.

An `EvalSuite` is a named set of tasks (see lowprec.evals.tasks) with a fast in-loop subset
and a full set (every document a task keeps). The fast subset is the first N documents of
each task, a seeded sample of the whole task: N is the suite's `fast_limit` where it sets
one, else the task's own `fast_docs` (16 held-out and 8 shift documents of ~1,000 bytes, 128
cloze items, 64 multiple-choice items), which is what keeps the in-loop eval to seconds.
The per-task counts reach lm-eval as `simple_evaluate(samples={task: [0, ..., N-1]})`.
`run_suite` writes the tasks' files if needed, runs `lm_eval.simple_evaluate` on an
`LMAdapter` around the model's logits function, and returns an `EvalResult`:

- `results`: {task: {metric: value, metric_stderr: se}}, exactly lm-eval's
  `res["results"][task]["acc,none"]` etc. with `,none` removed (stderrs lm-eval reports as
  "N/A", e.g. for bits_per_byte, are left out). This is the shape `Tracker.log_eval` takes.
- `samples`: {task: {metric: {example id: score}}}, per example, keyed by the document's
  stable `id`, so two runs can be compared example by example. Multiple choice: `acc`,
  `acc_norm` (0/1). Cloze: `acc` (0/1) and `loglikelihood` (of the target word). Rolling tasks:
  `bits_per_byte` of each document, -loglikelihood / (bytes * ln 2). lm-eval's corpus-level
  bits_per_byte is a byte-weighted mean (total loglikelihood over total bytes), so the plain
  mean of the per-document scores differs from it slightly; the acc means agree exactly.
- `n`: documents scored per task; `seconds`: wall time; `higher_is_better`: lm-eval's
  {task: {metric: bool}}.

Suites (`SUITES`, defined in the shipped suites.yaml, the repository's eval_suites/): `default` (held-out Shakespeare, cloze, Milton: every text ships with this
package) and `shakespeare` need no data folder; `shift` (Milton and the opt-in Austen, King
James Bible and Moby Dick corpora) and `multiple_choice` (BIG-bench, HellaSwag) read the data
folder the caller gives (`data_dir`, `eval.data_dir` in a config), and raise DataUnavailable
when a file is not there.

lm-eval's global seeding is turned off (`random_seed=None` etc.), and the state of Python's
`random` (which lm-eval 0.4.13 draws from while loading tasks: `random_task_id()` is evaluated
eagerly as a getattr default), NumPy's and torch's CPU generator is restored afterwards: an
in-loop eval never moves the training job's random streams.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
from collections.abc import Callable, Iterator
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from lowprec.base.parse import ConfigError, found, parse
from lowprec.base.yaml_read import load_yaml
from lowprec.evals.aggregations import bootstrap_perplexities
from lowprec.evals.tasks import get_task, prepare_tasks, unknown_name_error
from lowprec.evals.tokenizers import Tokenizer

Mode = Literal["fast", "full"]
DEFAULT_BOOTSTRAP_ITERS = {"fast": 100, "full": 1000}


@dataclass(frozen=True)
class EvalSuite:
    """A named set of tasks. In the in-loop ("fast") mode each task scores its first
    `fast_limit` documents, or its own `fast_docs` where fast_limit is None."""
    name: str
    tasks: tuple[str, ...]
    fast_limit: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.tasks, str) or not self.tasks:
            raise ValueError(f"suite {self.name!r}: tasks must be a non-empty tuple of task names, got {self.tasks!r}")
        object.__setattr__(self, "tasks", tuple(self.tasks))
        for task in self.tasks:
            get_task(task)
        if len(set(self.tasks)) != len(self.tasks):
            raise ValueError(f"suite {self.name!r} names a task twice: {list(self.tasks)}")
        if self.fast_limit is not None and (not isinstance(self.fast_limit, int) or self.fast_limit < 1):
            raise ValueError(f"suite {self.name!r}: fast_limit must be a positive int or None (each task's "
                             f"fast_docs), got {self.fast_limit!r}")

    def limits(self, mode: Mode) -> dict[str, int] | None:
        """Documents per task for a mode ({task: N} for "fast"), or None (all) for "full"."""
        if mode not in ("fast", "full"):
            raise ValueError(f"mode must be 'fast' or 'full', got {mode!r}")
        if mode == "full":
            return None
        return {t: self.fast_limit or get_task(t).fast_docs for t in self.tasks}


SUITE_FILES = "lowprec.evals.suite_files"   # the repository's eval_suites/, installed under lowprec


@dataclass(frozen=True)
class SuiteEntry:
    """One suite as a suites file writes it, under its name: `tasks` and an optional `fast_limit`."""
    tasks: tuple[str, ...]
    fast_limit: int | None = None


def load_suites(text: str, source: str = "suites.yaml") -> Mapping[str, EvalSuite]:
    """The suites a suites.yaml text defines ({name: {tasks: [...], fast_limit: N}}), checked by
    the one parser (`lowprec.base.parse`: keys with a did-you-mean, types) and by `EvalSuite`
    (every task known, no task twice). Read by lowprec's one YAML reader (bounded, duplicate keys
    refused); every problem is a ConfigError naming `source` and the suite's key path."""
    raw = load_yaml(text, source) or {}
    if not isinstance(raw, dict):
        raise ConfigError("", f"expected a mapping of suite names to suites, found {found(raw)}", source=source)
    suites = {}
    for name, body in raw.items():
        name = str(name)
        try:
            entry = parse(SuiteEntry, body, name)
            suites[name] = EvalSuite(name, entry.tasks, entry.fast_limit)
        except ConfigError as e:
            raise ConfigError(e.path, e.message, source=source) from None
        except (ValueError, TypeError) as e:
            raise ConfigError(name, str(e), source=source) from None
        except KeyError as e:   # an unknown task: the KeyError's message lists the tasks
            raise ConfigError(f"{name}.tasks", str(e.args[0] if e.args else e), source=source) from None
    return MappingProxyType(suites)


def _shipped_suites() -> Mapping[str, EvalSuite]:
    from importlib.resources import files

    ref = files(SUITE_FILES).joinpath("suites.yaml")
    return load_suites(ref.read_text(encoding="utf-8"), str(ref))


SUITES: Mapping[str, EvalSuite] = _shipped_suites()


def get_suite(suite: EvalSuite | str) -> EvalSuite:
    """A suite by name (or the suite itself); a KeyError listing the suites where it is unknown."""
    if isinstance(suite, EvalSuite):
        return suite
    if suite not in SUITES:
        raise unknown_name_error("suite", suite, SUITES)
    return SUITES[suite]


@dataclass(frozen=True)
class EvalResult:
    """What one suite run measured; see the module docstring for each field's meaning."""
    suite: str
    mode: str
    results: dict[str, dict[str, float]]
    samples: dict[str, dict[str, dict[str, float]]]
    n: dict[str, int]
    seconds: float
    higher_is_better: dict[str, dict[str, bool]] = field(default_factory=dict)


def results_of(res: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} from lm-eval's `res["results"]`, `,none` removed, "N/A" left out."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in res["results"].items():
        row = {}
        for key, value in metrics.items():
            metric, sep, filt = key.partition(",")
            if sep and filt == "none" and isinstance(value, (int, float)) and not isinstance(value, bool):
                row[metric] = float(value)
        out[task] = row
    return out


def _per_example(metric: str, value: Any) -> tuple[str, float] | None:
    if metric == "bits_per_byte":
        ll, n_bytes = value
        return "bits_per_byte", -float(ll) / (float(n_bytes) * math.log(2))
    if metric == "perplexity":          # lm-eval keeps the target's loglikelihood per example
        return "loglikelihood", float(value)
    if metric in ("word_perplexity", "byte_perplexity"):
        return None                      # (loglikelihood, count) pairs: bits_per_byte says it
    if isinstance(value, (int, float)):
        return metric, float(value)
    return None


def samples_of(res: Mapping[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """{task: {metric: {doc id: score}}} from lm-eval's `res["samples"]` (log_samples=True)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for task, examples in res["samples"].items():
        per: dict[str, dict[str, float]] = {}
        for ex in examples:
            key = str(ex["doc"].get("id", ex["doc_id"]))
            for metric in ex["metrics"]:
                item = _per_example(metric, ex[metric])
                if item is not None:
                    scores = per.setdefault(item[0], {})
                    if key in scores:
                        raise ValueError(f"task {task}: two examples share the id {key!r}")
                    scores[key] = item[1]
        out[task] = per
    return out


@contextlib.contextmanager
def _random_streams_kept() -> Iterator[None]:
    """Restore Python's, NumPy's and torch's CPU random state on exit."""
    import numpy as np
    import torch

    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])


@contextlib.contextmanager
def _lean_bookkeeping() -> Iterator[None]:
    """lm-eval's bookkeeping around an evaluation, without its cost or its noise, for the call:

    - the git commit of the working directory: lm-eval runs `git describe --always` with git's
      stderr not redirected (outside a repository every evaluation printed "fatal: not a git
      repository"); here git is asked with stderr discarded (the same hash where there is one);
    - the environment report (`add_env_info`): lm-eval runs torch's `collect_env`, about ten
      subprocesses (pip, conda, lscpu, nvidia-smi...) on every evaluation, ~0.4 s of CPU and a
      second of wall time each, for a text lowprec never reads; here only the versions are kept;
    - the bootstrap stderr: lm-eval forks a pool of `cpu_count()` processes for it unless its
      documented `DISABLE_MULTIPROC` is set; set here, it draws the same resamples in this process
      (the same seeded chunks, so the same stderr) without forking one process per core.

    Everything is put back after (the environment variable as it was)."""
    import subprocess

    import lm_eval.evaluator as ev
    originals = ev.get_git_commit_hash, ev.add_env_info
    multiproc = os.environ.get("DISABLE_MULTIPROC")

    def quiet() -> str | None:
        try:
            out = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=False)
        except OSError:
            return None
        return (out.stdout.strip() or None) if out.returncode == 0 else None

    def versions(storage: dict) -> None:
        from importlib.metadata import PackageNotFoundError, version
        for key, package in (("lm_eval_version", "lm_eval"), ("transformers_version", "transformers")):
            try:
                storage[key] = version(package)
            except PackageNotFoundError:
                storage[key] = "N/A"

    ev.get_git_commit_hash, ev.add_env_info = quiet, versions
    os.environ["DISABLE_MULTIPROC"] = "1"
    try:
        yield
    finally:
        ev.get_git_commit_hash, ev.add_env_info = originals
        if multiproc is None:
            os.environ.pop("DISABLE_MULTIPROC", None)
        else:
            os.environ["DISABLE_MULTIPROC"] = multiproc


_OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
# the module constants huggingface_hub and datasets read their environment variables into when imported
_OFFLINE_CONSTANTS = (("huggingface_hub.constants", "HF_HUB_OFFLINE"), ("datasets.config", "HF_HUB_OFFLINE"),
                      ("datasets.config", "HF_DATASETS_OFFLINE"))


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """For the call (a decorator of `run_suite`): the Hugging Face Hub and datasets offline
    (every file an eval reads is local; lm-eval would otherwise ask the Hub about them), unless
    the user set either switch (`HF_HUB_OFFLINE`,
    https://huggingface.co/docs/huggingface_hub/package_reference/environment_variables), which
    is then left alone. Both libraries read the variable into a module constant when first
    imported, so those are switched too. On exit the environment is exactly as it was (what
    lm-eval and scikit-learn set when first imported inside, `HF_XET_HIGH_PERFORMANCE` and
    `KMP_DUPLICATE_LIB_OK`, included) and so are the constants (one of a module first imported
    inside: as the unset variable gives, False)."""
    import sys
    environ = dict(os.environ)
    switch = not any(k in os.environ for k in _OFFLINE_ENV)
    before = {(m, a): getattr(sys.modules[m], a) for m, a in _OFFLINE_CONSTANTS if m in sys.modules}
    if switch:
        os.environ.update({k: "1" for k in _OFFLINE_ENV})
        for m, a in before:
            setattr(sys.modules[m], a, True)
    try:
        yield
    finally:
        for k in [k for k in os.environ if k not in environ]:
            del os.environ[k]
        os.environ.update(environ)
        for m, a in _OFFLINE_CONSTANTS if switch else ():
            if m in sys.modules:
                setattr(sys.modules[m], a, before.get((m, a), False))


@hub_offline()
def run_suite(suite: EvalSuite | str, forward: Callable[[Any], Any], tokenizer: Tokenizer, max_length: int,
              mode: Mode = "fast", batch_size: int = 32, device: Any = "cpu", *, model: Any = None,
              limit: int | None = None,
              bootstrap_iters: int | None = None, rolling_context_len: int = 1,
              cache_dir: str | Path | None = None, data_dir: str | Path | None = None) -> EvalResult | None:
    """Run a suite's tasks with lm-eval on the model `forward` (LongTensor[B,T] -> logits [B,T,V]).

    `mode` picks the fast subset (see `EvalSuite.limits`) or the full set; `limit` caps the
    documents per task of either (lm-eval's `limit`: the first N of the mode's set). `bootstrap_iters` (lm-eval's, for the stderr of perplexity; 0 turns
    every stderr off) defaults to 100 in fast mode and 1000 in full. `model` is the nn.Module to
    put in eval mode when `forward` is not the module itself. `cache_dir` holds the tasks' files
    (default `.cache/eval_suites` in the working folder); `data_dir` is the folder of the opt-in
    tasks' data: an opt-in task whose file is not there raises DataUnavailable, naming it and how
    to get it, before anything is evaluated. Under torchrun every process runs every request (the
    adapter is one lm-eval rank, so a sharded model's collective forwards match on every rank)
    and lm-eval builds results only where LOCAL_RANK is 0: elsewhere this returns None."""
    suite = get_suite(suite)
    t0 = time.perf_counter()
    suite.limits(mode)                                   # checks mode
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int (documents per task) or None, got {limit!r}")
    if bootstrap_iters is None:
        bootstrap_iters = DEFAULT_BOOTSTRAP_ITERS[mode]
    prepared = prepare_tasks(suite.tasks, cache_dir, data_dir)
    import lm_eval
    from lm_eval.tasks import TaskManager

    from lowprec.evals.adapter import LMAdapter

    adapter = LMAdapter(forward, tokenizer, max_length, batch_size=batch_size, device=device, model=model,
                        rolling_context_len=rolling_context_len)
    wanted = suite.limits(mode)
    if limit is not None:
        wanted = {t: limit if wanted is None else min(limit, wanted[t]) for t in suite.tasks}
    samples = None if wanted is None else {
        t: list(range(min(wanted[t], prepared.n_docs[t]))) for t in prepared.ready}
    with _random_streams_kept(), _lean_bookkeeping():
        res = lm_eval.simple_evaluate(
            model=adapter, tasks=list(prepared.ready),
            task_manager=TaskManager(include_path=str(prepared.cache_dir), include_defaults=False),
            samples=samples, bootstrap_iters=bootstrap_iters, log_samples=True,
            random_seed=None, numpy_random_seed=None, torch_random_seed=None)
        if res is not None:   # lm-eval bootstraps only its own perplexity's stderr: the same draws over ours
            bootstrap_perplexities(res, bootstrap_iters)
    if res is None:   # lm-eval builds results where LOCAL_RANK is 0 only (every rank ran the same forwards)
        return None
    return EvalResult(
        suite=suite.name, mode=mode, results=results_of(res), samples=samples_of(res),
        n={task: len(res["samples"][task]) for task in prepared.ready},
        seconds=time.perf_counter() - t0,
        higher_is_better={t: dict(v) for t, v in res.get("higher_is_better", {}).items()})
