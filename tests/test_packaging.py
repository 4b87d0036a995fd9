"""What the wheel is built from, checked without building it (tests/test_wheel_install.py builds it).

pyproject.toml lists every package: the folders under lowprec/ with an `__init__.py`, and the two
data packages that live outside lowprec/ in the repository (`gates/` -> `lowprec.gates.files`,
`eval_suites/texts/` -> `lowprec.evals.texts`). A folder added under lowprec/ and not listed would
be missing from the wheel; this test names it. The top-level data folders hold no code.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = {"lowprec.gates.files": "gates", "lowprec.evals.suite_files": "eval_suites", "lowprec.evals.texts": "eval_suites/texts"}


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_is_listed_and_only_lowprec_is_top_level():
    cfg = _setuptools()
    code = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "lowprec").rglob("__init__.py")}
    corpora = {f"lowprec.evals.texts.{d.name}" for d in (ROOT / "eval_suites" / "texts").iterdir()
               if d.is_dir() and d.name != "__pycache__"}   # Python's bytecode cache of the package's __init__
    assert corpora, "no corpus folder under eval_suites/texts"
    assert set(cfg["packages"]) == code | set(DATA) | corpora, sorted(set(cfg["packages"]) ^ (code | set(DATA) | corpora))
    assert {p.split(".")[0] for p in cfg["packages"]} == {"lowprec"}
    assert cfg["package-dir"] == DATA
    for package in corpora:
        assert cfg["package-data"][package] == ["*.txt"], package


def test_the_data_folders_hold_data_not_code():
    for folder in ("gates", "eval_suites"):
        code = sorted(str(p.relative_to(ROOT)) for p in (ROOT / folder).rglob("*.py") if p.name != "__init__.py")
        assert not code, f"code belongs under lowprec/, not in the data folder {folder}/: {code}"
    assert sorted(p.name for p in (ROOT / "gates").glob("*.yaml")) == ["default.yaml", "inloop.yaml", "telemetry.yaml"]


def test_the_entry_points_name_modules_under_lowprec():
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    targets = [t for group in eps.values() for t in group.values()]
    assert len(targets) == 3 and all(t.startswith(("lowprec.gates.", "lowprec.evals.")) for t in targets), targets
    for t in targets:
        module, _, name = t.partition(":")
        assert (ROOT / Path(*module.split("."))).with_suffix(".py").is_file(), t


def test_the_license_is_an_spdx_expression_with_its_file():
    """PEP 639: `license = "Apache-2.0"` and `license-files` (setuptools >= 77 reads them); a TOML
    table there is deprecated and unsupported after 2027-02-18 (issue 56). The wheel test builds it
    and checks that the build prints no deprecation."""
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert doc["project"]["license"] == "Apache-2.0"
    assert doc["project"]["license-files"] == ["LICENSE"] and "Apache License" in (ROOT / "LICENSE").read_text()
    assert doc["build-system"]["requires"] == ["setuptools>=77"]
