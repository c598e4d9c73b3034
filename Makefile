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

.PHONY: demo smoke test test-fast durations test-deps lint format venv clean

$(STAMP): pyproject.toml scripts/bootstrap.sh
	bash scripts/bootstrap.sh $(VENV)
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/launch -n $(NPROC) python3 -m mmm.examples.fsdp_tp --tpsize 2

smoke: $(STAMP)
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

test: $(STAMP) test-deps lint
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not alone" --durations=$(DURATIONS)
	$(VENV)/bin/python -m pytest -q -m alone --durations=5

# the fast layer, for the edit-test loop (<= 5 minutes on 2 cores): the tests a whole run measured at 6 s or
# less (tests/durations.json), new ones, and those marked fast (tests/conftest.py)
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not slow and not alone"

# after a whole `make test`: its measured test times become the fast layer's record
durations:
	cp .pytest_cache/mmm-durations.json tests/durations.json

clean:
	rm -rf $(VENV) outputs .pytest_cache
