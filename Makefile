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
	$(VENV)/bin/python experiments/bench_quantize.py

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -x --durations=15

bench: $(STAMP)
	$(VENV)/bin/python experiments/bench_quantize.py
