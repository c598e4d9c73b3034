"""The shipped PBS job scripts (examples/jobs/): each runs as the scheduler would run it, on a fake
PBS_NODEFILE, with `launch` in --dry-run mode, and its launch line must become the expected mpiexec
command. (The Slurm script runs for real in test_slurm.py.)"""

import shlex
import sys
from pathlib import Path

import pytest

from conftest import BIN, clean_env, run

JOBS = Path(__file__).resolve().parents[1] / "examples" / "jobs"
TRAINER = [sys.executable, "-m", "mmm.examples.fsdp_tp", "--tpsize", "2"]


def dry_run_job(script: str, tmp_path, hosts: list[str], slots: int, **env: str) -> tuple[str, list[str], dict]:
    """Run a job script under bash as PBS would, with `launch` printing instead of running.
    Returns launch's summary line, the mpiexec argv and the variables it sets."""
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("".join(f"{h}\n" * slots for h in hosts))
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "launch").write_text(f'#!/bin/sh\nexec {shlex.quote(str(BIN / "launch"))} --dry-run "$@"\n')
    (shim / "launch").chmod(0o755)
    work = tmp_path / "submitted-from"
    work.mkdir()
    full_env = clean_env(
        PBS_NODEFILE=str(nodefile),
        PBS_JOBID="42.pbs",
        PBS_O_WORKDIR=str(work),
        MMM_GPUS_PER_NODE="0",
        PATH=f"{shim}:/usr/bin:/bin",
        **env,
    )
    res = run(["bash", str(JOBS / script)], env=full_env, cwd=tmp_path, timeout=60)
    assert res.returncode == 0, res.output
    lines = res.stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("# "))
    words = shlex.split(next(ln for ln in lines[head + 1 :] if not ln.startswith("#")))  # after what is added
    n_env = next(i for i, w in enumerate(words) if "=" not in w)
    return lines[head][2:], words[n_env:], dict(w.split("=", 1) for w in words[:n_env])


def test_pbs_script_openmpi(tmp_path):
    summary, argv, env = dry_run_job(
        "pbs.sh", tmp_path, ["x1001", "x1002"], 4, MMM_MPI_FLAVOR="openmpi", MMM_ARGS="--max-iters 7 --dim 64"
    )
    assert summary == "8 ranks (4 per host) on 2 hosts via mpiexec (openmpi); scheduler: pbs"
    assert Path(argv[0]).name == "mpiexec" and argv[1:3] == ["-n", "8"]
    assert argv[argv.index("--map-by") + 1] == "ppr:4:node"
    assert argv[argv.index("--hostfile") + 1] == str(tmp_path / "nodefile")
    assert [argv[i + 1] for i, w in enumerate(argv) if w == "-x"][:2] == ["MASTER_ADDR", "MASTER_PORT"]
    assert argv[-len(TRAINER) - 4 :] == [*TRAINER, "--max-iters", "7", "--dim", "64"]
    assert env["MASTER_ADDR"] == "x1001" and env["MMM_LAUNCHER"] == "launch/mpiexec"


def test_pbs_script_hydra(tmp_path):
    summary, argv, env = dry_run_job("pbs.sh", tmp_path, ["x1001", "x1002", "x1003"], 4, MMM_MPI_FLAVOR="hydra")
    assert summary == "12 ranks (4 per host) on 3 hosts via mpiexec (hydra); scheduler: pbs"
    assert argv[1:5] == ["-n", "12", "-ppn", "4"] and argv[argv.index("-hostfile") + 1] == str(tmp_path / "nodefile")
    assert argv[argv.index("MASTER_ADDR") - 1 : argv.index("MASTER_ADDR") + 2] == ["-genv", "MASTER_ADDR", "x1001"]
    assert argv[-len(TRAINER) :] == TRAINER


def test_aurora_script_uses_pals_one_rank_per_tile(tmp_path):
    summary, argv, env = dry_run_job("aurora.sh", tmp_path, ["x4102c1s0b0n0", "x4102c1s1b0n0"], 1)
    assert summary == "24 ranks (12 per host) on 2 hosts via mpiexec (pals); scheduler: pbs"
    assert argv[1:7] == ["-n", "24", "--ppn", "12", "--hostfile", str(tmp_path / "nodefile")]
    assert "MASTER_ADDR=x4102c1s0b0n0" in argv and f"MASTER_PORT={env['MASTER_PORT']}" in argv
    bind = argv.index("--cpu-bind")
    assert argv[bind + 1].startswith("list:1-8:9-16:") and argv[bind + 2 :] == TRAINER


@pytest.mark.parametrize("script", ["pbs.sh", "aurora.sh", "slurm.sbatch"])
def test_job_scripts_are_valid_bash(script):
    res = run(["bash", "-n", str(JOBS / script)], timeout=30)
    assert res.returncode == 0, res.output
