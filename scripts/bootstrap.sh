#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment with everything the demo and tests need:
# torch (CPU build, pinned for this path), mmm in editable mode, MPI (Open MPI wheel + mpi4py),
# and the test tools. Idempotent: re-running only installs what changed.
#   usage: scripts/bootstrap.sh [VENV_DIR]      (default .venv)
#   env:   PYTHON (interpreter to build the venv from, default python3)
#          TORCH_SPEC (default torch==2.13.0; e.g. "torch" on a cluster that provides its own index)
#          MMM_EXTRAS (default dev,mpi,deepspeed,hf,data,float8,wandb,tensorboard)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=${MMM_EXTRAS:-dev,mpi,deepspeed,hf,data,float8,wandb,tensorboard}

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "bootstrap: error: $PYTHON is missing or older than 3.10; set PYTHON=/path/to/python3.10+" >&2
  exit 2
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "bootstrap: creating $VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "bootstrap: installing $TORCH_SPEC"
  "${PIP[@]}" "$TORCH_SPEC"
fi
echo "bootstrap: installing mmm[$EXTRAS]"
"${PIP[@]}" -e ".[$EXTRAS]" "$TORCH_SPEC" 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -c "import torch, mmm; print(f'bootstrap: ready: torch {torch.__version__}, mmm {mmm.__version__}')"
