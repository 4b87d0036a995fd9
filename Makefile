# The README's two commands: `make run` (the main job) and `make test`.
# Each creates .venv and installs what it needs; torch==2.13.0 is installed first
# so that pip takes the local CPU build instead of a multi-GB CUDA one.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $(STAMP)

.PHONY: setup run test bench
setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/python -m experiments.run_default

# The MLflow UI screenshot test needs Debian's chromium: installed here where it is missing
# and apt-get can (root); otherwise that test skips and says why.
test: $(STAMP)
	@if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing chromium for the MLflow UI screenshot test"; \
		( DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 || \
		  ( apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 ) ) || \
		echo "chromium could not be installed; the screenshot test will skip"; \
	fi
	$(VENV)/bin/python -m pytest -q -x --durations=15

bench: $(STAMP)
	$(VENV)/bin/python experiments/bench_quantize.py
