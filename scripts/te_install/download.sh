#!/usr/bin/env bash
# Download what Transformer Engine 2.20 needs on a GPU machine that has no package
# registry: run HERE (a machine with PyPI), in the repository root. Writes .te_dl/
# (ignored by .gitignore; TE_DL names another ignored folder: `make gpu-prep` uses .whl/te),
# split into carry-sized folders c01, c02, ... with SHA256SUMS.
# Then on the device, one call per folder:  bash scripts/te_install/install.sh stage
# (see docs/transformer_engine.md).
set -euo pipefail
TE_VERSION=${TE_VERSION:-2.20.2}
PY=${PY:-python3}
PART_MB=${PART_MB:-50}          # per-call carry limit is 64 MiB including the working tree
DL=${TE_DL:-.te_dl}
git check-ignore -q "$DL/x" || { echo "$DL/ is not ignored by git: add it to .gitignore" >&2; exit 1; }
rm -rf "$DL" && mkdir -p "$DL/files"
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

# 1. The core library + TE's Python package (transformer_engine/pytorch/*.py live here),
#    and the meta package. Wheels: pure Python or manylinux, no build needed.
$PY -m pip download -q --no-deps "${PLAT[@]}" -d "$DL/files" \
    "transformer-engine-cu13==$TE_VERSION" "transformer-engine==$TE_VERSION"

# 2. The torch extension's source package. `pip download` cannot fetch it: it runs the
#    sdist's setup.py to read metadata, which needs torch with CUDA. Take the file from
#    the index's JSON page (PEP 691) and check the index's sha256.
$PY - "$TE_VERSION" "$DL/files" <<'PYEOF'
import hashlib, json, sys, urllib.request
version, dest = sys.argv[1], sys.argv[2]
req = urllib.request.Request("https://pypi.org/simple/transformer-engine-torch/",
                             headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(req, timeout=120))["files"]
name = f"transformer_engine_torch-{version}.tar.gz"
(entry,) = [f for f in files if f["filename"] == name]
data = urllib.request.urlopen(entry["url"], timeout=300).read()
assert hashlib.sha256(data).hexdigest() == entry["hashes"]["sha256"], "sha256 mismatch"
open(f"{dest}/{name}", "wb").write(data)
print("downloaded", name, len(data), "bytes")
PYEOF

# 3. Runtime needs the device image lacks (docs/transformer_engine.md lists how they were
#    chosen). transformer-engine-cu13 requires pydantic, importlib-metadata, packaging;
#    transformer-engine-torch requires torch, einops, onnxscript, onnx, packaging,
#    pydantic, nvdlfw-inspect, nvidia-cudnn-frontend. Present in the image: torch,
#    einops, onnx, onnxscript, packaging, pyyaml, zipp, typing-extensions.
#    nvidia-cudnn-frontend goes without its own needs (cutlass-dsl, tvm-ffi: hundreds
#    of MB): TE imports `cudnn` only inside Blackwell (sm100) grouped-GEMM paths.
$PY -m pip download -q --no-deps "${PLAT[@]}" -d "$DL/files" \
    pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
    importlib-metadata==10.2.0 lazy-importer==0.1.0 nvdlfw-inspect==0.2.2 \
    nvidia-cudnn-frontend==1.32.0

# 4. Split into carry folders: the big core wheel in PART_MB parts, one per folder; the
#    small files go into the last folder.
cd "$DL"
( cd files && sha256sum * > ../SHA256SUMS )
big=$(ls files/transformer_engine_cu13-*.whl)
# TE's Python sources, for tests/lowprec/sites/backends/test_te_api.py (parsed, not imported, on CPU)
rm -rf src && unzip -q "$big" 'transformer_engine/*.py' -d src
split -b "${PART_MB}M" -d -a 2 "$big" "$(basename "$big").part"
i=0
for p in transformer_engine_cu13-*.part*; do
  i=$((i + 1)); d=$(printf 'c%02d' $i); mkdir -p "$d"; mv "$p" "$d/"
done
for f in files/*; do [ "$f" = "$big" ] || cp "$f" "$d/"; done
sha256sum c*/* > PARTS.SHA256SUMS
cp SHA256SUMS PARTS.SHA256SUMS "$d/"               # the manifest travels with the last folder
rm -rf files
echo "== $(ls -d c* | wc -l) carry folders (one device call each):"
du -sh c* ; du -sh .
echo "== manifest (whole files):"; cat SHA256SUMS
