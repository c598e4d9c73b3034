# `make demo` and `make test` work on a fresh machine: they build .venv themselves.
VENV ?= .venv
STAMP := $(VENV)/.mmm-installed
NPROC ?= 4
export OMP_NUM_THREADS ?= 1

.PHONY: demo smoke test test-fast test-deps venv clean

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

test: $(STAMP) test-deps
	$(VENV)/bin/python -m pytest -q --durations=15

test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) outputs .pytest_cache
