# The two commands that do everything on a fresh machine:
#   make sweep   -- the main job: every case through papermill, evidence in runs/<timestamp>/
#   make test    -- the test suite (lint, engine tests, cases, kit tests, nbval); make test-slow: the rest
PYTHON ?= python3
PIP := $(PYTHON) -m pip install --quiet --disable-pip-version-check -c constraints.txt

.PHONY: setup sweep bench test test-slow lint notebooks mutants conformance trainers explore device-check test-torch test-torch-matrix
.DEFAULT_GOAL := test

# torch 2.13.0 is pinned (constraints.txt): it is the CPU build on local disk.
setup:
	$(PIP) torch==2.13.0
	$(PIP) -e ".[test]"
	$(PYTHON) kernels/install.py

# The main job: every case of every level through papermill on one warm cluster (e.g. SWEEP_ARGS="--levels L0").
sweep: setup
	IPP_NONINTERACTIVE=1 $(PYTHON) -m tests.kit.sweep $(SWEEP_ARGS)

# Re-record the committed notebooks' outputs (what nbval compares against).
notebooks: setup
	IPP_NONINTERACTIVE=1 $(PYTHON) notebooks/build.py --record

# Every plan case against each implementation (ours, torch FSDP2, and upstream HyperParallel when
# UPSTREAM=/path/to/hyper-parallel is given): runs/<timestamp>/conformance.html
conformance: setup
	IPP_NONINTERACTIVE=1 $(PYTHON) -m tests.kit.front.conformance --implementation ours= --implementation fsdp2=torch \
		$(if $(UPSTREAM),--implementation upstream=upstream:$(UPSTREAM))

# A real trainer as a judge (never in `make test` or .ci/run; installs torchtitan and Lightning into
# .venvs/trainers): TRAINER=torchtitan (default) or lightning; ours against torch FSDP2 (and upstream
# where UPSTREAM=/path/to/hyper-parallel): runs/trainers-<time>/
trainers: setup
	$(PYTHON) -m tools.trainers $(or $(TRAINER),torchtitan) --implementation ours= \
		$(if $(UPSTREAM),--implementation upstream=upstream:$(UPSTREAM)) $(if $(CONFIGS),--configs "$(CONFIGS)")

# Mutation harness (never in `make test` or .ci/run): ONLY=03,07  SUITE=cases|engine|both  CASES=L1-03,L0-06
mutants:
	IPP_NONINTERACTIVE=1 $(PYTHON) -m tools.mutants $(if $(ONLY),--only $(ONLY)) $(if $(SUITE),--suite $(SUITE)) \
		$(if $(CASES),--cases $(CASES)) $(MUTANTS_ARGS)

bench:
	$(PYTHON) benchmarks/bench_fsdp2.py

# L4, the generalization explorer: EXAMPLES configurations drawn from SEED, world sizes up to
# MAX_WORLD, against IMPLEMENTATION (a spec; empty: ours). Exits 1 with the minimal failing
# configuration, saved under runs/l4/ (replay: python -m tests.kit.explore --replay ID).
EXAMPLES ?= 100
SEED ?= 0
MAX_WORLD ?= 4
explore: setup
	IPP_NONINTERACTIVE=1 $(PYTHON) -m tests.kit.explore --examples $(EXAMPLES) --seed $(SEED) --max-world $(MAX_WORLD) \
		$(if $(IMPLEMENTATION),--implementation $(IMPLEMENTATION))

# Other torch releases, each in a venv of its own under .venvs/ (PyPI's builds are several GB: never
# part of make test or .ci/run): TORCH=2.9.1 [UPSTREAM=/path/to/hyper-parallel]. The plan cases for
# ours and torch FSDP2 (and upstream), our engine tests; runs/torch-matrix-<time>/index.html.
test-torch:
	$(if $(TORCH),,$(error make test-torch needs TORCH=RELEASE, e.g. make test-torch TORCH=2.9.1))
	IPP_NONINTERACTIVE=1 $(PYTHON) -m tools.torch_matrix --torch $(TORCH) $(if $(UPSTREAM),--upstream $(UPSTREAM)) \
		$(TORCH_ARGS)

# 2.6.0, 2.7.1, 2.9.1, 2.13.0, 2.14.1 and the newest that installs here, nbval on 2.9.1 too;
# UPSTREAM=PATH judges upstream on 2.9.1 (the torch it names) and 2.13.0 (UPSTREAM_ON=... to change).
UPSTREAM_ON ?= 2.9.1,2.13.0
test-torch-matrix:
	IPP_NONINTERACTIVE=1 $(PYTHON) -m tools.torch_matrix --matrix \
		$(if $(UPSTREAM),--upstream $(UPSTREAM) --upstream-on $(UPSTREAM_ON)) $(TORCH_ARGS)

# On a machine with an accelerator: the engine there at world size 1, then the benchmark.
device-check:
	bash tools/device_check.sh

lint:
	$(PYTHON) -m ruff check .

# The notebooks first: nbval runs every plan case there (on a cluster computing with other CPU
# arithmetic than the recording's: the recorded text must hold anyway), and the pytest case of
# each id judges that same verdict (conftest.py). Tests marked slow (L3's networks, other launchers,
# clusters of their own in subprocesses) are left to `make test-slow`; docs/testing.md lists them.
NBVAL := --nbval --nbval-sanitize-with notebooks/nbval_sanitize.cfg
test: setup lint
	IPP_NONINTERACTIVE=1 $(PYTHON) -m pytest -q -m "not slow" notebooks tests $(NBVAL)

# The rest of the suite: `make test test-slow` runs every test.
test-slow: setup
	IPP_NONINTERACTIVE=1 $(PYTHON) -m pytest -q -m slow notebooks tests $(NBVAL)
