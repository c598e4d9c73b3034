"""launch's signal promise, under every launcher the suite runs (docs/launch.md): SIGUSR1 and SIGUSR2 sent to
launch reach every rank and the job goes on (SIGUSR1: each mmm rank writes its stacks); SIGHUP and SIGQUIT
stop the job: every rank ends, nothing is left running, and ``--retries`` does not relaunch it. Here the local
spawner and Open MPI; Hydra (MPICH, Intel MPI) in test_mpi_flavors.py, srun in test_slurm.py.

Where a launcher does not pass a signal on (Hydra's mpiexec dies of SIGUSR2), launch delivers it itself
through its rank watch; where it does not survive one with its ranks (Open MPI's prterun and SIGQUIT), launch
sends it SIGTERM instead.
"""

from __future__ import annotations

import signal

import pytest

from conftest import BIN, clean_env, signal_promise


@pytest.mark.parametrize(
    "launcher, stop", [("local", signal.SIGHUP), ("mpiexec", signal.SIGQUIT)], ids=["local-hup", "openmpi-quit"]
)
def test_signals_under_launch(tmp_path, launcher, stop):
    signal_promise([str(BIN / "launch"), "--launcher", launcher], clean_env(), tmp_path / "out", stop)
