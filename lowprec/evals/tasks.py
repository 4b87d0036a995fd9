"""The eval tasks, as lm-eval task YAML over JSONL written on first use into a cache folder.

Each task is a `TaskSpec` (name, kind, where its documents come from, how many the full set
keeps, whether its data is opt-in). `prepare_tasks(names, cache_dir, data_dir)` writes
`<cache>/<task>.jsonl` (one document a line, each with a stable string `id`) and
`<cache>/<task>.yaml` (absolute `data_files` path, as lm-eval resolves relative ones against
the working directory; `datasets` keeps its Arrow copies under `<cache>/hf_datasets`, not in
the user's home) when they are missing or stale. The cache is the folder the caller names, by
default `.cache/eval_suites` in the working folder. The default suite's tasks read texts that
ship with this package; the opt-in tasks read files from the data folder the user gives
(`data_dir`), and asking for one whose file is not there raises `DataUnavailable` naming
every missing file and how to get it (nothing is skipped). The files are
deterministic: the same sources give the same bytes. A YAML records the generator version and
the SHA-256 of its JSONL; a mismatch (an edited, truncated or older file) regenerates both.

Tasks (`TASKS`):
- `heldout_shakespeare`: the held-out plays, ~1,000-byte documents, loglikelihood_rolling,
  metrics word_perplexity, byte_perplexity, bits_per_byte;
- `shift_milton` (shipped), `shift_austen`, `shift_kjv`, `shift_mobydick` (opt-in): the same
  over shift corpora;
- `cloze_shakespeare`: last word of a held-out line from the ~100 bytes before it,
  loglikelihood, metrics acc (greedy match) and perplexity, like lm-eval's lambada;
- `bigbench_<name>` (8 BIG-bench JSON tasks) and `hellaswag` (opt-in): multiple_choice, acc,
  acc_norm, from `<data_dir>/eval/bigbench/<name>.json` and
  `<data_dir>/eval/hellaswag/hellaswag_val_part_a.jsonl`.

The perplexities aggregate with lowprec's saturating functions (`lowprec.evals.aggregations`:
inf where lm-eval's raise OverflowError), named in the YAML by lm-eval's `!function` tag; the
cache holds the module file the tag loads.

Every task's documents are shuffled with a fixed seed; the full set keeps the first 512
rolling documents (the held-out plays give 483), 1,000 cloze items and 1,000 multiple-choice
items (of up to 3,000), which bounds a full CI eval on a CPU.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Literal

import yaml

from lowprec.base.parse import ConfigError
from lowprec.base.yaml_read import load_yaml
from lowprec.evals import documents
from lowprec.evals.aggregations import SHIM_MODULE, SHIM_SOURCE
from lowprec.evals.corpora import DataUnavailable, held_out_sources, opt_in_error, shift_sources

GENERATOR = "eval_suites.tasks/3"
HF_CACHE = "hf_datasets"     # datasets' Arrow copies of the JSONL, kept next to them
BIGBENCH = ("goal_step_wikihow_goal_inference", "goal_step_wikihow_step_inference",
            "physical_intuition", "social_iqa", "strategyqa", "timedial", "understanding_fables",
            "winowhy")
FAST_ROLLING, FAST_SHIFT, FAST_CLOZE, FAST_MC = 16, 8, 128, 64
HELLASWAG_FILE = "hellaswag_val_part_a.jsonl"

Kind = Literal["rolling", "cloze", "multiple_choice"]


@dataclass(frozen=True)
class TaskSpec:
    """One eval task: `build(data_dir)` returns its documents in their final order (an opt-in
    task reads the user's data folder and may raise DataUnavailable); the full set keeps the
    first `max_docs` of them, the fast in-loop subset the first `fast_docs` (a seeded sample:
    the order is shuffled)."""
    name: str
    kind: Kind
    source: str
    build: Callable[[Path | None], list[dict]]
    max_docs: int | None = None
    fast_docs: int = 32
    opt_in: bool = False


def default_cache_dir() -> Path:
    """Where task files are written unless the caller names a folder: `.cache/eval_suites` in the working folder."""
    return Path.cwd() / ".cache" / "eval_suites"


@dataclass(frozen=True)
class PreparedTasks:
    """What `prepare_tasks` made ready under `cache_dir`: the tasks and their document counts."""
    cache_dir: Path
    ready: tuple[str, ...]
    n_docs: Mapping[str, int]


def _rolling(seed: str, sources: Callable[[Path | None], list[tuple[str, str]]], data_dir: Path | None) -> list[dict]:
    return documents.shuffled((d for name, text in sources(data_dir) for d in documents.rolling_documents(name, text)),
                              seed)


def _held_out(data_dir: Path | None = None) -> list[tuple[str, str]]:
    return held_out_sources()      # shipped with the package: no data folder needed


def _cloze(data_dir: Path | None = None) -> list[dict]:
    return documents.shuffled((d for name, text in held_out_sources() for d in documents.cloze_items(name, text)),
                              "cloze_shakespeare")


def _opt_in_file(data_dir: Path | None, rel: str, what: str, how: str) -> Path:
    path = Path(data_dir) / rel if data_dir is not None else None
    if path is None or not path.is_file():
        raise opt_in_error(what, path, how)
    return path


def _bigbench(name: str, data_dir: Path | None) -> list[dict]:
    path = _opt_in_file(data_dir, f"eval/bigbench/{name}.json", f"the BIG-bench task file of bigbench_{name}",
                        f"the task's JSON in the data folder as eval/bigbench/{name}.json (from the PyPI sdist bigbench==1.0.0, "
                        f"bigbench/benchmark_tasks/{name}/task.json)")
    return documents.shuffled(documents.bigbench_items(path), f"bigbench_{name}")


def _hellaswag(data_dir: Path | None) -> list[dict]:
    path = _opt_in_file(data_dir, f"eval/hellaswag/{HELLASWAG_FILE}", "the HellaSwag file of task hellaswag",
                        f"the first 3,000 lines of HellaSwag's public validation split (hellaswag_val.jsonl) in the "
                        f"data folder as eval/hellaswag/{HELLASWAG_FILE}")
    return documents.shuffled(documents.hellaswag_items(path), "hellaswag")


# full sets: the held-out plays whole (483 documents), 128 documents of each shift text (a
# seeded sample over the whole text): four shift texts at 512 each made the end-of-run eval of
# the main job about 2.5M tokens, three quarters of it shift text
FULL_SHIFT = 128


def _specs() -> dict[str, TaskSpec]:
    # fast subsets: a rolling document costs ~8 windows of 128 bytes, a cloze item one short one
    specs = [TaskSpec("heldout_shakespeare", "rolling", "held-out Shakespeare plays",
                      partial(_rolling, "heldout_shakespeare", _held_out), 512, FAST_ROLLING),
             TaskSpec("cloze_shakespeare", "cloze", "held-out Shakespeare plays, last word of a line",
                      _cloze, 1000, FAST_CLOZE)]
    for corpus in ("milton", "austen", "kjv", "mobydick"):
        specs.append(TaskSpec(f"shift_{corpus}", "rolling", f"{corpus} (distribution shift)",
                              partial(_rolling, f"shift_{corpus}", partial(shift_sources, corpus)),
                              FULL_SHIFT, FAST_SHIFT, opt_in=corpus != "milton"))
    for name in BIGBENCH:
        specs.append(TaskSpec(f"bigbench_{name}", "multiple_choice", f"BIG-bench {name}",
                              partial(_bigbench, name), 1000, FAST_MC, opt_in=True))
    specs.append(TaskSpec("hellaswag", "multiple_choice", "HellaSwag validation (first 3,000)", _hellaswag,
                          1000, FAST_MC, opt_in=True))
    return {s.name: s for s in specs}


TASKS: Mapping[str, TaskSpec] = MappingProxyType(_specs())


def unknown_name_error(kind: str, name: object, known: Iterable[str]) -> KeyError:
    """A KeyError naming what was asked for, what exists and the closest match."""
    known = sorted(known)
    close = difflib.get_close_matches(str(name), known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else "."
    return KeyError(f"unknown {kind} {name!r}{hint} The {kind}s are: {', '.join(known)}; use one of these names")


def get_task(name: str) -> TaskSpec:
    """The TaskSpec of a task name; a KeyError listing the tasks where it is unknown."""
    if name not in TASKS:
        raise unknown_name_error("task", name, TASKS)
    return TASKS[name]


def build_docs(name: str, data_dir: Path | None = None) -> list[dict]:
    """A task's full document set, in its fixed order (deterministic; an opt-in task whose file
    is not in `data_dir` raises DataUnavailable)."""
    spec = get_task(name)
    docs = spec.build(data_dir)
    return docs if spec.max_docs is None else docs[:spec.max_docs]


class Function(str):
    """An lm-eval `!function` tag in a task YAML: `module.name`, the module a file beside the YAML."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(Function, lambda d, v: d.represent_scalar("!function", str(v)))


def read_task_yaml(text: str):
    """A task YAML as this module writes it (its `!function` tags as `Function`)."""
    return load_yaml(text, "task YAML", tags={"!function": Function})


def _saturating(name: str) -> Function:
    """lowprec's aggregation `name` (lowprec.evals.aggregations: inf, not OverflowError, past a float's range)."""
    return Function(f"{SHIM_MODULE}.{name}")


def task_config(spec: TaskSpec, data_file: Path, sha256: str) -> dict:
    """The lm-eval task YAML (as a dict) of a task whose JSONL is at data_file."""
    cfg: dict = {"task": spec.name, "dataset_path": "json",
                 "dataset_kwargs": {"data_files": {"test": str(data_file.resolve())},
                                    "cache_dir": str(data_file.resolve().parent / HF_CACHE)},
                 "test_split": "test", "output_type": None}
    if spec.kind == "rolling":
        cfg.update(output_type="loglikelihood_rolling", doc_to_text="", doc_to_target="text",
                   metric_list=[{"metric": m, "aggregation": agg, "higher_is_better": False}
                                for m, agg in (("word_perplexity", _saturating("weighted_perplexity")),
                                               ("byte_perplexity", _saturating("weighted_perplexity")),
                                               ("bits_per_byte", "bits_per_byte"))])
    elif spec.kind == "cloze":
        cfg.update(output_type="loglikelihood", doc_to_text="context", doc_to_target="target",
                   metric_list=[{"metric": "perplexity", "aggregation": _saturating("perplexity"),
                                 "higher_is_better": False},
                                {"metric": "acc", "aggregation": "mean", "higher_is_better": True}])
    else:
        cfg.update(output_type="multiple_choice", doc_to_text="query", doc_to_target="gold",
                   doc_to_choice="choices",
                   metric_list=[{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                                {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}])
    cfg["metadata"] = {"version": 1.0, "generator": GENERATOR, "source": spec.source, "sha256": sha256,
                       "max_docs": spec.max_docs}
    return cfg


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)                    # mkstemp makes 0600; these are plain cache files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _current_count(yaml_path: Path, data_file: Path, spec: TaskSpec) -> int | None:
    """The document count of a task whose YAML and JSONL are there, from this generator and this
    task definition (its document cap), and agree with each other; None where they are not."""
    if not (yaml_path.is_file() and data_file.is_file()):
        return None
    try:
        cfg = read_task_yaml(yaml_path.read_text(encoding="utf-8"))
        meta = cfg["metadata"]
        recorded = cfg["dataset_kwargs"]["data_files"]["test"]
        hf_cache = cfg["dataset_kwargs"]["cache_dir"]
    except (ConfigError, KeyError, TypeError):   # not a file this module wrote: write it again
        return None
    data = data_file.read_bytes()
    if (meta.get("generator") != GENERATOR or meta.get("max_docs") != spec.max_docs or recorded != str(data_file.resolve())
            or hf_cache != str(data_file.resolve().parent / HF_CACHE)
            or meta.get("sha256") != hashlib.sha256(data).hexdigest()):
        return None
    return data.count(b"\n")


def write_task(name: str, cache_dir: Path | None = None, data_dir: Path | None = None) -> Path:
    """Write a task's JSONL and YAML into cache_dir (always); returns the YAML's path."""
    spec = get_task(name)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    docs = build_docs(name, data_dir)
    if not docs:
        raise ValueError(f"task {name} built no documents from {spec.source}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    data_file = cache_dir / f"{name}.jsonl"
    data = "".join(json.dumps(d, ensure_ascii=False, sort_keys=True) + "\n" for d in docs).encode("utf-8")
    _atomic_write(data_file, data)
    cfg = task_config(spec, data_file, hashlib.sha256(data).hexdigest())
    yaml_path = cache_dir / f"{name}.yaml"
    _atomic_write(yaml_path, yaml.dump(cfg, Dumper=_Dumper, sort_keys=False, allow_unicode=True).encode("utf-8"))
    return yaml_path


def _write_shim(cache_dir: Path) -> None:
    """The module file the tasks' `!function` aggregations load (lowprec.evals.aggregations), unless current."""
    shim = cache_dir / f"{SHIM_MODULE}.py"
    if not (shim.is_file() and shim.read_text(encoding="utf-8") == SHIM_SOURCE):
        cache_dir.mkdir(parents=True, exist_ok=True)
        _atomic_write(shim, SHIM_SOURCE.encode("utf-8"))


def prepare_tasks(names: Iterable[str], cache_dir: Path | None = None,
                  data_dir: Path | None = None) -> PreparedTasks:
    """Make sure each task's files are current in cache_dir (default `.cache/eval_suites` in the
    working folder), writing those that are not. An opt-in task whose data is not in `data_dir`
    raises DataUnavailable naming every such task, what it needs and how to get it; unknown
    names raise a KeyError listing the tasks."""
    names = list(names)
    for name in names:
        get_task(name)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    _write_shim(cache_dir)
    ready, missing, counts = [], {}, {}
    for name in names:
        yaml_path, data_file = cache_dir / f"{name}.yaml", cache_dir / f"{name}.jsonl"
        count = _current_count(yaml_path, data_file, get_task(name))
        if count is None:
            try:
                write_task(name, cache_dir, data_dir)
            except DataUnavailable as e:
                missing[name] = str(e)
                continue
            count = _current_count(yaml_path, data_file, get_task(name))
            if count is None:
                raise RuntimeError(f"task {name}: {yaml_path} does not match {data_file} right after writing "
                                   f"them; is another process writing {cache_dir} with a different version?")
        ready.append(name)
        counts[name] = count
    if missing:
        shipped = ", ".join(t for t, spec in TASKS.items() if not spec.opt_in)
        raise DataUnavailable(f"{len(missing)} of the tasks asked for need data that is not here: "
                              + "; ".join(f"{t}: {why}" for t, why in missing.items())
                              + f". The tasks whose data ships with lowprec are {shipped} (suites default and "
                                f"shakespeare); choose one of those, or give the data folder")
    return PreparedTasks(cache_dir, tuple(ready), MappingProxyType(counts))
