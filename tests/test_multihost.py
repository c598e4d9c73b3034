"""More than one host, for real: 2 hosts x 2 ranks on one machine (network namespaces, each with its own
address, hostname and node-local /tmp; see tests/hosts.py). Ranks on different hosts meet only over
the hosts' network, as on a cluster; the project tree is their shared filesystem.

- torchrun on each host (``--nnodes 2``), rank 0's host named by its hostname;
- ``launch`` under PBS (a ``PBS_NODEFILE`` naming both hosts) starting Open MPI's or MPICH's mpiexec on
  the first host, which reaches the second through a remote-shell agent exactly as it would through ssh;
- a 2-node Slurm (a slurmd per host): ``salloc -N 2`` + ``launch``, plain ``srun -N 2`` (``--mpi=none``
  and ``pmi2``), ``sbatch -N 2`` of the shipped job script;
- (tests/test_equivalence.py runs layouts across the two hosts: HSDP, a pipeline stage per host.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (
    BIN,
    ROOT,
    clean_env,
    descendants,
    env_of,
    kill_group,
    mpi_env,
    pbs_job,
    proc_stat,
    run,
    spawn,
    until_steps,
)
from mmm.dist import free_port
from mmm.parallel.checkpoint_folder import complete_steps

RANKS_PER_HOST = 2


def reports(folder) -> list[dict]:
    found = sorted(folder.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    return [json.loads(p.read_text()) for p in found]


def assert_two_hosts(found: list[dict], launcher: str) -> None:
    assert [r["rank"] for r in found] == [0, 1, 2, 3], found
    assert [r["host"] for r in found] == ["node1", "node1", "node2", "node2"]  # ranks by host, in order
    assert [r["local_rank"] for r in found] == [0, 1, 0, 1]
    assert [r["node"] for r in found] == [0, 0, 1, 1]
    assert {(r["num_nodes"], r["local_world_size"]) for r in found} == {(2, 2)}
    assert {r["launcher"] for r in found} == {launcher}
    assert all(c["ok"] for r in found for c in r["checks"]), found
    assert {r["env_master"][0] for r in found} == {"node1"}  # rendezvous at rank 0's host, not 127.0.0.1


@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_torchrun_on_two_hosts(two_hosts, shared_dir, rdzv):
    """torchrun on each host, with a static rendezvous at node1 or torchrun's c10d rendezvous (which
    assigns the node ranks itself: rank 0 may land on either host, and mmm meets at its host)."""
    out = shared_dir / "torchrun"
    port = str(free_port())
    meet = (
        ["--rdzv-backend=c10d", f"--rdzv-endpoint=node1:{port}", "--rdzv-id=mmm-test"]
        if rdzv == "c10d"
        else ["--master-addr=node1", f"--master-port={port}"]
    )
    procs = [
        two_hosts.popen(
            host,
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--nproc-per-node={RANKS_PER_HOST}",
                *([f"--node-rank={i}"] if rdzv == "static" else []),
                *meet,
                "-m",
                "mmm",
                "--tp",
                "2",
                "--report-dir",
                str(out),
            ],  # fmt: skip
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for i, host in enumerate(two_hosts.names)
    ]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            kill_group(p)
    assert [p.returncode for p in procs] == [0, 0], outs
    logs = outs[0][0] + outs[1][0]  # rank 0 logs on whichever host it landed
    assert "smoke test passed: 6 all-reduce checks on each of 4 ranks" in logs, outs
    assert "world=4 nodes=2 local_world=2" in logs
    assert "hosts: node 0 node1 (ranks 0-1), node 1 node2 (ranks 2-3)" in logs or "hosts: node 0 node2" in logs
    found = reports(out)
    if rdzv == "static":
        assert_two_hosts(found, "torchrun")
    else:  # c10d picks which host holds ranks 0-1; everything else is as with a static rendezvous
        hosts = [r["host"] for r in found]
        assert hosts[0] == hosts[1] != hosts[2] == hosts[3] and set(hosts) == {"node1", "node2"}, hosts
        assert [r["local_rank"] for r in found] == [0, 1, 0, 1]
        assert {r["env_master"][0] for r in found} == {hosts[0]}  # they met at rank 0's host
        assert all(c["ok"] for r in found for c in r["checks"]), found


@pytest.mark.parametrize("flavor", ["openmpi", "mpich", "impi"])
def test_launch_under_pbs_runs_mpiexec_across_two_hosts(two_hosts, shared_dir, flavor):
    """launch on the first host of a 2-node PBS job: Open MPI's daemons and MPICH's Hydra proxies reach
    the second host through the remote-shell agent, as through ssh."""
    envdir = BIN.parent if flavor == "openmpi" else mpi_env(flavor)
    out = shared_dir / "report"
    cmd = [str(envdir / "bin" / "python"), "-m", "mmm.launch", "python3", "-m", "mmm", "--tp", "2",
           "--report-dir", str(out)]  # fmt: skip
    res = run(two_hosts.command("node1", cmd), env=pbs_job(two_hosts, shared_dir, PATH=env_of(envdir)["PATH"]))
    assert res.returncode == 0, res.output
    how = "openmpi" if flavor == "openmpi" else "hydra"
    assert f"launch: 4 ranks (2 per host) on 2 hosts via mpiexec ({how}); scheduler: pbs" in res.stderr, res.stderr
    assert_two_hosts(reports(out), "launch/mpiexec")


# --------------------------------------------------------------------------- Slurm on two nodes
def test_salloc_on_two_nodes_and_launch(slurm_on_two_hosts, shared_dir):
    c, out = slurm_on_two_hosts, shared_dir / "report"
    cmd = ["salloc", "-N", "2", "--ntasks-per-node=2", str(BIN / "launch"), "python3", "-m", "mmm", "--tp", "2",
           "--report-dir", str(out)]  # fmt: skip
    res = run(c.command(cmd), env=c.environ(), timeout=120)
    assert res.returncode == 0, res.output
    assert "launch: 4 ranks (2 per host) on 2 hosts via srun; scheduler: slurm" in res.stderr, res.output
    assert_two_hosts(reports(out), "launch/srun")


@pytest.mark.parametrize("mpi", ["none", "pmi2"])
def test_plain_srun_on_two_nodes(slurm_on_two_hosts, shared_dir, mpi):
    """No launch and no MASTER_ADDR: ranks, local ranks and rank 0's host come from the step itself."""
    c, out = slurm_on_two_hosts, shared_dir / "report"
    cmd = ["srun", "-N", "2", "--ntasks-per-node=2", f"--mpi={mpi}", sys.executable, "-m", "mmm", "--tp", "2",
           "--report-dir", str(out)]  # fmt: skip
    res = run(c.command(cmd), env=c.environ(), timeout=120)
    assert res.returncode == 0, res.output
    assert_two_hosts(reports(out), "slurm")


def test_sbatch_of_the_shipped_job_script_on_two_nodes(slurm_on_two_hosts, shared_dir):
    """examples/jobs/slurm.sbatch as written (--nodes=2), 2 ranks per node: trains across the hosts."""
    c, out = slurm_on_two_hosts, shared_dir / "out"
    env = c.environ(PATH=f"{BIN}:{c.environ()['PATH']}")
    tiny = "--dim 64 --n-layers 2 --seq-len 32 --batch-size 8 --no-plots --max-iters 3".split()
    script = ROOT / "examples" / "jobs" / "slurm.sbatch"
    cmd = ["sbatch", "--parsable", "--ntasks-per-node=2", f"--output={shared_dir}/job-%j.out",
           f"--chdir={shared_dir}", str(script), *tiny, "--outdir", str(out)]  # fmt: skip
    sub = run(c.command(cmd), env=env, timeout=60)
    assert sub.returncode == 0, sub.output
    job = sub.stdout.strip().split(";")[0]
    state, code = c.wait_job(job, timeout=240)
    log = (shared_dir / f"job-{job}.out").read_text()
    assert (state, code) == ("COMPLETED", "0:0"), log
    assert f"job {job}: 2 host(s) node[1-2], 4 tasks" in log, log
    assert "launch: 4 ranks (2 per host) on 2 hosts via srun; scheduler: slurm" in log, log
    assert "launcher=launch/srun world=4 nodes=2 local_world=2" in log, log
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["mesh"]["tp"] == 2, summary
    assert [r["iter"] for r in map(json.loads, (out / "history.jsonl").read_text().splitlines())] == [1, 2, 3]


# --------------------------------------------------------------------------- a rank lost on the second host
TRAIN = "-m mmm.examples.fsdp_tp --dim 64 --n-layers 2 --seq-len 32 --batch-size 8 --no-plots --max-iters 8".split()


def test_a_rank_killed_on_the_second_host_is_named_under_torchrun(two_hosts, shared_dir):
    """torchrun on each host; rank 2 (on node2) SIGKILLs itself at step 3. The job is gone well within
    60 s, and the ranks of node1 name it with its host (their roll call), never a rank of node1."""
    port = str(free_port())
    env = clean_env(MMM_FAULT="kill@3:2", MMM_TIMEOUT="300")
    procs = [
        two_hosts.popen(
            host,
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--nproc-per-node={RANKS_PER_HOST}",
                f"--node-rank={i}",
                "--master-addr=node1",
                f"--master-port={port}",
                *TRAIN,
                "--outdir",
                str(shared_dir / "out"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )  # fmt: skip
        for i, host in enumerate(two_hosts.names)
    ]
    t0 = time.monotonic()
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            kill_group(p)
    took = time.monotonic() - t0
    assert all(p.returncode != 0 for p in procs) and took < 60, (took, outs)
    node1_err = outs[0][1]
    named = [ln for ln in node1_err.splitlines() if "stopped answering" in ln]
    assert named, node1_err
    for line in named:
        assert "on node2 stopped answering" in line and "node1" not in line.split("stopped answering")[0], line
        assert re.search(r"ranks? 2(, 3)? on node2", line), line
    assert "frame #" not in node1_err, node1_err


@pytest.mark.parametrize("how", ["pbs/openmpi", "pbs/mpich", "pbs/impi", "slurm"])
def test_a_rank_killed_on_the_second_host_ends_the_job_naming_rank_and_host(
    two_hosts, shared_dir, request, how
):  # fmt: skip
    """The same fault under launch: mpiexec (PBS) or srun (a 2-node allocation) ends the job within 60 s
    and its message names rank 2 and node2. Open MPI and Slurm name it themselves; MPICH's Hydra kills
    every rank and names none, so launch does, from the reports of node2's rank watcher (the host's
    first rank starts it; it leaves with its ranks, taking their notes with it)."""
    cmd = [str(BIN / "launch"), "python3", *TRAIN, "--outdir", str(shared_dir / "out")]
    if how == "slurm":
        c = request.getfixturevalue("slurm_on_two_hosts")
        full, env = c.command(["salloc", "-N", "2", "--ntasks-per-node=2", *cmd]), c.environ(MMM_FAULT="kill@3:2")
        named = r"node2: task 2: Killed"
    elif how in ("pbs/mpich", "pbs/impi"):
        envdir = mpi_env(how[4:])
        cmd[:1] = [str(envdir / "bin" / "python"), "-m", "mmm.launch"]
        full = two_hosts.command("node1", cmd)
        env = pbs_job(two_hosts, shared_dir, MMM_FAULT="kill@3:2", PATH=env_of(envdir)["PATH"])
        named = r"launch: error: rank 2 on node2 \(pid \d+\) died first, without a word"
    else:
        full, env = two_hosts.command("node1", cmd), pbs_job(two_hosts, shared_dir, MMM_FAULT="kill@3:2")
        named = r"rank 2 with PID \d+ on node node2 exited on\s+signal 9"
    res = run(full, env={**env, "MMM_TIMEOUT": "300"}, timeout=120)
    assert res.returncode != 0 and res.seconds < 60, (res.seconds, res.output)
    assert re.search(named, res.output), res.output
    assert len(re.findall("died first", res.output)) == (how in ("pbs/mpich", "pbs/impi")), res.output  # once
    if how in ("pbs/mpich", "pbs/impi"):
        time.sleep(1)  # the watcher has gone with its ranks, and taken their notes
        on_node2 = set(subprocess.run(["ip", "netns", "pids", two_hosts.netns("node2")], capture_output=True,
                                      text=True).stdout.split())  # fmt: skip
        watchers = set(
            subprocess.run(["pgrep", "-f", "mmm.dist.rankwatch"], capture_output=True, text=True).stdout.split()
        )
        assert not on_node2 & watchers, on_node2 & watchers
        left = [f for h in two_hosts.names for f in two_hosts.tmp(h).glob("mmm-pids-*/*")]
        assert not left, left


def _sigterm_to_launch_on_node1(cmd: list[str], env: dict[str, str], out: Path, ck: Path, salloc=False) -> None:
    """``cmd`` (launch on node1, or salloc's launch; every rank on node2) trains until launch is SIGTERM'd
    after its 3rd step: every rank finishes its step, the checkpoint of that step is saved, the summary says
    why, exit 0."""
    train = [*TRAIN[:-2], "--max-iters", "100000", "--checkpoint-dir", str(ck), "--outdir", str(out)]
    with spawn([*cmd, "python3", *train], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as p:
        until_steps(hist := out / "history.jsonl", 3, p, seconds=120)
        # launch, or the command salloc runs (launch: srun, were it to hand its process over)
        (pid,) = [q for q in descendants(p.pid) if (proc_stat(q) or [0, 0])[1] == str(p.pid)] if salloc else [p.pid]
        os.kill(pid, signal.SIGTERM)
        stdout, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "on 1 host" in err and "[node2][0/1]" in stdout and "[node1]" not in stdout, stdout
    steps = [json.loads(line)["iter"] for line in hist.read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 3, steps
    assert complete_steps(ck) == [steps[-1]], sorted(q.name for q in ck.iterdir())
    assert json.loads((out / "summary.json").read_text())["stopped_by"] == "SIGTERM"


def test_sigterm_to_launch_stops_an_open_mpi_job_on_another_host_after_a_checkpoint(two_hosts, shared_dir):
    """A preemption's SIGTERM to launch on node1, every rank on node2 (PBS, Open MPI): prterun would SIGKILL
    the ranks within a second, so launch sends SIGTERM to them itself, through node2's rank watcher (with
    no rank on launch's host, only that path can stop the job gracefully)."""
    env = {**pbs_job(two_hosts, shared_dir), "MMM_TIMEOUT": "300"}
    Path(env["PBS_NODEFILE"]).write_text("node2\nnode2\n")
    _sigterm_to_launch_on_node1(two_hosts.command("node1", [str(BIN / "launch")]), env, shared_dir / "out",
                                shared_dir / "ck")  # fmt: skip


def test_sigterm_to_launch_stops_a_slurm_job_on_another_node_after_a_checkpoint(slurm_on_two_hosts, shared_dir):
    """The same under Slurm (salloc on node1, every task on node2): srun would force the step's end (its
    tasks SIGKILLed after KillWait), so launch sends SIGTERM to the ranks itself, through node2's watcher."""
    c = slurm_on_two_hosts
    cmd = c.command(["salloc", "-N", "1", "-w", "node2", "--ntasks-per-node=2", str(BIN / "launch")])
    _sigterm_to_launch_on_node1(cmd, c.environ(MMM_TIMEOUT="300"), shared_dir / "out", shared_dir / "ck", salloc=True)


# --------------------------------------------------------------------------- where rank 0 runs under Slurm
def test_launch_hostfile_under_slurm_meets_where_srun_put_rank_0(slurm_on_two_hosts, shared_dir):
    """--hostfile naming node2 first: srun still orders the nodes its own way (rank 0 on node1); launch
    used to point every rank at node2, where no store listens (a hang until the timeout)."""
    c, out = slurm_on_two_hosts, shared_dir / "report"
    hostfile = shared_dir / "hosts"
    hostfile.write_text("node2 slots=2\nnode1 slots=2\n")
    cmd = ["salloc", "-N", "2", "--ntasks-per-node=2", str(BIN / "launch"), "--hostfile", str(hostfile),
           "python3", "-m", "mmm", "--tp", "2", "--report-dir", str(out)]  # fmt: skip
    res = run(c.command(cmd), env=c.environ(MMM_TIMEOUT="60"), timeout=120)
    assert res.returncode == 0, res.output
    found = reports(out)
    assert len(found) == 4 and all(c["ok"] for r in found for c in r["checks"]), res.output
    assert found[0]["env_master"][0] == found[0]["host"], found[0]  # rank 0's own host


def test_srun_arbitrary_distribution_meets_at_rank_0s_host(slurm_on_two_hosts, shared_dir):
    """--distribution=arbitrary with SLURM_HOSTFILE puts rank 0 on node2: the step's first node (node1)
    is not rank 0's host."""
    c, out = slurm_on_two_hosts, shared_dir / "report"
    tasks = shared_dir / "tasks"
    tasks.write_text("node2\nnode2\nnode1\nnode1\n")
    cmd = ["srun", "-n", "4", "--distribution=arbitrary", sys.executable, "-m", "mmm", "--tp", "2",
           "--report-dir", str(out)]  # fmt: skip
    res = run(c.command(cmd), env=c.environ(SLURM_HOSTFILE=str(tasks), MMM_TIMEOUT="60"), timeout=120)
    assert res.returncode == 0, res.output
    found = reports(out)
    assert [r["host"] for r in found] == ["node2", "node2", "node1", "node1"], found
    assert [r["node"] for r in found] == [0, 0, 1, 1], found  # node 0 is rank 0's host
    assert {r["env_master"][0] for r in found} == {"node2"}


# --------------------------------------------------------------------------- losing a whole host
def _lose_at_step(hosts, host: str, p: subprocess.Popen, hist, step: int) -> tuple[str, str]:
    """Once the job's history reaches ``step``, ``host`` is lost (its link cut, its processes killed); the
    job's output once launch ends (within 300 s)."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and p.poll() is None:
        if hist.exists() and any(json.loads(x)["iter"] >= step for x in hist.read_text().splitlines() if x):
            break
        time.sleep(0.1)
    assert p.poll() is None, p.communicate()
    assert hosts.lose(host), f"nothing ran on {host}"
    try:
        return p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail(f"launch did not end after losing {host}")


def test_a_job_survives_losing_a_host(shared_dir_3, tmp_path):
    """3 hosts x 2 ranks (dp 3 x tp 2), checkpoints every 2 steps; node3 is lost at step 5 (its link cut,
    every process on it killed). `launch --retries 1 --drop-lost-hosts` probes the hosts, relaunches on
    node1 and node2 (dp 2 x tp 2, the same global batch), and the trainer resumes its latest checkpoint
    on the smaller mesh: history has steps 1-10 once each, and every step's loss and gradient norm are
    one process's."""
    hosts, shared = shared_dir_3
    flags = [*TRAIN[:-1], "10", "--batch-size", "12", "--log-every", "1"]
    ref = tmp_path / "one"
    res = run([sys.executable, *flags, "--outdir", str(ref)], timeout=180)
    flags += ["--tp", "2"]
    assert res.returncode == 0, res.output
    out, ck = shared / "out", shared / "ck"
    cmd = [str(BIN / "launch"), "--retries", "1", "--drop-lost-hosts", "python3", *flags,
           "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--outdir", str(out)]  # fmt: skip
    env = pbs_job(hosts, shared, MMM_TIMEOUT="60")
    with spawn(hosts.command("node1", cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as p:
        stdout, stderr = _lose_at_step(hosts, "node3", p, out / "history.jsonl", 5)
    assert p.returncode == 0, stdout + stderr
    assert "host node3 did not answer after the failure: relaunching on node1, node2 (4 ranks, 2 per host" in stderr
    resumed = [ln for ln in stdout.splitlines() if "checkpoint: resumed from" in ln]
    assert len(resumed) == 1 and "step-00000004" in resumed[0], stdout  # not a fresh start at step 1
    rows = [json.loads(x) for x in (out / "history.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in rows] == list(range(1, 11)), [r["iter"] for r in rows]
    want = {r["iter"]: r for r in map(json.loads, (ref / "history.jsonl").read_text().splitlines())}
    for key in ("loss", "grad_norm"):
        worst = max(abs(r[key] - want[r["iter"]][key]) / abs(want[r["iter"]][key]) for r in rows)
        assert worst <= 1e-5, (key, worst)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["mesh"]["dp_shard"] == 2, summary["mesh"]
    assert summary["dropped_hosts"] == ["node3"] and summary["restart"] == 1, summary
    assert "relaunched without host(s) node3: they did not answer after the failure" in stdout


def test_a_lost_host_ends_the_job_and_is_named(own_two_hosts):
    """node2 is lost in the middle of a job under MPICH (its link cut, every process on it killed, its
    rank watcher too): the job ends well within the collective timeout, launch names node2 as lost and
    says how to go on without it, and names no rank of node1 as the one that died first."""
    hosts, shared = own_two_hosts
    envdir = mpi_env("mpich")
    out = shared / "out"
    cmd = [str(envdir / "bin" / "python"), "-m", "mmm.launch", "python3", *TRAIN[:-1], "200", "--outdir", str(out)]
    env = pbs_job(hosts, shared, MMM_TIMEOUT="20", PATH=env_of(envdir)["PATH"])
    with spawn(hosts.command("node1", cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as p:
        deadline = time.monotonic() + 120
        hist = out / "history.jsonl"
        while time.monotonic() < deadline and p.poll() is None:
            if hist.exists() and any(json.loads(x)["iter"] >= 3 for x in hist.read_text().splitlines() if x):
                break
            time.sleep(0.1)
        assert p.poll() is None, p.communicate()
        assert hosts.lose("node2"), "nothing ran on node2"
        t0 = time.monotonic()
        try:
            stdout, stderr = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("the job did not end after losing a host")
    took = time.monotonic() - t0
    # the collective timeout (20 s), the ranks' bounded teardown, launch's 15 s wait, the probes
    assert p.returncode == 1 and took < 90, (took, stderr)
    assert "every rank of this host (node1) ended, one with a failure, 15 s ago, and the launcher still waits" in stderr
    lost = "launch: error: host node2 did not answer after the failure: lost (crashed, powered off or cut off"
    assert lost in stderr and "launch --retries N --drop-lost-hosts relaunches on the hosts" in stderr, stderr
    assert "died first" not in stderr, stderr  # node2's ends never came: no rank of node1 is blamed


@pytest.fixture
def own_two_hosts():
    """Two hosts of their own (node1, node2) for a test that loses one, and a folder they both see."""
    yield from _own_hosts(2)


@pytest.fixture
def shared_dir_3():
    """Three hosts of their own (node1..node3) for one test, and a folder they all see."""
    yield from _own_hosts(3)


def _own_hosts(n: int):
    from hosts import Hosts, HostsUnavailable

    try:
        hosts = Hosts.up(n)
    except HostsUnavailable as e:
        pytest.skip(f"no multi-host cluster on this machine: {e}")
    try:
        d = hosts.state / "shared"
        d.mkdir()
        yield hosts, d
    finally:
        hosts.down()


def test_a_checkpoint_folder_on_node_local_disks_is_refused_at_startup(two_hosts, shared_dir):
    """--checkpoint-dir on each host's own disk (node-local): refused in one line at startup, naming the host
    that does not see rank 0's folder, instead of failing at the first save after --checkpoint-every steps."""
    local = str(two_hosts.local / "ck")  # each host's own disk behind one path
    cmd = [str(BIN / "launch"), "python3", *TRAIN, "--checkpoint-dir", local, "--checkpoint-every", "4",
           "--outdir", str(shared_dir / "out")]  # fmt: skip
    res = run(two_hosts.command("node1", cmd), env=pbs_job(two_hosts, shared_dir, MMM_TIMEOUT="60"), timeout=120)
    lines = [ln for ln in res.stderr.splitlines() if "error:" in ln]
    assert res.returncode == 2 and "Traceback" not in res.output, res.output
    assert len(lines) == 1 and f"--checkpoint-dir '{local}' is not shared by every host: node2" in lines[0], lines
    assert "step 1" not in res.stdout and not Path(local).exists()


def test_a_relaunch_the_trainer_would_refuse_is_not_made(shared_dir_3, tmp_path, record_property):
    """3 hosts x 2 ranks (dp 3 x tp 2), global batch 9; node3 is lost. On the 2 hosts left dp would be 2, which
    does not divide 9: launch asks the trainer first (MMM_CHECK_WORLD), says so in one line and gives up,
    instead of relaunching a job that exits 2 at once (and is then not retried)."""
    hosts, shared = shared_dir_3
    out, ck = shared / "out", shared / "ck"
    flags = [*TRAIN[:-1], "40", "--batch-size", "9", "--tp", "2", "--log-every", "1"]
    cmd = [str(BIN / "launch"), "--retries", "1", "--drop-lost-hosts", "python3", *flags,
           "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--outdir", str(out)]  # fmt: skip
    with spawn(hosts.command("node1", cmd), env=pbs_job(hosts, shared, MMM_TIMEOUT="60"),
               stdout=subprocess.PIPE, stderr=subprocess.PIPE) as p:  # fmt: skip
        stdout, stderr = _lose_at_step(hosts, "node3", p, out / "history.jsonl", 3)  # step 2's checkpoint saved
    said = [ln for ln in stderr.splitlines() if "not relaunched" in ln]
    kept = complete_steps(ck)
    record_property("fault_outcome", ["a lost host; the trainer would refuse the relaunch (--drop-lost-hosts)",
                                      f"given up in {len(said)} line (rc {p.returncode})",
                                      "nothing" if kept else "the checkpoints"])  # fmt: skip
    assert p.returncode not in (0, 2) and "relaunching" not in stderr, stderr
    assert len(said) == 1 and "node3" in said[0] and "--batch-size 9 is not divisible by 2" in said[0], stderr
    assert kept, "the checkpoints saved before are kept"
