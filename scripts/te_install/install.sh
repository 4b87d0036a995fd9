#!/usr/bin/env bash
# Install Transformer Engine 2.20 on a GPU machine with no registry, from the folders
# scripts/te_install/download.sh made (.te_dl/c01 ... c06), over consecutive commands:
#   bash scripts/te_install/install.sh stage      # once per folder carried in (any order)
#   bash scripts/te_install/install.sh build      # verify, install wheels, build the torch
#                                                 # extension in the background (log + date stamps;
#                                                 # its own process session, so that it outlives
#                                                 # the device command that started it)
#   bash scripts/te_install/install.sh status     # progress; prints the check when done
#   source scripts/te_install/install.sh env      # PYTHONPATH for later commands
# Everything lands outside the repository: $TE_STAGE (parts), $TE_SITE (the install).
# TE_DL: the folder holding the carry folders (default .te_dl; `make gpu-prep` makes .whl/te).
set -uo pipefail
SELF=$(readlink -f "${BASH_SOURCE[0]}")
TE_DL=${TE_DL:-.te_dl}
TE_STAGE=${TE_STAGE:-/tmp/te_stage}
TE_SITE=${TE_SITE:-/tmp/te_site}
TE_LOG=$TE_STAGE/build.log
PY=${PY:-python3}; case $PY in /*|python3) ;; *) PY=$PWD/$PY ;; esac
cmd=${1:-status}

case "$cmd" in
env)
  export PYTHONPATH=$TE_SITE${PYTHONPATH:+:$PYTHONPATH}
  return 0 2>/dev/null || exit 0 ;;
stage)   # copy whatever carry folders this call brought; check each part's own sum
  mkdir -p "$TE_STAGE"
  for d in "$TE_DL"/c[0-9][0-9]; do [ -d "$d" ] && cp -a "$d"/. "$TE_STAGE"/ && echo "staged $d"; done
  if [ -f "$TE_STAGE/PARTS.SHA256SUMS" ]; then
    (cd "$TE_STAGE" && sed 's# c[0-9][0-9]/# #' PARTS.SHA256SUMS | sha256sum -c --ignore-missing --quiet) \
      && echo "parts present so far verify"
  fi
  ls -la "$TE_STAGE" ;;
build)
  cd "$TE_STAGE" || exit 1
  [ -f SHA256SUMS ] || { echo "no manifest: stage the last folder (with SHA256SUMS)"; exit 1; }
  big=$(awk '/transformer_engine_cu13/ {print $2}' SHA256SUMS)
  n_want=$(grep -c "$big.part" PARTS.SHA256SUMS); n_have=$(ls "$big".part* 2>/dev/null | wc -l)
  [ "$n_have" = "$n_want" ] || { echo "have $n_have of $n_want parts of $big: stage the rest"; exit 1; }
  cat "$big".part* > "$big" && sha256sum -c SHA256SUMS || { echo "sha256 mismatch"; exit 1; }
  rm -f "$big".part*
  # The device kills what a command leaves running unless it is in a process session of its own.
  setsid bash "$SELF" build-fg > "$TE_LOG" 2>&1 < /dev/null &
  echo $! > build.pid
  echo "building in the background (pid $(cat build.pid)); log $TE_LOG; run: install.sh status" ;;
build-fg)   # the build itself, in $TE_STAGE (run by `build` in the background)
  cd "$TE_STAGE" || exit 1
  echo "== start $(date -u +%FT%TZ)"
  $PY -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  command -v nvcc && nvcc --version | tail -2
  # The extension is a torch CppExtension (C++ only: TE's CUDA kernels are in the
  # core library of transformer-engine-cu13), built against this python3's torch.
  # NVTE_PYTORCH_FORCE_BUILD: do not try to download a prebuilt wheel (no network).
  # NVTE_CUDA_ARCHS=90 keeps the NCCL-EP gate on (needs an arch >= 90), as in the
  # core wheel, which ships libnccl_ep.so. Set NVTE_WITH_NCCL_EP=0 if that part fails.
  export NVTE_FRAMEWORK=pytorch NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_CUDA_ARCHS=${NVTE_CUDA_ARCHS:-90}
  export MAX_JOBS=${MAX_JOBS:-$(nproc)} CUDA_HOME=${CUDA_HOME:-$( [ -d /usr/local/cuda ] && echo /usr/local/cuda || dirname "$(dirname "$(command -v nvcc)")")}
  env | grep -E '^(NVTE_|MAX_JOBS|CUDA_HOME)' | sort
  mkdir -p wheels && mv ./*.whl wheels/ 2>/dev/null
  echo "== build transformer_engine_torch $(date -u +%FT%TZ)"
  $PY -m pip wheel -v --no-index --no-deps --no-build-isolation --no-cache-dir -w wheels \
      transformer_engine_torch-*.tar.gz || { echo "== BUILD FAILED $(date -u +%FT%TZ)"; exit 1; }
  echo "== built $(date -u +%FT%TZ)"; ls -la wheels
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$TE_SITE" wheels/*.whl || { echo "== INSTALL FAILED"; exit 1; }
  echo "== installed $(date -u +%FT%TZ)"
  PYTHONPATH=$TE_SITE $PY -c "import transformer_engine.pytorch as te, transformer_engine; print('TE', transformer_engine.__version__, 'imports; fp8:', te.is_fp8_available(return_reason=True))"
  echo "== done $(date -u +%FT%TZ) rc=$?"
  ;;
status)
  [ -f "$TE_LOG" ] || { echo "no build started"; exit 1; }
  if kill -0 "$(cat "$TE_STAGE/build.pid")" 2>/dev/null; then echo "RUNNING"; else echo "FINISHED"; fi
  grep -E '^== ' "$TE_LOG"; tail -n ${TAIL:-15} "$TE_LOG" ;;
check)
  PYTHONPATH=$TE_SITE${PYTHONPATH:+:$PYTHONPATH} $PY -c "import transformer_engine, transformer_engine.pytorch as te; print(transformer_engine.__version__)" ;;
*) echo "usage: install.sh stage|build|build-fg|status|check|env"; exit 2 ;;
esac
