"""mmm under MPICH's and Intel MPI's own ``mpiexec`` (Hydra), for real.

Each MPI lives in its own virtual environment (``scripts/mpi_env.sh``: PyPI ``mpich`` or ``impi-rt``
plus an mpi4py that loads that MPI; torch and mmm from the main venv), built on first use and
kept under ``.venvs/``. Open MPI, the main venv's, runs throughout the rest of the suite.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest

from conftest import assert_clean_user_error, env_of, mpi_env, run, signal_promise

TINY = ["--dim", "64", "--n-layers", "2", "--seq-len", "32", "--batch-size", "8", "--no-plots", "--log-every", "100"]
FLAVORS = {"mpich": "HYDRA build details", "impi": "Intel(R) MPI"}  # what `mpiexec --version` says


@pytest.fixture(scope="session", params=sorted(FLAVORS))
def mpi(request):
    """(name, env dir) of an MPI's environment, built once; skipped with the reason when it cannot be."""
    return request.param, mpi_env(request.param)


def launch_in(envdir: Path, *args: str) -> list[str]:
    return [str(envdir / "bin" / "python"), "-m", "mmm.launch", *args]


def test_its_mpiexec_is_the_one_used(mpi):
    name, envdir = mpi
    version = run([str(envdir / "bin" / "mpiexec"), "--version"], env=env_of(envdir), timeout=30).output
    assert FLAVORS[name].lower() in version.lower(), version
    res = run(launch_in(envdir, "--dry-run", "-n", "4", "python3", "-m", "mmm"), env=env_of(envdir), timeout=60)
    assert res.returncode == 0 and f"{envdir / 'bin' / 'mpiexec'} -n 4 -ppn 4" in res.stdout, res.output


def test_smoke_test_through_launch(mpi):
    name, envdir = mpi
    res = run(launch_in(envdir, "-n", "4", "python3", "-m", "mmm", "--tp", "2"), env=env_of(envdir), timeout=120)
    assert res.returncode == 0, res.output
    assert (
        "via mpiexec (hydra)" in res.stderr
        and "smoke test passed: 6 all-reduce checks on each of 4 ranks" in res.output
    ), res.output
    assert "TCPStore" not in res.stderr and "Traceback" not in res.stderr, res.stderr  # a quiet, clean exit


def test_a_finished_job_is_not_killed_by_hydra(mpi, tmp_path):
    """After MPI_Finalize a rank must leave by a normal process exit: Hydra's proxy SIGKILLs the other
    ranks of a job whose rank vanished by _exit (rc 9 after 'smoke test passed', mostly when a shell
    follows python in the rank's command)."""
    name, envdir = mpi
    py = envdir / "bin" / "python"
    # (once: every other test of this file ends a job under the same Hydra, each a check of this too)
    res = run(
        [str(envdir / "bin" / "mpiexec"), "-n", "4", "bash", "-c", f"{py} -m mmm --tp 2; exit $?"],
        env=env_of(envdir),
        timeout=120,
    )
    assert res.returncode == 0 and "smoke test passed" in res.output, res.output
    # after training too (torch's thread-local destructors must not run at that exit: rc 134)
    train = f"{py} -m mmm.examples.fsdp_tp {' '.join(TINY)} --max-iters 2 --outdir {tmp_path / 'out'}; exit $?"
    res = run([str(envdir / "bin" / "mpiexec"), "-n", "2", "bash", "-c", train], env=env_of(envdir), timeout=180)
    assert res.returncode == 0 and "done: final loss" in res.output, res.output


def test_fsdp_tp_trainer_through_launch(mpi, tmp_path):
    name, envdir = mpi
    res = run(
        launch_in(
            envdir,
            "-n",
            "4",
            "python3",
            "-m",
            "mmm.examples.fsdp_tp",
            "--tpsize",
            "2",
            *TINY,
            "--max-iters",
            "3",
            "--outdir",
            str(tmp_path),
        ),
        env=env_of(envdir),
        timeout=240,
    )
    assert res.returncode == 0, res.output
    rows = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in rows] == [1, 2, 3]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["launcher"].startswith("launch/mpiexec"), summary
    assert not (tmp_path / "stacks").exists()  # nothing failed: no stack files left behind


def test_a_killed_rank_ends_the_job_fast_naming_only_it(mpi, tmp_path):
    name, envdir = mpi
    res = run(
        launch_in(
            envdir,
            "-n",
            "4",
            "python3",
            "-m",
            "mmm.examples.fsdp_tp",
            "--tpsize",
            "2",
            *TINY,
            "--max-iters",
            "30",
            "--outdir",
            str(tmp_path),
        ),
        env=env_of(envdir, MMM_FAULT="kill@3:1", MMM_TIMEOUT="120"),
        timeout=180,
    )
    assert res.returncode != 0, res.output
    assert res.seconds < 60, res.seconds
    named = [ln for ln in res.stderr.splitlines() if "stopped answering" in ln]
    assert all("error: rank 1 stopped answering" in ln for ln in named), named
    if name == "impi":  # Intel MPI lets the survivors speak
        assert named, res.output
    # MPICH's Hydra SIGKILLs the survivors at once and names some process (rank 0's, measured): launch
    # watches the ranks and names the one that died first, under both
    died = [ln for ln in res.stderr.splitlines() if "died first" in ln]
    assert len(died) == 1 and died[0].startswith("launch: error: rank 1 (pid "), res.stderr
    assert "Traceback" not in res.stderr and "frame #" not in res.stderr, res.stderr  # nor c10d's C++ stacks
    rows = [json.loads(line)["iter"] for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    # the finished steps are on disk; under MPICH step 2 may be lost with its late read (Hydra SIGKILLs
    # every rank within milliseconds, before rank 0 writes a step whose values it reads one step late)
    assert rows == [1, 2] or name == "mpich" and rows == [1], rows


def test_mpi4py_of_another_mpi_is_named_not_a_hang(mpi):
    """The main venv's mpi4py loads Open MPI; under MPICH's or Intel MPI's mpiexec every process sees a
    1-rank world and each would wait as rank 0 of its own job until the timeout. mmm compares the two
    world sizes and says what to do, in one line, on every rank."""
    _, envdir = mpi
    cmd = [str(envdir / "bin" / "mpiexec"), "-n", "2", sys.executable, "-m", "mmm", "--tp", "2"]
    res = run(cmd, env=env_of(envdir, MMM_TIMEOUT="300"), timeout=120)
    assert res.returncode != 0 and res.seconds < 60, res.output
    assert_clean_user_error(res, "sees a world of 1 rank(s) but the launcher (mpich) started 2")
    assert "suspicious MPI execution environment" not in res.output


def test_signals_reach_every_rank_and_stop_the_job(mpi, tmp_path):
    """launch's signal promise under Hydra: SIGUSR1 passes through mpiexec; SIGUSR2, which kills Hydra's
    mpiexec, launch delivers itself (its rank watch: each rank's noted process); SIGHUP (MPICH) and SIGQUIT
    (Intel MPI) stop the job with nothing left running."""
    name, envdir = mpi
    cmd = [str(envdir / "bin" / "python"), "-m", "mmm.launch", "--launcher", "mpiexec"]
    signal_promise(cmd, env_of(envdir), tmp_path / "out", signal.SIGQUIT if name == "impi" else signal.SIGHUP)
