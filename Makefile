# `make demo` and `make test` work on a fresh machine: they build .venv themselves.
VENV ?= .venv
STAMP := $(VENV)/.mmm-installed
NPROC ?= 4
# pytest workers: tests wait on processes much of the time, so three share two cores well
# (docs/testing.md); tests that use the machine's namespaces, Slurm or MPI environments run one at a
# time (tests/conftest.py), and the real Slurm's own tests run after the others, alone
TEST_WORKERS ?= 3
# the slowest tests listed at the end of `make test` (0: all of them)
DURATIONS ?= 40
export OMP_NUM_THREADS ?= 1
# the interpreter .venv is built from (PYTHON=/path/to/python3 to choose): the system's python3 where it is
# 3.10+ with venv, as distributions build CPython with profile-guided and link-time optimisation (pyenv's
# default build has neither: a rank of the tiny trainer took 18% more CPU on it, docs/testing.md), else
# the first python3 on PATH
PYTHON ?= $(shell /usr/bin/python3 -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 10))' \
	2>/dev/null && echo /usr/bin/python3 || echo python3)
export PYTHON

.PHONY: demo smoke test test-fast durations test-deps lint format venv clean pyc

$(STAMP): pyproject.toml scripts/bootstrap.sh
	bash scripts/bootstrap.sh $(VENV)
	touch $(STAMP)

venv: $(STAMP)

# mmm's own bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (or src/ is read-only to the ranks),
# every rank would otherwise compile the sources it imports (~80 ms of CPU a rank for the trainer's 75
# modules; the suite starts thousands of ranks). Up-to-date files are skipped, so this costs ~0.3 s.
pyc: $(STAMP)
	$(VENV)/bin/python -m compileall -q src

demo: pyc
	$(VENV)/bin/launch -n $(NPROC) python3 -m mmm.examples.fsdp_tp --tpsize 2

smoke: pyc
	$(VENV)/bin/launch -n $(NPROC) python3 -m mmm --tp 2

# Slurm + munge for the real-launcher tests (root + apt-get only; otherwise those tests skip, saying why)
test-deps:
	bash scripts/test_deps.sh

# ruff: lint + formatting (configured in pyproject.toml); `make format` rewrites in place
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: pyc test-deps lint
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not alone" --durations=$(DURATIONS)
	$(VENV)/bin/python -m pytest -q -m alone --durations=5

# the fast layer, for the edit-test loop (<= 5 minutes on 2 cores): the tests a whole run measured at 6 s or
# less (tests/durations.json), new ones, and those marked fast (tests/conftest.py)
test-fast: pyc
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not slow and not alone"

# after a whole `make test`: its measured test times become the fast layer's record
durations:
	cp .pytest_cache/mmm-durations.json tests/durations.json

clean:
	rm -rf $(VENV) outputs .pytest_cache
