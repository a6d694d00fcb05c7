# The two commands that do everything on a fresh machine:
#   make sweep   -- the main job
#   make test    -- the whole test suite (lint, engine tests, kit tests)
PYTHON ?= python3
PIP := $(PYTHON) -m pip install --quiet --disable-pip-version-check -c constraints.txt

.PHONY: setup sweep bench test lint
.DEFAULT_GOAL := test

# torch 2.13.0 is pinned (constraints.txt): it is the CPU build on local disk.
setup:
	$(PIP) torch==2.13.0
	$(PIP) -e ".[test]"

# The main job. Until the notebook sweep lands it runs the engine benchmark against torch FSDP2.
sweep: setup bench

bench:
	$(PYTHON) benchmarks/bench_fsdp2.py

lint:
	$(PYTHON) -m ruff check .

test: setup lint
	$(PYTHON) -m pytest -q
