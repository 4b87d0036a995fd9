"""References that resolve: what the package, the docs and the experiments cite is in the repository.

A path a comment, docstring or doc names (`lowprec/gates/budget.py`, `docs/gates.md`,
`experiments/configs/default.yaml`) must exist in the checkout, and nothing cites a file
that is not in the repository (notes kept beside it): cite the public source instead (an
upstream issue, a paper, a URL). Tests are not scanned (they name missing files on purpose).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("lowprec/", "docs/", "experiments/", "gates/", "eval_suites/", "scripts/", "README.md", "pyproject.toml",
           "Makefile")
PATH = re.compile(r"(?<![\w./-])((?:lowprec|tests|experiments|docs|gates|eval_suites|scripts)/[\w./-]*\w)")
# paths of the installed wheel or of a run folder, not of the repository
NOT_REPOSITORY = ("lowprec/gates/files/", "lowprec/evals/texts/", "lowprec/rank_")
OUTSIDE = re.compile(r"FACTS\.md|\.\./shared")


def _files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / f for f in out if f.startswith(SCANNED) and f.endswith((".py", ".md", ".yaml", ".toml", ".sh", "Makefile"))
            and (ROOT / f).is_file()]


def _cited(files: list[Path]):
    for f in files:
        for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            yield f"{f.relative_to(ROOT)}:{i}", line


def test_cited_paths_exist():
    files = _files()
    assert len(files) > 100, len(files)
    missing = [f"{where}: {ref}" for where, line in _cited(files) for ref in (m.rstrip(".") for m in PATH.findall(line))
               if "*" not in ref and not ref.startswith(NOT_REPOSITORY) and not ref.endswith("_")
               and not (ROOT / ref).exists()]
    assert not missing, "paths cited that are not in the repository:\n" + "\n".join(missing)


def test_nothing_cites_notes_outside_the_repository():
    found = [f"{where}: {line.strip()[:120]}" for where, line in _cited(_files()) if OUTSIDE.search(line)]
    assert not found, ("cite the public source (an upstream issue, a paper, a URL), not a file beside the "
                       "repository:\n" + "\n".join(found))
