"""Real Slurm: a one-node cluster on this host (the `slurm_cluster` fixture) runs mmm under salloc,
plain srun (with and without PMI-2), sbatch of the shipped job script, and a rank killed mid-run."""

import contextlib
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import BIN, jsonl, run, signal_promise, until_steps

REPO = Path(__file__).resolve().parents[1]
JOB_SCRIPT = REPO / "examples" / "jobs" / "slurm.sbatch"
TINY = ["--dim", "64", "--n-layers", "2", "--seq-len", "32", "--batch-size", "8", "--no-plots"]


def banner(output: str) -> str:
    lines = [ln for ln in output.splitlines() if " | launcher=" in ln]
    assert len(lines) == 1, output  # rank 0 only
    return lines[0]


def test_salloc_launch_runs_the_smoke_test(slurm_cluster):
    res = run(
        ["salloc", "-n", "4", str(BIN / "launch"), "python3", "-m", "mmm", "--tp", "2"],
        env=slurm_cluster.environ(),
        timeout=120,
    )
    assert res.returncode == 0, res.output
    assert "launch: 4 ranks (4 per host) on 1 host via srun; scheduler: slurm" in res.stderr, res.output
    assert "launcher=launch/srun world=4 nodes=1 local_world=4" in banner(res.output)
    assert "smoke test passed: 6 all-reduce checks on each of 4 ranks" in res.output, res.output
    assert "Traceback" not in res.output, res.output


@pytest.mark.parametrize("mpi", ["none", "pmi2"])
def test_plain_srun_takes_the_slurm_path(slurm_cluster, mpi):
    """No `launch`, no MASTER_ADDR: ranks and rendezvous come from the step's variables. Under
    --mpi=pmi2 (PMI_RANK/PMI_SIZE set, no MPI local rank) mmm still reads the Slurm step, not MPI."""
    env = slurm_cluster.environ()
    if mpi == "pmi2":
        plugins = subprocess.run(["srun", "--mpi=list"], env=env, capture_output=True, text=True, timeout=30)
        if "pmi2" not in plugins.stdout + plugins.stderr:
            pytest.skip(f"this Slurm has no pmi2 MPI plugin (srun --mpi=list: {plugins.stdout + plugins.stderr!r})")
        probe = run(["srun", "-n", "2", "--mpi=pmi2", "printenv", "PMI_RANK"], env=env, timeout=60)
        assert probe.returncode == 0 and sorted(probe.stdout.split()) == ["0", "1"], probe.output
    res = run(["srun", "-n", "4", f"--mpi={mpi}", sys.executable, "-m", "mmm", "--tp", "2"], env=env, timeout=120)
    assert res.returncode == 0, res.output
    assert "launcher=slurm world=4 nodes=1 local_world=4" in banner(res.output)
    assert "smoke test passed: 6 all-reduce checks on each of 4 ranks" in res.output, res.output
    assert "Traceback" not in res.output, res.output


def test_sbatch_of_the_shipped_job_script_trains(slurm_cluster, tmp_path):
    """examples/jobs/slurm.sbatch as users copy it: #SBATCH lines overridden on the command line,
    trainer flags after the script, `launch` found on PATH (an activated venv)."""
    out = tmp_path / "out"
    env = slurm_cluster.environ(PATH=f"{BIN}:{slurm_cluster.environ()['PATH']}")
    sub = run(
        [
            "sbatch",
            "--parsable",
            "--nodes=1",
            "--ntasks-per-node=4",
            f"--output={tmp_path}/job-%j.out",
            f"--chdir={tmp_path}",
            str(JOB_SCRIPT),
            "--max-iters",
            "4",
            *TINY,
            "--outdir",
            str(out),
        ],
        env=env,
        timeout=60,
    )
    assert sub.returncode == 0, sub.output
    job = sub.stdout.strip().split(";")[0]
    state, code = slurm_cluster.wait_job(job, timeout=240)
    log = (tmp_path / f"job-{job}.out").read_text()
    assert (state, code) == ("COMPLETED", "0:0"), log
    assert f"job {job}: 1 host(s) {slurm_cluster.node}, 4 tasks" in log, log
    assert "launch: 4 ranks (4 per host) on 1 host via srun; scheduler: slurm" in log, log
    assert "launcher=launch/srun world=4" in banner(log)
    assert "mesh 2x2 over cpu: pp=1 x dp_replicate=1 x dp_shard=2 x cp=1 x tp=2" in log, log
    assert re.search(r"INFO  done: final loss \d+\.\d+ .* \| " + re.escape(str(out)), log), log
    rows = jsonl(out / "history.jsonl", key=None)
    assert [r["iter"] for r in rows] == [1, 2, 3, 4], rows
    assert all(r["loss"] > 0 and r["grad_norm"] > 0 for r in rows), rows
    assert (out / "summary.json").is_file()


def test_a_killed_rank_under_srun_ends_the_job_fast_naming_only_it(slurm_cluster, tmp_path):
    """Rank 1 SIGKILLs itself at step 3: srun (--kill-on-bad-exit from `launch`) ends the step, the
    survivors' one-line errors name rank 1 and no live rank, long before the 60 s collective timeout."""
    res = run(
        [
            "salloc",
            "-n",
            "4",
            str(BIN / "launch"),
            "python3",
            "-m",
            "mmm.examples.fsdp_tp",
            "--tpsize",
            "2",
            "--max-iters",
            "20",
            *TINY,
            "--timeout",
            "60",
            "--outdir",
            str(tmp_path),
        ],
        env=slurm_cluster.environ(MMM_FAULT="kill@3:1"),
        timeout=150,
    )
    assert res.returncode != 0, res.output
    assert res.seconds < 45, res.seconds
    assert re.search(r"srun: error: \S+: task 1: Killed", res.stderr), res.stderr
    lines = [ln for ln in res.stderr.splitlines() if "stopped answering" in ln]
    assert lines, res.stderr
    named = [m.group(1) if (m := re.search(r"ranks? ([\d, ]+) stopped answering", ln)) else ln for ln in lines]
    assert set(named) == {"1"}, "\n".join(lines)  # the dead rank, and no live one
    assert "Traceback" not in res.stderr, res.stderr
    assert jsonl(tmp_path / "history.jsonl", "iter")[:2] == [1, 2]  # the finished steps are on disk


def test_signals_reach_every_rank_and_stop_the_job(slurm_cluster, tmp_path):
    """launch's signal promise under srun (which passes SIGUSR1, SIGUSR2 and SIGHUP on to its tasks)."""
    cmd = slurm_cluster.command([str(BIN / "launch"), "--launcher", "srun"])
    signal_promise(cmd, slurm_cluster.environ(), tmp_path / "out", signal.SIGHUP, srun=True)


def _signal_a_slurm_job(cmd: list[str], env, out, sig: signal.Signals | None, *flags: str) -> tuple[int, str]:
    """``cmd`` (launch, or salloc's launch) runs 2 ranks that would train for ever; after the 3rd step ``sig``
    goes to launch, or ``scancel --signal`` to the job for ``sig`` None: exit code, stderr."""
    train = ["-m", "mmm.examples.fsdp_tp", *TINY, "--max-iters", "100000", *flags, "--outdir", str(out)]
    p = subprocess.Popen(
        [*cmd, "--launcher", "srun", "python3", *train],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        until_steps(out / "history.jsonl", 3, p)
        if sig is not None:
            p.send_signal(sig)
        else:
            jobs = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True)
            (job,) = jobs.stdout.split()
            assert subprocess.run(["scancel", "--signal=TERM", job], env=env, timeout=30).returncode == 0
        _, err = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, err


@pytest.mark.parametrize("how", ["scancel", "launch"])
def test_a_sigterm_stops_the_job_after_a_checkpoint(slurm_cluster, tmp_path, how):
    """Slurm's graceful stop signals every task (``scancel --signal=TERM``, as its preemption and time limit do);
    a SIGTERM to launch alone (a wrapper's `timeout`, a `kill`) reaches the ranks through launch's rank watch:
    srun itself would force the step's end, its tasks SIGKILLed after KillWait. Either way each rank finishes
    its step, the checkpoint is saved, exit 0. (SIGINT, relayed the same way: the Ctrl-C test below.)"""
    out, ck, env = tmp_path / "out", tmp_path / "ck", slurm_cluster.environ()
    cmd = ["salloc", "-n", "2", str(BIN / "launch")] if how == "scancel" else [str(BIN / "launch"), "-n", "2"]
    code, err = _signal_a_slurm_job(cmd, env, out, None if how == "scancel" else signal.SIGTERM,
                                    "--checkpoint-dir", str(ck))  # fmt: skip
    assert code == 0, err
    steps = jsonl(out / "history.jsonl", "iter")
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 3
    assert [q.name for q in ck.iterdir()] == [f"step-{steps[-1]:08d}"]
    assert json.loads((out / "summary.json").read_text())["stopped_by"] == "SIGTERM"


def _at_a_terminal(argv: list[str], env: dict[str, str], ready, keys: bytes, seconds: float = 60) -> tuple[int, str]:
    """Run ``argv`` with a terminal of its own (a pseudo-terminal, its controlling one), type ``keys`` once
    ``ready()``: its exit code and what it printed (the end may be missing: Linux drops what a pseudo-terminal
    still holds once its last writer has closed it)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: a session leader whose controlling terminal is the pty
        try:
            os.execve(argv[0], argv, env)
        finally:
            os._exit(127)  # never a second pytest
    shown, typed, deadline = b"", False, time.monotonic() + 2 * seconds
    try:
        while time.monotonic() < deadline:
            if not typed and ready():
                os.write(fd, keys)
                typed, deadline = True, time.monotonic() + seconds
            if select.select([fd], [], [], 0.2)[0]:
                try:
                    data = os.read(fd, 65536)
                except OSError:  # EIO: every process holding the terminal has gone
                    break
                if not data:
                    break
                shown += data
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)  # the terminal is closed; it is still leaving
        assert done[0] == pid, f"still running {seconds:.0f} s after {keys!r} was typed:\n{shown.decode()[-2000:]}"
        return os.waitstatus_to_exitcode(done[1]), shown.decode(errors="replace")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        os.close(fd)


def test_a_ctrl_c_typed_at_the_terminal_ends_the_ranks_at_once(slurm_cluster, tmp_path):
    """At a terminal (an interactive allocation), Ctrl-C reaches launch and srun alike; srun answers its own by
    printing the tasks' states (a second within a second aborts the step), so launch sends SIGINT to the ranks:
    they end at once, 130."""
    out = tmp_path / "out"
    argv = [str(BIN / "launch"), "-n", "2", "--launcher", "srun", "python3", "-m", "mmm.examples.fsdp_tp", *TINY,
            "--max-iters", "100000", "--outdir", str(out)]  # fmt: skip

    def three_steps() -> bool:
        return (out / "history.jsonl").is_file() and len((out / "history.jsonl").read_text().splitlines()) >= 3

    code, shown = _at_a_terminal(argv, slurm_cluster.environ(), three_steps, b"\x03")
    assert code == 130, shown[-3000:]  # (launch's SIGTERM after 10 s would have stopped them with 0)
    assert "did not stop the job" not in shown, shown[-3000:]
