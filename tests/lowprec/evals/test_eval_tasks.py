"""Task data: generated deterministically, held out from training, regenerated when stale; the
default suite's texts ship with the package, the opt-in tasks' absent data is an error naming
what and how to get it; the packages read no folder beside themselves; corpora reachable from
experiments.data with the folders it hands over."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lowprec.evals import SUITES, corpora, documents, tasks
from lowprec.evals.corpora import DataUnavailable
from experiments.data import SHARED

ROOT = Path(__file__).resolve().parents[3]

ROLLING_AND_CLOZE = ("heldout_shakespeare", "cloze_shakespeare")


@pytest.fixture(scope="module")
def train_text() -> str:
    from experiments.data import split_texts
    train, _ = split_texts()
    return "\n".join(corpora.clean_text(f.read_bytes()) for f in train)


def test_generation_is_deterministic(tmp_path):
    for name in ("heldout_shakespeare", "cloze_shakespeare", "shift_milton"):
        a, b = tmp_path / "a", tmp_path / "b"
        tasks.write_task(name, a)
        tasks.write_task(name, b)
        assert (a / f"{name}.jsonl").read_bytes() == (b / f"{name}.jsonl").read_bytes()
        docs = [json.loads(line) for line in (a / f"{name}.jsonl").read_text().splitlines()]
        assert docs == tasks.build_docs(name)
        assert len({d["id"] for d in docs}) == len(docs)
        cfg = tasks.read_task_yaml((a / f"{name}.yaml").read_text())   # its aggregations: !function tags
        data_file = cfg["dataset_kwargs"]["data_files"]["test"]
        assert data_file == str((a / f"{name}.jsonl").resolve())      # absolute, as lm-eval needs


def test_documents_are_held_out(train_text):
    train_lines = {line.strip() for line in train_text.split("\n")}
    held = {n for n, _ in corpora.held_out_sources()}
    for name in ROLLING_AND_CLOZE:
        docs = tasks.build_docs(name)
        assert {d["id"].split(":")[0] for d in docs} == held      # every held-out play, nothing else
        for d in docs:
            text = d.get("text") or d["context"] + d["target"]
            for line in text.split("\n"):
                assert len(line.strip()) < 30 or line.strip() not in train_lines, (d["id"], line)
        for d in docs[:24]:                                        # a passage across lines, verbatim
            text = d.get("text") or d["context"] + d["target"]
            mid = len(text) // 2
            assert text[mid - 40:mid + 40] not in train_text, d["id"]


def test_rolling_documents_shape():
    docs = tasks.build_docs("heldout_shakespeare")
    sizes = [len(d["text"].encode()) for d in docs]
    assert 200 <= min(sizes) and max(sizes) <= 1000 and sum(sizes) / len(sizes) > 900
    assert all(not d["text"].startswith("\n") and not d["text"].endswith("\n") for d in docs)
    first = {d["id"].split(":")[0] for d in docs[:tasks.FAST_ROLLING]}
    assert len(first) >= 3                                          # the fast subset spans the plays


def test_cloze_items_shape():
    for d in tasks.build_docs("cloze_shakespeare")[:200]:
        assert d["target"].startswith(" ") and d["target"][1:].isalpha() and len(d["target"]) >= 4
        assert 60 <= len(d["context"]) <= 100 and not d["context"].endswith(" ")
    items = documents.cloze_items("t", "one two three four five six seven eight nine ten eleven twelve thirteen\n"
                                       "fourteen fifteen sixteen seventeen eighteen nineteen twenty forty!\n")
    assert [i["target"] for i in items] == [" thirteen"]                # the second would share text


def test_gutenberg_header_is_stripped():
    raw = ("\ufeffThe Project Gutenberg EBook\r\n\r\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\r\n"
           "Call me Ishmael.\r\n*** END OF THIS PROJECT GUTENBERG EBOOK X ***\r\nlicence\r\n").encode()
    assert corpora.clean_text(raw) == "Call me Ishmael.\n"


def test_stale_files_are_regenerated(tmp_path):
    p = tasks.prepare_tasks(["heldout_shakespeare"], tmp_path)
    data = tmp_path / "heldout_shakespeare.jsonl"
    good = data.read_bytes()
    data.write_bytes(good[: len(good) // 2])                        # truncated
    p2 = tasks.prepare_tasks(["heldout_shakespeare"], tmp_path)
    assert data.read_bytes() == good and p2.n_docs == p.n_docs == {"heldout_shakespeare": good.count(b"\n")}


def test_the_default_suites_texts_ship_with_the_package():
    from importlib import resources
    shipped = {c: sorted(f.name for f in (resources.files(corpora.TEXTS) / c).iterdir() if f.name.endswith("_gut.txt"))
               for c in ("shakespeare", "milton")}
    assert not any(tasks.get_task(t).opt_in for t in SUITES["default"].tasks)
    assert set(SUITES["default"].tasks) == {"heldout_shakespeare", "cloze_shakespeare", "shift_milton"}
    assert [n for n, _ in corpora.held_out_sources()] == sorted(f.removesuffix("_gut.txt") for f in corpora.HELD_OUT)
    assert shipped["shakespeare"] == sorted(corpora.HELD_OUT)
    assert len(corpora.shift_sources("milton")) == len(shipped["milton"]) == 7


@pytest.mark.parametrize("data_dir", [None, "absent"])
def test_opt_in_data_absent_is_an_error_naming_what_and_how(tmp_path, data_dir):
    data_dir = tmp_path / data_dir if data_dir else None
    names = ["heldout_shakespeare", "bigbench_strategyqa", "hellaswag", "shift_austen", "shift_kjv", "shift_mobydick"]
    with pytest.raises(DataUnavailable) as e:
        tasks.prepare_tasks(names, tmp_path / "cache", data_dir)
    msg = str(e.value)
    assert msg.startswith("5 of the tasks asked for need data that is not here")
    for name, file in [("bigbench_strategyqa", "eval/bigbench/strategyqa.json"),
                       ("hellaswag", "eval/hellaswag/hellaswag_val_part_a.jsonl"),
                       ("shift_austen", "corpora/austen.txt"), ("shift_kjv", "corpora/kjv.txt"),
                       ("shift_mobydick", "corpora/mobydick.txt")]:
        assert f"{name}: " in msg and file in msg
        assert (str(data_dir / file) + " is not there" if data_dir else "no eval data folder was given") in msg
    assert "docs/config.md" in msg and "heldout_shakespeare, cloze_shakespeare, shift_milton" in msg
    assert not (tmp_path / "cache" / "shift_austen.jsonl").exists()
    with pytest.raises(DataUnavailable, match="corpora/austen.txt"):
        corpora.shift_sources("austen")


@pytest.mark.skipif(not (SHARED / "corpora" / "austen.txt").is_file(), reason=f"{SHARED} is absent here")
def test_opt_in_data_from_a_given_folder(tmp_path):
    p = tasks.prepare_tasks(["shift_austen"], tmp_path, SHARED)
    assert p.ready == ("shift_austen",) and p.n_docs["shift_austen"] == tasks.FULL_SHIFT


def test_packages_read_no_folder_beside_them():
    """No module of the installed packages finds data relative to its own file or beside the
    repository: what they read is the package's own resources, the working folder or a path given."""
    banned = re.compile(r"parents\[|\.\./shared|/ \"shared\"|Path\(__file__\)|\.cache\b.*__file__")
    found = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}"
             for pkg in ("lowprec", "gates", "eval_suites") for f in sorted((ROOT / pkg).rglob("*.py"))
             for i, line in enumerate(f.read_text().splitlines(), 1) if banned.search(line)]
    assert not found, found


@pytest.mark.skipif(not (SHARED / "eval" / "bigbench").is_dir(),
                    reason=f"{SHARED}/eval/bigbench is absent: the BIG-bench tasks cannot be built here")
def test_multiple_choice_items():
    for name in tasks.BIGBENCH:
        docs = tasks.build_docs(f"bigbench_{name}", SHARED)
        assert docs and all(0 <= d["gold"] < len(d["choices"]) for d in docs)
    assert len(tasks.build_docs("bigbench_strategyqa", SHARED)) == 1000       # the full set's cap
    d = documents.bigbench_items(SHARED / "eval" / "bigbench" / "strategyqa.json")[0]
    assert d["id"] == "strategyqa:00000" and d["choices"] == ["Yes", "No"]
    assert d["query"].startswith("Q: ") and d["query"].endswith("\nA:")


def test_unknown_task_names_raise():
    with pytest.raises(KeyError, match=r"did you mean 'heldout_shakespeare'.*shift_kjv"):
        tasks.get_task("heldout_shakespear")
    with pytest.raises(KeyError, match="unknown task 'nope'"):
        tasks.prepare_tasks(["heldout_shakespeare", "nope"])
    with pytest.raises(ValueError, match="shift_sources"):
        corpora.corpus_dir("austen")


def test_experiments_data_hands_its_folders_to_the_corpora():
    from experiments import data
    assert data.HELD_OUT == corpora.HELD_OUT
    assert data.split_texts() == corpora.split_texts(data.CACHE, data.SHARED)
    assert data.corpus_dir() == corpora.corpus_dir("shakespeare", data.CACHE, data.SHARED)


def test_imports_flow_one_way():
    """lowprec.evals never imports experiments or lowprec.gates, and importing it pulls in no lm-eval
    and not the runtime (which it reaches only when its evaluator runs)."""
    code = ("import sys, lowprec.evals; print(sorted(m for m in ('experiments', 'lowprec.gates', 'lm_eval', "
            "'datasets', 'lowprec.runtime') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["[]"]
    import ast
    import pathlib
    for path in pathlib.Path(tasks.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "experiments" or n.startswith("lowprec.gates") for n in names), (path, names)
