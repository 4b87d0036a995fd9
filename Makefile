# The README's two commands: `make run` (the main job) and `make test`.
# Each creates .venv and installs what it needs; torch==2.13.0 is installed first
# so that pip takes the local CPU build instead of a multi-GB CUDA one.
PY ?= python3
# The install does not byte-compile (below); each module is compiled the first time a process
# imports it, and cached for the next only where Python may write .pyc files: an environment with
# PYTHONDONTWRITEBYTECODE set (this one's machine has it) would compile torch's, MLflow's and the
# others' modules again in every process (5 s more for `import lowprec.cli, mlflow.tracking,
# torch._dynamo`, measured 2026-12-02), so these commands do not pass it on.
unexport PYTHONDONTWRITEBYTECODE
VENV := .venv
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	@# --no-compile: pip does not byte-compile every installed module (half of the install's time on
	@# a 2-core machine: 84 s against 172 s, measured 2026-12-02); Python compiles and caches the
	@# modules a process imports the first time it imports them (see PYTHONDONTWRITEBYTECODE above)
	$(VENV)/bin/pip install -q --no-compile torch==2.13.0
	$(VENV)/bin/pip install -q --no-compile -e '.[dev,hf,lightning,torchtitan,torchao]'
	@# a build leaves lowprec.egg-info here; from this folder it would shadow the installed
	@# metadata (and its entry points) once pyproject.toml changes
	rm -rf lowprec.egg-info
	touch $(STAMP)

.PHONY: setup run test test-fast bench gpu-prep gpu-dry-run

# `make test`: three pytest workers (pytest-xdist) on the two cores, a unit of work each at a time: a
# test file, or all the files whose tests launch several processes (one unit, run on one worker while
# the others run the rest), in the order tests/conftest.py gives (the long ones first, so that the
# workers end together: --no-loadscope-reorder, since xdist would otherwise order the units by their
# number of tests). Three, not two: many tests wait (for a server to answer, a process to die, a step
# that sleeps while it is killed), and two workers left part of the cores idle: the whole run took
# 939 s with two and 839 s with three (194% CPU), measured 2026-12-04 on a 2-core machine; a fresh
# clone's `make test`, set-up included, 786 s there once the distributed tests forked their ranks.
# One BLAS thread per process, so that the workers do not oversubscribe the cores further (the
# processes the tests start inherit it).
PYTEST := OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest -q
setup: $(STAMP)

# The main job: the default config's BF16 baseline, then its staged rollout (the loss-gap
# baseline is that run, by name), then the CI gate between the two; tracked in ./mlflow.db.
CONFIG ?= experiments/configs/default.yaml
run: $(STAMP)
	@out=runs/main/$$(date +%Y%m%d-%H%M%S); \
	$(VENV)/bin/lowprec run $(CONFIG) --as-baseline --run-name bf16-baseline --out $$out/bf16-baseline && \
	$(VENV)/bin/lowprec run $(CONFIG) --out $$out/staged-rollout && \
	{ $(VENV)/bin/lowprec gate --baseline $$(cat $$out/bf16-baseline/run_id) \
	    --candidate $$(cat $$out/staged-rollout/run_id) --gates default \
	    --markdown $$out/gate.md --junit $$out/gate.xml; code=$$?; \
	  echo "Gate verdict (exit $$code): $$(case $$code in 0) echo pass;; 1) echo REGRESSION;; *) echo unusable input;; esac)"; \
	  echo "Open the UI: $(VENV)/bin/lowprec ui   (then http://127.0.0.1:5000)"; \
	  echo "Pictures:    $(VENV)/bin/lowprec report $$(cat $$out/staged-rollout/run_id) --out $$out/report"; \
	  [ $$code -le 1 ]; }

# The MLflow UI screenshot test needs Debian's chromium, and the PostgreSQL-backed tracking
# test Debian's postgresql: installed here where missing and apt-get can (root); otherwise
# those tests skip and say why. Without the packages they only recommend: chromium's are 131
# packages against 25 (19 s against 12 s, measured 2026-12-04), and the screenshot renders alike.
test: $(STAMP)
	@if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing chromium for the MLflow UI screenshot test"; \
		( DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 || \
		  ( apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 ) ) || \
		echo "chromium could not be installed; the screenshot test will skip"; \
	fi
	@# The tracking tests against a PostgreSQL-backed MLflow server need Debian's postgresql
	@# (the test starts a private cluster on 127.0.0.1); likewise installed where it can be.
	@if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then \
		echo "installing postgresql for the PostgreSQL-backed tracking test"; \
		( DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql >/dev/null 2>&1 || \
		  ( apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql >/dev/null 2>&1 ) ) || \
		echo "postgresql could not be installed; the PostgreSQL tracking test will skip"; \
	fi
	$(PYTEST) -n 3 --dist loadfile --no-loadscope-reorder -x --durations=15

# For iteration: everything but the slow tests (under 2 minutes).
test-fast: $(STAMP)
	$(PYTEST) -n 3 --dist loadfile --no-loadscope-reorder -x -m "not slow"

bench: $(STAMP)
	$(VENV)/bin/python experiments/bench_quantize.py

# The H100 run (docs/performance.md, "Running the H100 benchmarks"): download here, with the
# registry, every wheel the GPU machine's image lacks (torchao, the main job's dependencies,
# Transformer Engine in carry-sized parts) and the corpora into the ignored folder .whl/, with
# .whl/MANIFEST.tsv (sha256 and device call of each file); then check it all and print the plan.
# NO_TE=1 leaves Transformer Engine (280 MB) out.
gpu-prep: $(STAMP)
	$(VENV)/bin/python scripts/gpu_prep.py --out .whl $(if $(NO_TE),--no-te)
	PY=$(VENV)/bin/python bash scripts/gpu_bench.sh --dry-run $(if $(NO_TE),mainjob model host)

gpu-dry-run: $(STAMP)
	PY=$(VENV)/bin/python bash scripts/gpu_bench.sh --dry-run
