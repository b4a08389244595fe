# Two commands on a fresh machine:  `make run` (set up, then the embedded default: a tiny real training run)
# and `make test` (set up, then the test suite). Both create/refresh the virtual environment in .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MEGATRON_CORE := megatron-core==0.19.2

.PHONY: setup run test test-fast test-gpu bench clean

# Lanes (pytest marks given by tests/conftest.py from what each test does): `make test-fast` is the login node,
# validation, planner, render and unit tests (no multi-rank training, no Slurm, no GPU), on both cores;
# `make test` is everything (CI runs it); `make test-gpu` the GPU lane (tests/gpu/lane.py, on a GPU node).
FAST := not multirank and not slurm and not gpu and not slow

setup: $(VENV)/.installed

# A quiet first screen: pip at -qq (errors only: no build-backend notes such as setuptools' "Editable
# installation" banner, no index warnings from a machine's pip.conf). megatron-core declares Python>=3.12 but
# its wheel works on 3.11 (see DESIGN.md); no deps: torch is pinned above. The import check runs without
# Megatron-Core's four "Transformer Engine and Apex are not installed" fallback warnings (expected on CPU;
# silenced for this one check only, the ranks still print them).
$(VENV)/.installed: pyproject.toml constraints/cpu.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -qq --upgrade pip
	$(PY) -m pip install -qq -c constraints/cpu.txt -e '.[train,dev]'
	$(PY) -c 'import sys; sys.exit(sys.version_info >= (3, 12))' && \
	  $(PY) -m pip install -qq --no-deps --ignore-requires-python $(MEGATRON_CORE) || true
	$(PY) -W 'ignore:Transformer Engine and Apex are not installed:UserWarning' -c 'import megatron.core, torch, launcher' && touch $@

run: setup
	$(PY) -m launcher

# `make test` runs everything in one session, three pytest-xdist workers on the two cores (--dist loadgroup): the
# Slurm, hang and restart tests spend much of their time waiting on timers, which a third worker fills (measured on
# 2 cores: 1,762 s with 3 workers, 1,918 s with 2); in-process tests one at a time, rank and Slurm tests in groups
# (tests/conftest.py `_xdist_group`: one worker holds the Slurm cluster, one the shared reference runs, a module its
# trained fixtures), the biggest units first (conftest `LONGEST`).
test: setup
	$(PY) -m pytest -q -n 3 --dist loadgroup --durations=30 tests

test-fast: setup
	$(PY) -m pytest -q -n 2 --durations=10 -m '$(FAST)' tests

# The GPU lane runs in the GPU image's own Python (its torch, Transformer Engine, NCCL): never the CPU venv, so
# no `setup`. One command, a 15-minute budget on one 8-GPU node, one report (gpu-lane/gpu-lane-report.{json,txt}).
GPU_PYTHON ?= python3
test-gpu:
	$(GPU_PYTHON) tests/gpu/lane.py

clean:
	rm -rf $(VENV) runs
