#!/usr/bin/env bash
# Build (once) a virtual environment with another MPI's mpiexec for the real-launcher tests:
# MPICH (PyPI `mpich`) or Intel MPI (PyPI `impi-rt`), each with its own mpi4py. Everything else
# (torch, mmm, ...) comes from the main venv through a .pth line, so each is ~70-330 MB, ~10 s.
#   usage: scripts/mpi_env.sh mpich|impi [DIR]     (default DIR: .venvs/<name>)
#   env:   BASE_VENV (the main venv, default .venv)
# Prints the environment's folder on success; exits 1 with one line saying why otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=${1:?usage: scripts/mpi_env.sh mpich|impi [DIR]}
DIR=${2:-.venvs/$NAME}
BASE=${BASE_VENV:-.venv}
case "$NAME" in
  mpich) PKG=mpich ;;
  impi) PKG=impi-rt ;;
  *) echo "mpi_env: unknown MPI '$NAME'; choose mpich or impi" >&2; exit 2 ;;
esac
STAMP="$DIR/.mmm-mpi-env"
mkdir -p "$(dirname "$DIR")"
exec 9>"$DIR.lock"  # one build at a time (pytest workers may ask at once); the others wait, then reuse it
flock 9
if [ -f "$STAMP" ] && [ -x "$DIR/bin/mpiexec" ]; then
  echo "$DIR"; exit 0
fi
BASE_SITE=$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || {
  echo "mpi_env: no base venv at $BASE (run 'make venv' first)" >&2; exit 1; }
BASE_PY=$("$BASE/bin/python" -c 'import sys; print(sys._base_executable)')
rm -rf "$DIR"
# no pip of its own (ensurepip failed now and then under load): the main venv's pip installs into it
"$BASE_PY" -m venv --without-pip "$DIR" >&2
if ! "$BASE/bin/python" -m pip --python "$DIR/bin/python" install -q --disable-pip-version-check "$PKG" mpi4py \
  >"$DIR.log" 2>&1; then
  echo "mpi_env: pip install $PKG mpi4py failed: $(grep -v '^WARNING' "$DIR.log" | tail -n 1)" >&2
  exit 1
fi
SITE=$("$DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# this venv's own mpi4py and MPI first; torch, mmm and the rest from the main venv
echo "import site; site.addsitedir('$(cd "$BASE_SITE" && pwd)')" >"$SITE/zz_mmm_base_venv.pth"
"$DIR/bin/python" -c 'import mmm, torch, mpi4py' >&2
touch "$STAMP"
echo "$DIR"
