#!/usr/bin/env bash
# The GPU runs of issue 57 (and 28-30, 43), on the lent GPU machine (no registry there: `make
# gpu-prep` downloads here what it needs into .whl/, see docs/performance.md "Running the H100 benchmarks").
#
#   scripts/gpu_bench.sh --dry-run [PHASE...]   HERE: checks every file, wheel (size, sha256
#                                               against .whl/MANIFEST.tsv), script, module and
#                                               config the phases need; prints the device-call plan
#   scripts/gpu_bench.sh PHASE...               THERE: verifies and installs the carried wheels
#                                               into /tmp/site, runs each phase under `timeout`
#
# Phases (issue 57's first; a dry run with no phase named checks those four):
#   mainjob   the GPU main job: experiments/configs/gpu_llama_d4096.yaml (d 4096, blocks compiled)
#             BF16 baseline, staged rollout, gate (as `make run` does for the CPU config)
#   model     experiments/bench_model_step.py at 1.0B, 1.6B and 3.2B parameters, BF16 against
#             lowprec fp8_tensorwise and torchao's Float8Linear, blocks compiled, in one call
#   host      experiments/bench_host.py: host time of a layer step, eager, compiled and under
#             CUDA graphs, against nn.Linear
#   te        Transformer Engine: stage the carried parts; once all are there, build
#             (scripts/te_install/install.sh), run tests/gpu/test_te_backend.py and the layer
#             table's `te` rows (bench_linear.py --te)
#   temainjob the main job on the `te` backend (after te, the build still installed: machine warm)
#   tests     the GPU tests: tests/gpu, the torch/CPU quantizer parity, the compiled Triton
#             cast kernels against `quantize` on every BF16 value
#   quantize  bench_quantize.py's Triton rows against a memory copy (8192^2 BF16)
#   linear    bench_linear.py's table (BF16, torchao, lowprec's backends; 6 shapes, largest first)
#   profile   experiments/profile_linear.py (kernels of one FP8 layer step at d 8192) and
#             experiments/kernel_registers.py (the cast kernels' registers and spills)
#   moe       experiments/bench_moe.py on the GPU (issue 53): one MoE layer's experts at
#             DeepSeek-V3's expert shapes, BF16 grouped GEMM against lowprec's grouped FP8
#             kernel and torchao's, forward + backward
#
# Options: --wheels DIR (default .whl), --out DIR (default $OUT when set, else ./gpu_out),
#          --budget PHASE=S (that phase's time limit in seconds, for a call that fits several
#          phases into a short lease; linear's deadline follows it).
# Each phase writes OUT/PHASE.md (result and log) and OUT/PHASE.json; OUT/calls.json sums up
# the call. At most 8 files come back from a device call: at most 3 phases a call.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SELF=$ROOT/scripts/gpu_bench.sh
cd "$ROOT"
PY=${PY:-python3}
WHEELS=.whl
OUT_DIR=${OUT:-./gpu_out}
WORK=${GPU_BENCH_WORK:-/tmp/gpu_bench}          # logs and runs there; only summaries go to OUT
SITE=${GPU_BENCH_SITE:-/tmp/site}
ISSUE_PHASES=(mainjob model host te)     # what a dry run with no phase named checks
ALL_PHASES=(mainjob model host te temainjob tests quantize linear profile moe)

# --- the plan ------------------------------------------------------------------------------
# Seconds each phase may run (its `timeout`), and what each needs carried in (folders under
# the wheels folder; te: every te/cNN, one per call) and present in the repository.
# mainjob: two runs of the 0.81B model (compiling its blocks once per run and per precision
# switch, evals, one 13 GB checkpoint each) and the gate; model: 3 sizes x 3 rows, each row a
# compilation and 2+6 steps; host: the layer rows at d 256 (seconds).
declare -A BUDGET=([mainjob]=290 [model]=190 [host]=40 [te]=480 [temainjob]=400
                   [tests]=200 [quantize]=120 [linear]=230 [profile]=90 [moe]=90)
declare -A CARRY=([mainjob]="job data" [model]="ao" [host]="" [te]="" [temainjob]="job data"
                  [tests]="ao" [quantize]="" [linear]="ao" [profile]="" [moe]="ao")
MAINJOB_CFG=experiments/configs/gpu_llama_d4096.yaml
declare -A FILES=(
  [mainjob]="$MAINJOB_CFG gates/default.yaml pyproject.toml"
  [model]="experiments/bench_model_step.py experiments/model.py"
  [host]="experiments/bench_host.py"
  [te]="scripts/te_install/install.sh tests/gpu/test_te_backend.py experiments/bench_linear.py"
  [temainjob]="$MAINJOB_CFG gates/default.yaml pyproject.toml"
  [tests]="tests/gpu tests/lowprec/numerics/test_quantize_torch_parity.py tests/lowprec/numerics/kernels/test_fp8_cast.py"
  [quantize]="experiments/bench_quantize.py lowprec/numerics/kernels"
  [linear]="experiments/bench_linear.py"
  [profile]="experiments/profile_linear.py experiments/kernel_registers.py"
  [moe]="experiments/bench_moe.py lowprec/sites/grouped_scaled_mm.py")
# bench_model_step's sizes: name, d_model, layers, heads, SwiGLU hidden (16,384 tokens a step)
MODEL_SIZES=("1.0B 2048 20 16 5632" "1.6B 4096 8 32 11008" "3.2B 4096 16 32 11008")
# Device calls. Lease 1 (issue 57 steps 1-2): at most 13 minutes and 3 calls, back to back on
# one machine (it stays warm 30 s after a call). Lease 2: Transformer Engine, one call per
# carried part (te/cNN: the 280 MB wheel in parts under the 64 MiB a call carries), the last
# builds, tests and adds the te rows; calls numbered on from TE_FIRST_CALL (gpu_prep.py's). Then
# the te main job. Lease 4: the tables of issues 29 and 43, when named. Lease 5: issue 53's MoE
# layer (its GPU tests are in lease 4's `tests`).
CALL_PHASES=([1]="mainjob" [2]="model host" [20]="linear profile tests" [21]="quantize" [22]="moe")
declare -A LEASE_OF_CALL=([1]=1 [2]=1 [20]=4 [21]=4 [22]=5)
TE_FIRST_CALL=3
INSTALL_S=30          # verify + pip install of the carried wheels, each call (job: +15)
TRANSFER_S=20         # sending the tree and the carried folders, each call
COLD_START_S=120      # a bare machine's start, once per lease
GAP_S=15              # between two calls of a lease (the machine stays warm 30 s)
GIVE_BACK_S=5         # give_back right after a lease's last call
CALL_LIMIT_S=600
LEASE_LIMIT_S=900     # a session's device time
PLAN_LIMIT_S=780      # issue 57: lease 1 at most 13 minutes ...
PLAN_CALLS=3          # ... in at most 3 calls
CARRY_LIMIT=$((64 * 1024 * 1024))

die() { echo "gpu_bench: $*" >&2; exit 1; }
usage() { sed -n '2,36p' "$SELF" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

DRY=0; PHASES=(); INNER=""
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY=1 ;;
    --wheels) WHEELS=${2:?--wheels needs a folder}; shift ;;
    --out) OUT_DIR=${2:?--out needs a folder}; shift ;;
    --inner) INNER=${2:?}; shift ;;
    --budget) b=${2:?--budget needs PHASE=SECONDS}; shift
       [[ $b =~ ^([a-z]+)=([0-9]+)$ ]] || die "--budget wants PHASE=SECONDS, got '$b'"
       [ -n "${BUDGET[${BASH_REMATCH[1]}]:-}" ] || die "--budget: unknown phase '${BASH_REMATCH[1]}' (phases: ${ALL_PHASES[*]})"
       BUDGET[${BASH_REMATCH[1]}]=${BASH_REMATCH[2]} ;;
    -h|--help) usage 0 ;;
    -*) echo "gpu_bench: unknown option $1" >&2; usage 2 ;;
    *) [[ " ${ALL_PHASES[*]} " == *" $1 "* ]] || die "unknown phase '$1' (phases: ${ALL_PHASES[*]})"
       PHASES+=("$1") ;;
  esac
  shift
done
WHEELS=${WHEELS%/}
MANIFEST=$WHEELS/MANIFEST.tsv

# --- manifest ------------------------------------------------------------------------------
# MANIFEST.tsv (scripts/gpu_prep.py): carry, name, version, file (under WHEELS), bytes, sha256,
# calls. On the device only the carried folders are there, each with its copy of it.
find_manifest() {
  [ -f "$MANIFEST" ] && { echo "$MANIFEST"; return; }
  local m; for m in "$WHEELS"/*/MANIFEST.tsv "$WHEELS"/te/*/MANIFEST.tsv; do
    [ -f "$m" ] && { echo "$m"; return; }; done
  return 1
}
te_folders() { awk -F'\t' '!/^#/ && $1 ~ /^te\// {print $1}' "$1" | sort -u; }

# verify MANIFEST FOLDER...: every file of these folders present, of the manifest's size and
# sha256; prints one line per problem and fails if there is one.
verify() {
  local man=$1; shift; local bad=0 folder carry name version file bytes sum calls size
  for folder in "$@"; do
    if ! awk -F'\t' -v f="$folder" '!/^#/ && $1 == f {found=1} END {exit !found}' "$man"; then
      echo "MISSING: $folder: no file of it in the manifest $man (run make gpu-prep)"; bad=$((bad + 1)); continue
    fi
    while IFS=$'\t' read -r carry name version file bytes sum calls; do
      [ "$carry" = "$folder" ] || continue
      if [ ! -f "$WHEELS/$file" ]; then
        echo "MISSING: $WHEELS/$file ($name $version; carried by call $calls)"; bad=$((bad + 1)); continue
      fi
      size=$(stat -c %s "$WHEELS/$file")
      if [ "$size" != "$bytes" ]; then
        echo "WRONG SIZE: $WHEELS/$file is $size bytes, the manifest says $bytes"; bad=$((bad + 1)); continue
      fi
      if [ "$(sha256sum "$WHEELS/$file" | cut -d' ' -f1)" != "$sum" ]; then
        echo "WRONG SHA256: $WHEELS/$file ($name $version) does not match the manifest"; bad=$((bad + 1))
      fi
    done < <(grep -v '^#' "$man")
  done
  [ "$bad" -eq 0 ]
}

# --- the dry run (here) ---------------------------------------------------------------------
dry_run() {
  local phases=("$@") problems=() p f folder man line
  [ ${#phases[@]} -gt 0 ] || phases=("${ISSUE_PHASES[@]}")
  echo "== gpu_bench dry run: phases ${phases[*]}; wheels folder $WHEELS; repository $ROOT"
  command -v "$PY" >/dev/null 2>&1 || [ -x "$PY" ] || problems+=("MISSING: python ($PY)")
  for f in sha256sum timeout setsid awk stat; do
    command -v "$f" >/dev/null 2>&1 || problems+=("MISSING: command $f"); done
  for p in "${phases[@]}"; do
    for f in ${FILES[$p]}; do [ -e "$f" ] || problems+=("MISSING: $f (phase $p)"); done
  done
  [ -f scripts/gpu_bench_report.py ] || problems+=("MISSING: scripts/gpu_bench_report.py")
  if [ ! -f "$MANIFEST" ]; then
    problems+=("MISSING: $MANIFEST (run make gpu-prep)")
  else
    man=$MANIFEST
    local need=()
    for p in "${phases[@]}"; do need+=(${CARRY[$p]}); done
    if [[ " ${phases[*]} " == *" te "* ]]; then
      mapfile -t tef < <(te_folders "$man")
      if [ ${#tef[@]} -eq 0 ]; then problems+=("MISSING: Transformer Engine parts (te/cNN) in $man (make gpu-prep without NO_TE)")
      else
        need+=("${tef[@]}")
        grep -q $'\t''te/c[0-9]*/SHA256SUMS'$'\t' "$man" || problems+=("MISSING: te/cNN/SHA256SUMS in $man")
        grep -q $'\t''te/c[0-9]*/PARTS.SHA256SUMS'$'\t' "$man" || problems+=("MISSING: te/cNN/PARTS.SHA256SUMS in $man")
      fi
    fi
    mapfile -t need < <(printf '%s\n' "${need[@]}" | awk 'NF && !seen[$0]++')
    if [ ${#need[@]} -gt 0 ]; then
      echo "-- verifying $(awk -F'\t' '!/^#/' "$man" | wc -l) manifest entries of: ${need[*]}"
      while IFS= read -r line; do [ -n "$line" ] && problems+=("$line"); done < <(verify "$man" "${need[@]}" || true)
      # two versions of one package in a folder stop the whole pip install there
      while IFS= read -r line; do [ -n "$line" ] && problems+=("DUPLICATE: $line"); done < <(
        awk -F'\t' '!/^#/ && $4 ~ /\.whl$/ {k=$1" "tolower($2); if (k in v && v[k] != $3) print $1": "$2" "v[k]" and "$3; v[k]=$3}' "$man")
      # the manifest's calls column must be this plan's
      while IFS= read -r line; do [ -n "$line" ] && problems+=("PLAN: $line"); done < <(check_calls "$man")
    fi
  fi
  # the modules the phases import, where that needs no GPU
  local out
  if out=$("$PY" - "$MAINJOB_CFG" "${phases[@]}" 2>&1 <<'PYEOF'
import importlib, importlib.util, sys
phases = set(sys.argv[2:])
need = ["torch", "lowprec", "lowprec.sites.backends", "yaml"]
if "tests" in phases: need += ["pytest", "hypothesis"]
if "linear" in phases: need += ["experiments.bench_linear"]
if "profile" in phases: need += ["experiments.profile_linear", "experiments.bench_host", "experiments.kernel_registers"]
if "quantize" in phases: need += ["experiments.bench_quantize"]
if {"mainjob", "temainjob"} & phases:
    need += ["lowprec.cli", "lowprec.gates.cli", "lowprec.evals", "experiments.model", "experiments.data"]
if "model" in phases: need += ["experiments.bench_model_step"]
if "host" in phases: need += ["experiments.bench_host"]
if "te" in phases: need += ["lowprec.sites.backends.te", "experiments.bench_linear"]
bad = []
if {"mainjob", "temainjob"} & phases:   # the main job's config as `lowprec run` loads it (no model built)
    try:
        from pathlib import Path
        from lowprec.config import LowprecConfig
        from lowprec.runtime.trainer.run import load_factory
        cfg = LowprecConfig.from_yaml(sys.argv[1])
        build = load_factory(cfg.model.factory, "model.factory", [Path.cwd()])
        build(**{**cfg.model.args, "device": "meta"})   # every argument taken, shapes only
    except Exception as e:  # noqa: BLE001
        bad.append(f"CONFIG: {sys.argv[1]}: {type(e).__name__}: {e}")
for name in need:
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001
        bad.append(f"MISSING: python module {name} ({type(e).__name__}: {e})")
if {"tests", "quantize"} & phases and importlib.util.find_spec("triton") is None:
    print("note: triton is not installed here; the GPU machine's image has it")
print("\n".join(bad))
sys.exit(1 if bad else 0)
PYEOF
  ); then [ -z "$out" ] || echo "$out"
  else while IFS= read -r line; do [[ $line == MISSING* || $line == CONFIG* ]] && problems+=("$line") || echo "$line"; done <<< "$out"
  fi
  print_plan "${phases[@]}" || problems+=("PLAN: over a limit (above)")
  if [ ${#problems[@]} -gt 0 ]; then
    echo "== NOT READY: ${#problems[@]} problem(s):" >&2
    printf '  %s\n' "${problems[@]}" >&2
    return 1
  fi
  echo "== ready: every file, wheel and module the phases need is here"
}

# calls each carry folder should have in the manifest, by this plan
expected_calls() {
  case $1 in
    job|data) echo "1" ;; ao) echo "2" ;;
    te/c[0-9][0-9]) echo $((TE_FIRST_CALL - 1 + 10#${1#te/c})) ;;
    *) echo "?" ;;
  esac
}
check_calls() {
  awk -F'\t' '!/^#/ {print $1"\t"$7}' "$1" | sort -u | while IFS=$'\t' read -r folder calls; do
    [ "$(expected_calls "$folder")" = "$calls" ] ||
      echo "$folder: the manifest says call(s) $calls, this plan $(expected_calls "$folder") (re-run make gpu-prep)"
  done
}

mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }

folder_bytes() {   # bytes of a carry folder, from the manifest (0 where it is not in it)
  awk -F'\t' -v f="$2" '!/^#/ && $1 == f {s += $5} END {print s + 0}' "$1"
}

tree_bytes() {     # what travels besides the carried folders: tracked + untracked, not ignored
  git ls-files -z --cached --others --exclude-standard 2>/dev/null |
    xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}'
}

# end_lease N SECONDS CALLS: the lease's total against its limits (nothing for lease 0: none yet);
# lease 1 is issue 57's: at most PLAN_LIMIT_S in at most PLAN_CALLS calls
end_lease() {
  [ "$1" != 0 ] || return 0
  local limit=$LEASE_LIMIT_S secs=$(($2 + GIVE_BACK_S))
  [ "$1" != 1 ] || limit=$PLAN_LIMIT_S
  echo "   lease $1 total: $secs s of $limit in $3 call(s) (cold start ${COLD_START_S} s, ${GAP_S} s between calls, give_back ${GIVE_BACK_S} s)"
  [ "$secs" -le "$limit" ] || { echo "   OVER the lease's device time"; return 1; }
  [ "$1" != 1 ] || [ "$3" -le "$PLAN_CALLS" ] || { echo "   OVER $PLAN_CALLS calls"; return 1; }
}

# call_line CALL PHASES: one call's line; sets SECS (its device time) and BYTES (carried)
call_line() {
  local call=$1 phases=$2 p f folders="" carry=""
  SECS=$TRANSFER_S; BYTES=$TREE
  for p in $phases; do
    for f in ${CARRY[$p]}; do [[ " $folders " == *" $f "* ]] || folders+="$f "; done
    SECS=$((SECS + BUDGET[$p]))
  done
  [ -z "$folders" ] || SECS=$((SECS + INSTALL_S))
  [[ " $folders " != *" job "* ]] || SECS=$((SECS + 15))
  for f in $folders; do
    carry+="\"$WHEELS/$f\", "
    [ -f "$MANIFEST" ] && BYTES=$((BYTES + $(folder_bytes "$MANIFEST" "$f")))
  done
  printf '   call %d: scripts/gpu_bench.sh %s\n' "$call" "$phases"
  printf '           carry: [%s]   %s MiB   budget %d s (%s)\n' "${carry%, }" "$(mib "$BYTES")" "$SECS" \
    "$(for p in $phases; do printf '%s %ss, ' "$p" "${BUDGET[$p]}"; done)transfer+install $((SECS - $(for p in $phases; do echo "${BUDGET[$p]}"; done | awk '{s+=$1} END {print s}')))s"
}

# print_plan PHASE...: the device calls that run them, carry lists and time budgets
print_plan() {
  local want=" $* " over=0 lease=0 total=0 ncalls=0 call phases p f n tef=() last
  TREE=$(tree_bytes)
  echo
  echo "== device-call plan (limits: ${CALL_LIMIT_S} s a call, ${LEASE_LIMIT_S} s device time a session's lease"
  echo "   incl. a ${COLD_START_S} s cold start, issue 57's lease 1 at most ${PLAN_LIMIT_S} s in ${PLAN_CALLS} calls; 64 MiB"
  echo "   carried a call incl. the working tree of $((TREE / 1024)) KiB; the machine keeps /tmp only while"
  echo "   warm: 30 s between calls, so make the calls of one lease back to back, then give_back)"
  start_call() {   # start_call CALL LEASE: a new lease's header where the lease changes
    if [ "$2" != "$lease" ]; then
      end_lease "$lease" "$total" "$ncalls" || over=1
      lease=$2; total=$COLD_START_S; ncalls=0
      case $lease in
        1) echo "-- lease 1 (issue 57 steps 1-2: the main job, the model step, the host time)" ;;
        2) echo "-- lease 2 (issue 57 step 3, Transformer Engine): one call per carried part, back to back; the" ;
           echo "   last builds, tests and adds the te rows (if the build is not done by its budget, call te again)" ;;
        3) echo "-- lease 3 (issue 57 step 3): the main job on the te backend, TE built in lease 2's /tmp (same machine," ;
           echo "   warm: right after lease 2's last call; a fresh machine needs lease 2 again)" ;;
        4) echo "-- lease 4 (issues 29 and 43: the layer table, profile, tests, quantize)" ;;
        5) echo "-- lease 5 (issue 53: one MoE layer's grouped FP8 experts against BF16 and torchao)" ;;
      esac
    else
      total=$((total + GAP_S))
    fi
  }
  for call in 1 2; do
    phases=""; for p in ${CALL_PHASES[$call]}; do [[ $want == *" $p "* ]] && phases+="$p "; done
    [ -n "$phases" ] || continue
    start_call "$call" "${LEASE_OF_CALL[$call]}"
    call_line "$call" "${phases% }"
    [ "$SECS" -le "$CALL_LIMIT_S" ] || { echo "           OVER the ${CALL_LIMIT_S} s call limit"; over=1; }
    [ "$BYTES" -le "$CARRY_LIMIT" ] || { echo "           OVER the 64 MiB carry limit"; over=1; }
    total=$((total + SECS)); ncalls=$((ncalls + 1))
  done
  call=$TE_FIRST_CALL
  if [[ $want == *" te "* ]] && [ -f "$MANIFEST" ]; then
    mapfile -t tef < <(te_folders "$MANIFEST")
    n=${#tef[@]}; last=${tef[$((n - 1))]:-}
    for f in "${tef[@]}"; do
      call=$((TE_FIRST_CALL - 1 + 10#${f#te/c}))
      start_call "$call" 2
      BYTES=$((TREE + $(folder_bytes "$MANIFEST" "$f")))
      if [ "$f" = "$last" ]; then SECS=$((TRANSFER_S + 10 + BUDGET[te])); else SECS=$((TRANSFER_S + 10)); fi
      printf '   call %d: scripts/gpu_bench.sh te   carry: ["%s"]   %s MiB   budget %d s\n' \
        "$call" "$WHEELS/$f" "$(mib "$BYTES")" "$SECS"
      [ "$BYTES" -le "$CARRY_LIMIT" ] || { echo "           OVER the 64 MiB carry limit"; over=1; }
      total=$((total + SECS)); ncalls=$((ncalls + 1))
    done
    call=$((call + 1))
  fi
  if [[ $want == *" temainjob "* ]]; then
    start_call "$call" 3
    call_line "$call" temainjob
    [ "$SECS" -le "$CALL_LIMIT_S" ] || { echo "           OVER the ${CALL_LIMIT_S} s call limit"; over=1; }
    total=$((total + SECS)); ncalls=$((ncalls + 1)); call=$((call + 1))
  fi
  local slot
  for slot in 20 21 22; do
    phases=""; for p in ${CALL_PHASES[$slot]}; do [[ $want == *" $p "* ]] && phases+="$p "; done
    [ -n "$phases" ] || continue
    start_call "$call" "${LEASE_OF_CALL[$slot]}"
    call_line "$call" "${phases% }"; call=$((call + 1))
    [ "$SECS" -le "$CALL_LIMIT_S" ] || { echo "           OVER the ${CALL_LIMIT_S} s call limit"; over=1; }
    [ "$BYTES" -le "$CARRY_LIMIT" ] || { echo "           OVER the 64 MiB carry limit"; over=1; }
    total=$((total + SECS)); ncalls=$((ncalls + 1))
  done
  end_lease "$lease" "$total" "$ncalls" || over=1
  for p in "$@"; do   # a phase no call runs would be silently left out of the session's plan
    [[ " ${CALL_PHASES[*]} " == *" $p "* ]] || [[ " te temainjob " == *" $p "* ]] \
      || { echo "   PHASE $p is in no device call (CALL_PHASES)"; over=1; }
  done
  echo
  return "$over"
}

# --- on the device ------------------------------------------------------------------------
install_carried() {
  local man folders=() f whls=()
  man=$(find_manifest) || { echo "no MANIFEST.tsv under $WHEELS: nothing carried (fine for a phase that needs none)"; return 0; }
  for f in ao job data; do [ -d "$WHEELS/$f" ] && folders+=("$f"); done
  for f in "$WHEELS"/te/c[0-9][0-9]; do [ -d "$f" ] && folders+=("${f#"$WHEELS"/}"); done
  [ ${#folders[@]} -gt 0 ] || { echo "nothing carried under $WHEELS"; return 0; }
  echo "== verifying carried folders: ${folders[*]}"
  verify "$man" "${folders[@]}" || die "carried files do not match the manifest (above): not installing"
  for f in ao job; do [ -d "$WHEELS/$f" ] && whls+=("$WHEELS/$f"/*.whl); done
  if [ ${#whls[@]} -gt 0 ]; then
    echo "== installing ${#whls[@]} wheels into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${whls[@]}"
  fi
  if [ -d "$WHEELS/data" ]; then
    mkdir -p .cache/data && cp -a "$WHEELS/data/." .cache/data/ && rm -f .cache/data/MANIFEST.tsv
  fi
}

need_carried() {   # need_carried PHASE: the phase's carry folders must be here
  local f; for f in ${CARRY[$1]}; do
    [ -d "$WHEELS/$f" ] || die "phase $1 needs $WHEELS/$f carried in (carry: [\"$WHEELS/$f\"]); see --dry-run's plan"
  done
}

# one phase's body, run by `timeout bash gpu_bench.sh --inner PHASE`; results under $WORK
phase_body() {
  local p=$1 rc=0
  case $p in
  tests)
    "$PY" -m pytest -q -rs -p no:cacheprovider --junitxml="$WORK/tests-gpu.xml" \
      tests/gpu tests/lowprec/numerics/test_quantize_torch_parity.py || rc=$?
    "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu --junitxml="$WORK/tests-kernels.xml" \
      tests/lowprec/numerics/kernels/test_fp8_cast.py || rc=$((rc > 0 ? rc : $?))
    return "$rc" ;;
  quantize)
    "$PY" experiments/bench_quantize.py --device cuda --dtype bfloat16 --size 8192 --no-fused \
      --formats fp8_tensorwise fp8_delayed fp8_rowwise --json "$WORK/quantize.json" ;;
  linear)
    # no new shape in the last 90 s: the largest takes about a minute with its compilations.
    # d 8192 first (the 1.35x goal), then d 2048 (host-bound: where the compiled rows matter)
    "$PY" experiments/bench_linear.py --d-model 8192 2048 4096 --tokens 8192 16384 \
      --json "$WORK/linear.json" --deadline $((BUDGET[linear] - 90)) ;;
  profile)
    # each format's plain step and check step (statistics on) in the same run: the check
    # step's cast kernel against the plain one's (delayed too: its own `_ct_kernel` variant)
    "$PY" -m experiments.profile_linear --d-model 8192 --tokens 8192 \
      --formats fp8_tensorwise fp8_delayed fp8_rowwise --json "$WORK/profile.json" || rc=$?
    # registers and spills of the cast kernels as this image's Triton and ptxas compile them
    # (seconds, no GPU work): beside the check step's `_ct_kernel` time above, whether the
    # statistics spill here as they did under Triton 3.9 on the CPU (docs/performance.md)
    "$PY" experiments/kernel_registers.py | tee "$WORK/registers.txt" \
      || echo "kernel_registers.py failed (not counted against the phase)"
    return "$rc" ;;
  mainjob|temainjob)
    # lowprec itself, for its entry points (the gate command, the lm_eval evaluator)
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$SITE" . \
      || { echo "installing lowprec into $SITE failed"; return 1; }
    rm -rf build lowprec.egg-info
    local out=$WORK/runs/$p cfg=$MAINJOB_CFG
    if [ "$p" = temainjob ]; then   # the same job on the te backend (TE built by the te phase)
      export PYTHONPATH=${TE_SITE:-/tmp/te_site}:$PYTHONPATH
      cfg=$WORK/gpu_llama_d4096_te.yaml
      sed 's/^  backend: torch$/  backend: te/; s/lowprec-gpu-llama-d4096/lowprec-gpu-llama-d4096-te/' "$MAINJOB_CFG" > "$cfg"
      grep -q '^  backend: te$' "$cfg" || { echo "could not set backend: te in $cfg"; return 1; }
    fi
    rm -rf "$out"; mkdir -p "$out"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    # NVML's energy counter (telemetry.energy: auto): nvidia-ml-py is in the image, not carried
    "$PY" -c "import pynvml; pynvml.nvmlInit(); print('NVML driver', pynvml.nvmlSystemGetDriverVersion())" \
      || echo "WARNING: pynvml/NVML unavailable: the energy per token will not be NVML-measured"
    # the expected ratio from the layer table, beside the measured one below
    "$PY" -P -m lowprec.cli plan "$cfg" || true
    "$PY" -P -m lowprec.cli run "$cfg" --as-baseline --run-name bf16-baseline --out "$out/bf16-baseline" || return $?
    "$PY" -P -m lowprec.cli run "$cfg" --out "$out/staged-rollout" || return $?
    "$PY" -P -m lowprec.cli gate --baseline "$(cat "$out/bf16-baseline/run_id")" \
      --candidate "$(cat "$out/staged-rollout/run_id")" --gates gates/default.yaml \
      --markdown "$out/gate.md" --junit "$out/gate.xml" || rc=$?
    echo "Gate verdict (exit $rc): $(case $rc in 0) echo pass;; 1) echo REGRESSION;; *) echo unusable input;; esac)"
    [ "$rc" -le 1 ] ;;
  model)
    # the three sizes in one call, each against torchao's Float8Linear, blocks compiled;
    # 16,384 tokens a step (the layer table's large shapes)
    local size name d layers heads hidden
    for size in "${MODEL_SIZES[@]}"; do
      read -r name d layers heads hidden <<< "$size"
      echo "== model step at $name (d $d, $layers layers)"
      "$PY" experiments/bench_model_step.py --d-model "$d" --layers "$layers" --heads "$heads" --hidden "$hidden" \
        --seq 2048 --batch 8 --steps 6 --warmup 2 --json "$WORK/model_$name.json" || rc=$?
    done
    return "$rc" ;;
  moe)
    # 32 of DeepSeek-V3's experts (hidden 7168, width 2048; a rank's share under EP 8), top 8,
    # 16,384 tokens; then the default CPU shapes, where the launch overheads show
    "$PY" -m experiments.bench_moe --device cuda --hidden 7168 --width 2048 --experts 32 --top-k 8 \
      --tokens 16384 --repeats 5 --warmup 2 | tee "$WORK/moe.md" || rc=$?
    "$PY" -m experiments.bench_moe --device cuda --repeats 5 --warmup 2 | tee -a "$WORK/moe.md" || rc=$?
    return "$rc" ;;
  host)
    # the host's part of a layer step: eager, compiled and CUDA-graph rows against nn.Linear
    "$PY" experiments/bench_host.py --json "$WORK/host.json" ;;
  te)
    export TE_DL=$WHEELS/te
    bash scripts/te_install/install.sh stage
    local stage=${TE_STAGE:-/tmp/te_stage}
    if [ ! -f "$stage/build.pid" ]; then
      if ! bash scripts/te_install/install.sh build; then
        echo "TE: not all parts staged yet; carry the next te/cNN folder in the next call"; return 0
      fi
    fi
    # wait for the background build, leaving a minute of the phase for the tests
    local deadline=$((SECONDS + BUDGET[te] - 90))
    while kill -0 "$(cat "$stage/build.pid")" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 10; done
    bash scripts/te_install/install.sh status || true
    if kill -0 "$(cat "$stage/build.pid")" 2>/dev/null; then
      echo "TE: still building; run 'scripts/gpu_bench.sh te' again in the next call (machine warm)"; return 3
    fi
    grep -q '^== installed' "$stage/build.log" || { echo "TE: the build failed (log above)"; return 1; }
    PYTHONPATH=${TE_SITE:-/tmp/te_site}:$PYTHONPATH "$PY" -m pytest -q -rs -p no:cacheprovider \
      --junitxml="$WORK/tests-te.xml" tests/gpu/test_te_backend.py || rc=$?
    # the layer table's te rows beside torch's and torchao's, the two large shapes
    PYTHONPATH=${TE_SITE:-/tmp/te_site}:$PYTHONPATH "$PY" experiments/bench_linear.py --te \
      --d-model 8192 4096 --tokens 16384 --json "$WORK/linear_te.json" --deadline 60 || rc=$((rc > 0 ? rc : $?))
    return "$rc" ;;
  esac
}

run_phase() {
  local p=$1 t0 rc=0 log=$WORK/$p.log
  need_carried "$p"
  echo "== phase $p (at most ${BUDGET[$p]} s) $(date -u +%FT%TZ)"
  t0=$SECONDS
  set +e
  timeout --kill-after=15 "${BUDGET[$p]}" bash "$SELF" --wheels "$WHEELS" --budget "$p=${BUDGET[$p]}" --inner "$p" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
  echo "== phase $p: exit $rc after $((SECONDS - t0)) s$([ "$rc" = 124 ] || [ "$rc" = 137 ] && echo ' (TIMED OUT)')"
  "$PY" scripts/gpu_bench_report.py --phase "$p" --rc "$rc" --seconds $((SECONDS - t0)) \
    --timeout "${BUDGET[$p]}" --log "$log" --work "$WORK" --out "$OUT_DIR" || echo "report of phase $p failed"
  return "$rc"
}

if [ -n "$INNER" ]; then
  export PYTHONUNBUFFERED=1
  phase_body "$INNER"
  exit $?
fi
if [ "$DRY" = 1 ]; then
  dry_run "${PHASES[@]}"
  exit $?
fi
[ ${#PHASES[@]} -gt 0 ] || die "name the phases to run (${ALL_PHASES[*]}); --dry-run prints the plan"
[ ${#PHASES[@]} -le 3 ] || die "at most 3 phases a call (8 files come back from a device call)"
command -v nvidia-smi >/dev/null 2>&1 || echo "gpu_bench: warning: no nvidia-smi here; these phases need the GPU machine" >&2
mkdir -p "$OUT_DIR" "$WORK"
# the repository on the path: the benchmarks import lowprec and experiments from the checkout
export PYTHONUNBUFFERED=1 PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
install_carried
"$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO GPU')"
status=0
for p in "${PHASES[@]}"; do run_phase "$p" || status=1; done
"$PY" scripts/gpu_bench_report.py --summary --out "$OUT_DIR" --phases "${PHASES[@]}"
exit "$status"
