# Two commands on a fresh machine:  `make run` (set up, then the embedded default: a tiny real training run)
# and `make test` (set up, then the test suite). Both create/refresh the virtual environment in .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MEGATRON_CORE := megatron-core==0.19.2

.PHONY: setup run test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints/cpu.txt Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints/cpu.txt -e '.[train,dev]'
	# megatron-core declares Python>=3.12 but its wheel works on 3.11 (see DESIGN.md); no deps: torch is pinned above.
	$(PY) -c 'import sys; sys.exit(sys.version_info >= (3, 12))' && \
	  $(PY) -m pip install -q --no-deps --ignore-requires-python $(MEGATRON_CORE) || true
	$(PY) -c 'import megatron.core, torch, launcher' && touch $@

run: setup
	$(PY) -m launcher

test: setup
	$(PY) -m pytest -q --durations=25 tests

clean:
	rm -rf $(VENV) runs
