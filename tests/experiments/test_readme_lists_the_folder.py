"""experiments/README.md says what the folder holds: every file it names exists (but those it
says were removed), and every script, module and config in the folder is named in it."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

HERE = Path(__file__).resolve().parents[2] / "experiments"


def _named(text: str) -> set[str]:
    """The folder's files the README names: backticked `x.py`, `configs/x.yaml` or, in the
    configs' row, `x.yaml` (globs allowed); paths elsewhere in the repository (tests/...) are not."""
    found = set(re.findall(r"`([\w./*-]+\.(?:py|yaml))`", text))
    return {f"configs/{n}" if n.endswith(".yaml") and "/" not in n else n
            for n in found if not n.startswith(("tests/", "docs/", "lowprec/"))}


def _removed(text: str) -> set[str]:
    tail = text.split("Removed once published", 1)
    return _named(tail[1]) if len(tail) == 2 else set()


def _in_folder() -> list[str]:
    files = [p.relative_to(HERE).as_posix() for p in HERE.rglob("*") if p.is_file()]
    return sorted(f for f in files if f.endswith((".py", ".yaml")) and "__pycache__" not in f
                  and Path(f).name != "__init__.py")


def test_every_file_the_readme_names_exists_and_every_file_is_named():
    text = (HERE / "README.md").read_text()
    named, removed = _named(text), _removed(text)
    present = _in_folder()
    assert len(present) > 20 and len(named) > 20, (present, named)
    missing = sorted(n for n in named - removed if not fnmatch.filter(present, n))
    assert not missing, f"experiments/README.md names files that do not exist: {missing}"
    still_there = sorted(n for n in removed if fnmatch.filter(present, n))
    assert not still_there, f"experiments/README.md says these were removed, but they are there: {still_there}"
    unnamed = [f for f in present if not any(fnmatch.fnmatch(f, n) for n in named - removed)]
    assert not unnamed, f"files in experiments/ that its README does not name: {unnamed}"
