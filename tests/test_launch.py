"""`launch`: scheduler detection, host lists, the commands it builds, and its errors."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import clean_env, launch, run, spawn
from mmm import launch as L
from mmm.errors import UsageError
from mmm.launch import tempdirs
from mmm.launch import watch as W
from mmm.launch.output import ExitBoxFilter


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("nid[001-003,010]", ["nid001", "nid002", "nid003", "nid010"]),
        ("login1,gpu[8-10]", ["login1", "gpu8", "gpu9", "gpu10"]),
        ("x[1-2]-ib[0-1]", ["x1-ib0", "x1-ib1", "x2-ib0", "x2-ib1"]),
        ("node0042", ["node0042"]),
        ("a[09-11],b[1,3]", ["a09", "a10", "a11", "b1", "b3"]),
    ],
)
def test_slurm_nodelist_expansion(text, hosts):
    assert L.expand_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["nid[001-003", "nid[5-2]", "nid[a-b]"])
def test_bad_nodelists_are_named(text):
    with pytest.raises(UsageError, match="Slurm node list"):
        L.expand_nodelist(text)


def test_pbs_nodefile_repeats_count_as_slots(tmp_path):
    f = tmp_path / "nodefile"
    f.write_text("x1001.hsn\nx1001.hsn\nx1002.hsn\nx1002.hsn\n")
    assert L.read_hostfile(f) == (["x1001.hsn", "x1002.hsn"], [2, 2])
    g = tmp_path / "hosts"
    g.write_text("# comment\nnodeA slots=4\nnodeB:8\n\n")
    assert L.read_hostfile(g) == (["nodeA", "nodeB"], [4, 8])


def test_detect_pbs_slurm_and_none(tmp_path):
    f = tmp_path / "nodefile"
    f.write_text("h1\nh2\nh3\n")
    pbs = L.detect_allocation({"PBS_NODEFILE": str(f), "PBS_JOBID": "123.pbs", "MMM_GPUS_PER_NODE": "4"})
    assert (pbs.scheduler, pbs.hosts, pbs.accelerators_per_host, pbs.hostfile) == ("pbs", ["h1", "h2", "h3"], 4, str(f))
    slurm = L.detect_allocation(
        {
            "SLURM_JOB_ID": "9",
            "SLURM_JOB_NODELIST": "nid[001-002]",
            "SLURM_NTASKS_PER_NODE": "8",
            "CUDA_VISIBLE_DEVICES": "",
        }
    )
    assert (slurm.scheduler, slurm.hosts, slurm.slots_per_host, slurm.accelerators_per_host) == (
        "slurm",
        ["nid001", "nid002"],
        8,
        0,
    )
    none = L.detect_allocation({"CUDA_VISIBLE_DEVICES": "0,1"})
    assert (none.scheduler, none.num_hosts, none.accelerators_per_host) == ("none", 1, 2)


def _pbs_env(tmp_path, hosts=("h1", "h2"), gpus="4"):
    f = tmp_path / "nodefile"
    f.write_text("".join(f"{h}\n" for h in hosts))
    return {"PBS_NODEFILE": str(f), "PBS_JOBID": "1.pbs", "MMM_GPUS_PER_NODE": gpus}, str(f)


def test_pbs_openmpi_command(tmp_path):
    env, nodefile = _pbs_env(tmp_path)
    plan = L.plan_launch(["python3", "train.py", "--tp", "2"], env=env, flavor="openmpi")
    assert plan.launcher == "mpiexec" and plan.nproc == 8 and plan.ppn == 4
    argv = plan.argv
    assert argv[1:3] == ["-n", "8"]
    assert argv[argv.index("--map-by") + 1] == "ppr:4:node"
    assert argv[argv.index("--hostfile") + 1] == nodefile
    assert plan.env["MASTER_ADDR"] == "h1" and plan.env["OMP_NUM_THREADS"].isdigit()
    for k in ("MASTER_ADDR", "MASTER_PORT", "MMM_LAUNCH_TIME"):
        assert argv[argv.index(k) - 1] == "-x"
    assert argv[-3:] == ["train.py", "--tp", "2"] and argv[-4] == sys.executable


def test_pbs_hydra_and_pals_commands(tmp_path):
    env, nodefile = _pbs_env(tmp_path, hosts=("h1", "h2", "h3"), gpus="12")
    hydra = L.plan_launch(["python3", "t.py"], env=env, flavor="hydra", nproc=24)
    a = hydra.argv
    assert a[1:5] == ["-n", "24", "-ppn", "12"] and a[a.index("-hostfile") + 1] == nodefile
    assert "-genv" in a and "MASTER_ADDR" in a
    pals = L.plan_launch(["python3", "t.py"], env=env, flavor="pals", ppn=6)
    b = pals.argv
    assert b[1:5] == ["-n", "18", "--ppn", "6"] and "MASTER_ADDR=h1" in b


def test_slurm_srun_command(tmp_path, monkeypatch):
    fake = tmp_path / "srun"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    env = {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "gpu[1-4]", "MMM_GPUS_PER_NODE": "4"}
    plan = L.plan_launch(["python3", "t.py"], env=env, nproc=12)
    assert plan.launcher == "srun"
    assert plan.argv[:7] == [
        str(fake),
        "--nodes=3",
        "--ntasks=12",
        "--ntasks-per-node=4",
        "--export=ALL",
        "--kill-on-bad-exit=1",
        sys.executable,
    ]
    # rank 0's host is the step's to say (its first node), not a guess from the allocation
    assert "MASTER_ADDR" not in plan.env and int(plan.env["MASTER_PORT"]) > 0
    # --hostfile: srun runs on those hosts
    hf = tmp_path / "hosts"
    hf.write_text("gpu4\ngpu2\n")
    plan = L.plan_launch(["python3", "t.py"], env=env, hostfile=str(hf), ppn=1)
    assert "--nodelist=gpu4,gpu2" in plan.argv and "MASTER_ADDR" not in plan.env
    # the job's --cpus-per-task reaches the step (srun >= 22.05 no longer inherits it) and sets the threads
    plan = L.plan_launch(["python3", "t.py"], env={**env, "SLURM_CPUS_PER_TASK": "8"}, nproc=12)
    assert "--cpus-per-task=8" in plan.argv and plan.env["OMP_NUM_THREADS"] == "8"


def test_too_many_ranks_for_the_allocation(tmp_path):
    env, _ = _pbs_env(tmp_path, gpus="4")
    with pytest.raises(UsageError, match=r"-n 16 needs more ranks than 2 host\(s\) x --ppn 4 = 8"):
        L.plan_launch(["python3", "t.py"], env=env, nproc=16, flavor="openmpi")


def test_preset_master_address_is_kept(tmp_path):
    env, _ = _pbs_env(tmp_path)
    env.update(MASTER_ADDR="10.0.0.5", MASTER_PORT="29400")
    plan = L.plan_launch(["python3", "t.py"], env=env, flavor="openmpi")
    assert "MASTER_ADDR" not in plan.env


def test_missing_mpiexec_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python3"))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert L.main(["--launcher", "mpiexec", "-n", "2", "python3", "-c", "pass"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("launch: error: --launcher mpiexec: no mpiexec in")
    assert "pip install 'mmm[mpi]'" in err[0]


def test_dry_run_local_cli():
    res = run(launch("--dry-run", "--launcher", "local", "-n", "3", "python3", "-m", "mmm", "--tp", "3"))
    assert res.returncode == 0, res.output
    head, cmd = res.stdout.strip().splitlines()
    assert head == "# 3 ranks (3 per host) on this machine via local; scheduler: none"
    assert "<3 ranks, RANK=0..2>" in cmd and cmd.endswith(f"{sys.executable} -m mmm --tp 3")
    assert "MASTER_ADDR=127.0.0.1" in cmd and "MMM_LAUNCH_TIME=" in cmd


def test_dry_run_under_fake_slurm_cli(tmp_path):
    fake = tmp_path / "srun"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    env = clean_env(
        SLURM_JOB_ID="1", SLURM_JOB_NODELIST="nid[001-002]", SLURM_NTASKS_PER_NODE="2", PATH=f"{tmp_path}:/usr/bin:/bin"
    )
    res = run(launch("--dry-run", "python3", "-c", "pass"), env=env)
    assert res.returncode == 0, res.output
    assert "4 ranks (2 per host) on 2 hosts via srun; scheduler: slurm" in res.stdout
    assert "--nodes=2 --ntasks=4 --ntasks-per-node=2" in res.stdout
    assert "--kill-on-bad-exit=1" in res.stdout  # one crashed rank ends the step, not the 600 s timeout


def test_the_mpiexec_first_on_path_is_taken_and_named(tmp_path):
    """A site's (or another environment's) mpiexec first on PATH wins over this environment's own, and
    the plan's line names it: PALS flags went to this environment's Open MPI before."""
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'HYDRA build details:'\n")
    fake.chmod(0o755)
    env = clean_env(PATH=f"{tmp_path}:{os.environ.get('PATH', '')}")
    res = run(launch("--dry-run", "--launcher", "mpiexec", "-n", "2", "python3", "-c", "pass"), env=env)
    assert res.returncode == 0, res.output
    head, added, cmd = res.stdout.strip().splitlines()
    assert head == f"# 2 ranks (2 per host) on this machine via mpiexec (hydra: {fake}); scheduler: none", head
    # what each attempt adds is said too (Hydra: launch watches its ranks, through MMM_PID_DIR)
    assert added == "# and, new for each attempt: MMM_PID_DIR=<a new folder> (exported to the ranks)", added
    # an activated environment's Open MPI first on PATH is passed over for a forced flavour of another MPI ...
    own = Path(sys.executable).parent
    pals = clean_env(PATH=f"{own}:{tmp_path}:/usr/bin:/bin", MMM_MPI_FLAVOR="pals")
    res = run(launch("--dry-run", "--launcher", "mpiexec", "-n", "2", "python3", "-c", "pass"), env=pals)
    assert res.returncode == 0 and f" {fake} -n 2 --ppn 2 " in res.stdout, res.output
    # ... and where it is the only one, that is one line (PALS flags went to Open MPI's mpiexec, exit 213)
    res = run(launch("--launcher", "mpiexec", "-n", "2", "true"), env={**pals, "PATH": f"{own}:/usr/bin:/bin"})
    assert res.returncode == 2 and "MMM_MPI_FLAVOR=pals, but every mpiexec here is Open MPI's" in res.stderr, res.output
    assert f" {fake} -n 2 -ppn 2 -genv MASTER_ADDR 127.0.0.1 " in cmd, cmd  # Hydra's flags, to that mpiexec


def test_dry_run_in_a_slurm_job_without_srun_on_path_prints_the_command(tmp_path):
    env = clean_env(
        SLURM_JOB_ID="7", SLURM_JOB_NODELIST="nid[001-002]", SLURM_NTASKS_PER_NODE="2", PATH=str(tmp_path)
    )  # no srun here (/usr/bin may have one)
    res = run(launch("--dry-run", "python3", "-c", "pass"), env=env)
    assert res.returncode == 0, res.output
    assert " srun --nodes=2 --ntasks=4 " in res.stdout.splitlines()[-1]
    assert "MMM_WATCH=<launch's host, port and token>" in res.stdout  # srun's ranks report to launch's watch
    res = run(launch("python3", "-c", "pass"), env=env)  # running it: one line naming the job and the fix
    assert res.returncode == 2 and "no srun on PATH (inside Slurm job 7, PATH=" in res.stderr, res.output
    assert "module load slurm" in res.stderr and "Traceback" not in res.output


@pytest.mark.parametrize(
    "args, needle",
    [
        (["-n", "0", "python3"], "argument -n/--nproc/--np: 0 must be >= 1"),
        (["--launcher", "pbs", "python3"], "argument --launcher: invalid choice: 'pbs'"),
        ([], "no command to launch"),
        (["--hostfile", "/nonexistent/hosts", "python3"], "hostfile '/nonexistent/hosts' does not exist"),
        # a launcher under launch: each rank would start a job of its own
        (["-n", "2", "torchrun", "--nproc-per-node", "2", "train.py"], "torchrun is a launcher: launch starts"),
        (["python3", "-u", "-m", "torch.distributed.run", "x.py"], "python3 -m torch.distributed.run is a launcher"),
        (["mpiexec.hydra", "-n", "2", "train.py"], "mpiexec.hydra is a launcher"),
    ],
)
def test_bad_launch_input(args, needle):
    res = run(launch(*args))
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], res.output


@pytest.mark.parametrize("launcher", ["local", "mpiexec"])
def test_exit_code_of_the_command_is_returned(launcher):
    res = run(
        launch(
            "--launcher",
            launcher,
            "-n",
            "2",
            "python3",
            "-c",
            "import os, sys; sys.exit(0 if os.environ.get('RANK', os.environ.get('OMPI_COMM_WORLD_RANK'))"
            " == '0' else 7)",
        )
    )
    assert res.returncode == 7 if launcher == "local" else res.returncode != 0, res.output
    ok = run(launch("--launcher", launcher, "-n", "2", "python3", "-c", "pass"))
    assert ok.returncode == 0, ok.output


def _last_pid():
    return int(Path("/proc/loadavg").read_text().split("/")[-1].split()[-1])


def _open_mpi() -> bool:
    exe = L.find_mpiexec()
    return exe is not None and L.mpi_flavor(exe) == "openmpi"


@pytest.mark.skipif(not Path("/proc/loadavg").exists(), reason="needs Linux's /proc/loadavg (the last process id)")
@pytest.mark.parametrize("remote_base", [False, True], ids=["default", "remote-tmpdir-set"])
def test_a_session_folder_left_by_a_killed_open_mpi_run_fails_no_later_run(tmp_path, remote_base):
    """prterun keeps its session files in <tmp>/ompi.<its pid>, and one that a killed prterun left there
    fails the next prterun of that pid ("The PMIx server's listener thread failed to start"): with such a
    folder for each of the next 2,000 process ids, a launch through mpiexec still runs, and leaves nothing
    (also when the user placed only other hosts' session files)."""
    if not _open_mpi():
        pytest.skip("needs Open MPI's mpiexec (this environment's, or on PATH)")
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    first, nodename = _last_pid(), socket.gethostname()
    for pid in range(first + 1, first + 2001):  # past pid_max, Linux starts again at 300
        stale = tmp_path / f"ompi.{pid if pid < pid_max else 300 + pid - pid_max}"
        stale.mkdir(exist_ok=True)
        for host in {nodename, nodename.split(".")[0]}:
            (stale / f"pmix.{host}.tool").write_text("prterun-stale@0.0;tcp4://127.0.0.1:1\n")
    env = clean_env(TMPDIR=str(tmp_path), **({"PRTE_MCA_prte_remote_tmpdir_base": "/tmp"} if remote_base else {}))
    res = run(launch("--launcher", "mpiexec", "-n", "2", "python3", "-c", "pass"), env=env)
    assert (_last_pid() - first) % pid_max < 2000, "more processes started meanwhile than the test covered"
    assert res.returncode == 0, res.output
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("ompi.")) == []


def test_a_killed_launchs_folders_are_removed_by_the_next_launch(tmp_path):
    """A SIGKILLed launch (the out-of-memory killer, a scheduler's hard stop) cannot remove its folders (the
    ranks' process ids, the MPI launcher's session files): the next launch on the host removes them, and
    keeps those of a running launch and of another host (a temporary folder several hosts share; a
    container with the host's name counts as another)."""
    env = clean_env(TMPDIR=str(tmp_path))
    sleeping = launch("-n", "2", "python3", "-c", "import time; time.sleep(120)")
    with spawn(sleeping, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as p:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("mmm-*")) and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.1)
        time.sleep(1.0)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    left = sorted(tmp_path.glob("mmm-*"))
    assert left and all(f"-{p.pid}-" in f.name for f in left), left
    running = Path(tempdirs.make("pids", str(tmp_path)))  # this test's process: running
    ours = tempdirs.prefix("pids").split("-")[2]
    other = tmp_path / f"mmm-pids-{'0' * 8 if ours != '0' * 8 else '1' * 8}-{p.pid}-1-{p.pid}-abcdefgh"
    other.mkdir()
    # a launch gone whose group runs on (a terminal's foreground job: its launcher and ranks shared its group)
    group = tmp_path / f"mmm-mpi-{ours}-{p.pid}-1-{os.getpgid(0)}-abcdefgh"
    group.mkdir()
    res = run(launch("-n", "1", "python3", "-c", "pass"), env=env)
    assert res.returncode == 0, res.output
    assert sorted(tmp_path.glob("mmm-*")) == sorted([running, other, group]), left


@pytest.mark.parametrize("where", ["--mpi-args", "param-file", "environment"])
def test_open_mpis_session_folder_stays_where_the_user_put_it(tmp_path, where):
    """A user's own prte_tmpdir_base (which prterun refuses beside launch's prte_local_tmpdir_base) or
    prte_local_tmpdir_base, set on the command line, in ~/.prte/mca-params.conf or in the environment, is
    where the session files go: launch adds nothing."""
    if not _open_mpi():
        pytest.skip("needs Open MPI's mpiexec (this environment's, or on PATH)")
    mine, home = tmp_path / "mine", tmp_path / "home"
    mine.mkdir()
    (home / ".prte").mkdir(parents=True)
    (home / ".prte" / "mca-params.conf").write_text(
        f"# a site's choice\nprte_tmpdir_base = {mine}\n" if where == "param-file" else "# nothing set\n"
    )
    flags = ["--mpi-args", f"--prtemca prte_tmpdir_base {mine}"] if where == "--mpi-args" else []
    env = clean_env(
        HOME=str(home), **({"PRTE_MCA_prte_local_tmpdir_base": str(mine)} if where == "environment" else {})
    )
    show = "import os; print('SESSION', os.environ['PMIX_SERVER_TMPDIR'])"
    res = run(launch("--launcher", "mpiexec", "-n", "1", *flags, "python3", "-c", show), env=env)
    assert res.returncode == 0, res.output
    (line,) = [ln for ln in res.stdout.splitlines() if ln.startswith("SESSION ")]
    assert Path(line.split()[1]).parent == mine, res.output


def _ranks_noting_themselves(folder, n):
    """n real processes that note themselves as mmm's ranks do at setup, then wait for their fate."""
    code = (
        "import sys, time\nfrom mmm.dist import liveness\nliveness.record_pid(int(sys.argv[1]))\n"
        "line = sys.stdin.readline().strip()\n"
        "if line: liveness.record_exit(line); sys.exit(int(line))\ntime.sleep(60)\n"
    )
    env = clean_env(MMM_PID_DIR=str(folder))
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(r)], env=env, stdin=subprocess.PIPE, text=True)
        for r in range(n)
    ]
    deadline = time.monotonic() + 30
    while len(list(folder.iterdir())) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return procs


def _watch(folder, n, fates):
    """Start a RankWatch, then deal each rank its fate in order: "kill" (SIGKILL) or an exit code."""
    procs = _ranks_noting_themselves(folder, n)
    w = L.RankWatch(str(folder), n)
    w.start()

    def until(condition):
        deadline = time.monotonic() + 30
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert condition()

    try:
        until(lambda: len(w.rank_of) == n)  # the watch has found every rank
        for k, (rank, fate) in enumerate(fates):
            if fate == "kill":
                procs[rank].kill()
            else:
                procs[rank].stdin.write(f"{fate}\n")
                procs[rank].stdin.flush()
            procs[rank].wait(timeout=30)
            until(lambda: sum(map(len, w.ended)) == k + 1)  # seen ending before the next one goes
    finally:
        for p in procs:
            p.kill()
            p.wait()
        w.done.set()
        w.join(timeout=5)
    assert not w.blind
    return w.first_silent()


def test_rank_watch_names_the_rank_killed_first_not_those_killed_after(tmp_path):
    """MPICH's Hydra kills every rank once one dies and names some process; launch names the first."""
    named = _watch(tmp_path, 3, [(1, "kill"), (0, "kill"), (2, "kill")])
    assert named is not None and named.startswith("rank 1 (pid ") and "died first" in named, named


def test_rank_watch_skips_ranks_that_finished_and_defers_to_a_rank_that_spoke(tmp_path):
    (tmp_path / "a").mkdir()
    named = _watch(tmp_path / "a", 3, [(0, "0"), (2, "kill"), (1, "kill")])  # rank 0 finished well first
    assert named is not None and named.startswith("rank 2 (pid "), named
    (tmp_path / "b").mkdir()  # a rank that left with an error of its own said so: nothing to add
    assert _watch(tmp_path / "b", 3, [(2, "1"), (0, "kill"), (1, "kill")]) is None
    (tmp_path / "c").mkdir()  # a rank that never noted itself (another host): the order is not known
    assert L.RankWatch(str(tmp_path / "c"), 4).first_silent() is None
    (tmp_path / "c" / "another-host.1").write_text("0")  # a note from another host is not this host's pid 1
    mine = subprocess.Popen(["sleep", "30"])  # and one of this host, so we know the watcher has looked
    try:
        (tmp_path / "c" / f"{socket.gethostname()}.{mine.pid}").write_text("1")
        w = L.RankWatch(str(tmp_path / "c"), 2)
        w.start()
        deadline = time.monotonic() + 10
        while mine.pid not in w.rank_of and time.monotonic() < deadline:
            time.sleep(0.02)
        w.done.set()
        w.join(timeout=5)
    finally:
        mine.kill()
        mine.wait()
    assert w.rank_of == {mine.pid: "1"}, w.rank_of  # looked, took this host's note, skipped the other's
    assert w.first_silent() is None


_RULE = b"-" * 74 + b"\n"
_EXIT_BOX = (  # what Open MPI 5's mpiexec prints after a rank's non-zero exit
    _RULE + b"prterun detected that one or more processes exited with non-zero status,\n"
    b"thus causing the job to be terminated. The first process to do so was:\n\n"
    b"   Process name: [prterun-vm-1@1,1]\n   Exit code:    2\n" + _RULE
)
_KILLED_BOX = (
    _RULE + b"prterun noticed that process rank 0 with PID 1 on node vm exited on\nsignal 9 (Killed).\n" + _RULE
)


def _filtered(data: bytes, code: int, cut: int) -> bytes:
    """``data`` through launch's stderr filter in two reads split at ``cut``, then the exit ``code``."""
    r, w = os.pipe()
    box = ExitBoxFilter(L.FLAVORS["openmpi"].supervision.exit_box, fd=w)
    box._feed(data[:cut])
    box._feed(data[cut:])
    box.finish(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        return f.read()


@pytest.mark.parametrize(
    "data, code, shown",
    [
        (b"x: error: bad\n" + _EXIT_BOX, 2, b"x: error: bad\n"),  # a usage error ends with its own line
        (b"x: error: bad\n" + _EXIT_BOX, 3, b"x: error: bad\n" + _EXIT_BOX),  # any other failure keeps it
        (_KILLED_BOX + _EXIT_BOX + b"after\n", 2, _KILLED_BOX + b"after\n"),  # other boxes and lines stay
        (b"prog: error: loss is nan at iter 3\n" + _EXIT_BOX, 65, b"prog: error: loss is nan at iter 3\n"),  # said
        (b"bad data\n" + _EXIT_BOX, 65, b"bad data\n" + _EXIT_BOX),  # another program's 65, unsaid: kept
        (b"step 1\rstep 2\r-- not a rule\n" + _RULE, 2, b"step 1\rstep 2\r-- not a rule\n" + _RULE),
    ],
)
def test_open_mpi_exit_box_dropped_only_after_a_usage_error(data, code, shown):
    for cut in range(len(data) + 1):  # however the pipe splits it
        assert _filtered(data, code, cut) == shown, cut


def test_drop_lost_hosts_is_refused_where_it_cannot_act():
    from conftest import run

    for argv, needle in (
        (["--drop-lost-hosts", "true"], "--drop-lost-hosts acts on a relaunch: add --retries N"),
        (["--retries", "1", "--drop-lost-hosts", "--launcher", "local", "true"], "needs a job on several hosts"),
        (["--retries", "1", "--drop-lost-hosts", "--launcher", "mpiexec", "-n", "2", "true"], "needs a job on several"),
    ):
        res = run([sys.executable, "-m", "mmm.launch", *argv], timeout=30)
        assert res.returncode == 2 and needle in res.stderr, res.output


# --------------------------------------------------------------------------- the rank watch's channel
def _watcher(w, host: str, token: str) -> socket.socket:
    """A connection to launch's rank watch, as another host's watcher makes it (its hello sent)."""
    _, port, _ = w.address.rsplit(":", 2)
    s = socket.create_connection(("127.0.0.1", int(port)), timeout=10)
    s.sendall((json.dumps({"host": host, "token": token, "t": time.time()}) + "\n").encode())
    return s


def _until(condition, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_rank_watch_channel_stuck_from_other_hosts_connections_and_signals(tmp_path, monkeypatch):
    """launch's host may run no rank (Hydra with a hostfile, from a login node): a host whose ranks all
    ended with a failure long ago, by its watcher's reports, makes the launcher stuck all the same. Closed
    connections leave room for new ones; a stranger (a wrong token) is dropped; signals launch relays go to
    every watcher; the server listens on the job's interface, not on every one."""
    monkeypatch.setattr(W, "MAX_CONNECTIONS", 3)
    w = L.RankWatch(str(tmp_path), 2, listen=True, hosts=["127.0.0.2"])
    try:
        assert w._server.getsockname()[0] == "127.0.0.1"  # the route to the job's other host, not 0.0.0.0
        assert w.address.startswith("127.0.0.1:")  # and the address it hands out is the one it listens on
        from mmm.dist.liveness import _is_this_host

        assert _is_this_host("127.0.0.1", "elsewhere") and not _is_this_host("192.0.2.1", "elsewhere")
        token = w.address.rsplit(":", 1)[1]
        for _ in range(5):  # more than MAX_CONNECTIONS, each closed: none is kept
            _watcher(w, "nodeX", "wrong").close()
        assert _until(lambda: not w._conns), w._conns
        s = _watcher(w, "node2", token)
        s.sendall((json.dumps({"seen": 2}) + "\n").encode())
        assert _until(lambda: "node2" in w.remote) and w.stuck() is None  # its 2 ranks run
        long_ago = time.time() - W.STUCK_AFTER_S - 5
        s.sendall((json.dumps({"batch": [long_ago, [[11, "0", None], [12, "1", "1"]]], "seen": 2}) + "\n").encode())
        assert _until(lambda: w.stuck() is not None), w.remote
        why, code = w.stuck()
        assert "node2" in why and code == 1, (why, code)
        w.signal_ranks(signal.SIGUSR2)
        s.settimeout(10)
        assert json.loads(s.makefile().readline()) == {"signal": int(signal.SIGUSR2)}
        s.close()
    finally:
        w.close()
    assert not w._conns


def test_a_watcher_passes_launchs_signals_to_its_hosts_ranks(tmp_path):
    """The other side: a host's watcher sends SIGUSR1/SIGUSR2, SIGINT and SIGTERM from launch to each of its
    live ranks, and nothing else; a stopping signal also to a rank that notes itself later (still starting)."""
    import select

    from mmm.dist.rankwatch import HostWatch, _relay_signals

    def rank_process(name):
        code = (
            "import signal, sys, time\n"
            f"signal.signal(signal.SIGUSR2, lambda *a: open({str(tmp_path / (name + '.usr2'))!r}, 'a').write('x'))\n"
            f"signal.signal(signal.SIGTERM, lambda *a: open({str(tmp_path / (name + '.term'))!r}, 'w').close())\n"
            "signal.signal(signal.SIGHUP, lambda *a: sys.exit(5))\n"
            "print('ready', flush=True); time.sleep(30)\n"
        )
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        return p

    notes = tmp_path / "notes"
    notes.mkdir()
    ranks = [rank_process("r0")]
    try:
        watch = HostWatch(notes, 2)
        watch.rank_of[ranks[0].pid] = "0"
        ours, launchs = socket.socketpair()
        t = threading.Thread(target=_relay_signals, args=(ours, watch), daemon=True)
        t.start()
        for signum in (signal.SIGHUP, signal.SIGUSR2, signal.SIGTERM):  # SIGHUP: refused
            launchs.sendall(f'{{"signal": {int(signum)}}}\n'.encode())
        assert _until(lambda: (tmp_path / "r0.usr2").exists() and (tmp_path / "r0.term").exists()), "not passed on"
        launchs.sendall(f'{{"signal": {int(signal.SIGUSR2)}}}\n'.encode())  # each request passed on, a repeat too
        assert _until(lambda: (tmp_path / "r0.usr2").read_text() == "xx"), (tmp_path / "r0.usr2").read_text()
        assert ranks[0].poll() is None  # the SIGHUP line was not
        ranks.append(rank_process("r1"))  # a rank that notes itself after the SIGTERM: it gets it too
        (notes / f"{watch.host}.{ranks[1].pid}").write_text("1")
        watch._look(select.poll(), {})
        assert _until((tmp_path / "r1.term").exists) and not (tmp_path / "r1.usr2").exists()
        launchs.close()
        t.join(timeout=5)
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()


def test_a_probe_held_up_by_a_busy_scheduler_keeps_its_host(tmp_path):
    """After a failure, launch probes each host; a probe that times out is a lost host, unless the scheduler
    said it was only busy (srun: "Requested nodes are busy"): that host stays."""
    from mmm.launch.allocation import Allocation
    from mmm.launch.hostloss import lost_hosts
    from mmm.launch.plan import LaunchPlan

    busy = tmp_path / "busy.sh"
    busy.write_text("#!/bin/sh\necho 'srun: Job 7 step creation temporarily disabled, retrying (Requested nodes are "
                    "busy)' >&2\nsleep 30\n")  # fmt: skip
    silent = tmp_path / "silent.sh"
    silent.write_text("#!/bin/sh\nsleep 30\n")
    for f in (busy, silent):
        f.chmod(0o755)
    alloc = Allocation("slurm", ["node1", "node2"], 2, 0)
    plan = LaunchPlan("srun", ["srun", "python3"], 4, 2, alloc)

    def probe(hostfile, env):
        host = open(hostfile).read().split()[0]
        return LaunchPlan("srun", [str(busy if host == "node1" else silent)], 1, 1, alloc)

    t0 = time.monotonic()
    assert lost_hosts(plan, {}, probe, timeout_s=1.0) == ["node2"]
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("starting_s", [0, 2], ids=["running", "starting"])
def test_ctrl_c_while_probing_hosts_stops_every_probe(tmp_path, starting_s):
    """Ctrl-C while launch probes the hosts after a failure: every probe (and what it started) is stopped at
    once, and launch leaves with one line and exit 130, not a traceback after the probes' 30 s. Also a probe
    whose start was under way at the Ctrl-C (a busy machine: it started after launch stopped the others,
    and launch waited out its 30 s)."""
    silent = tmp_path / "silent.sh"
    silent.write_text(f"#!/bin/sh\nexec sleep 3{os.getpid() % 10}7\n")  # a probe of a host that is gone
    silent.chmod(0o755)
    code = (
        "import sys\n"
        "from mmm.launch.allocation import Allocation\n"
        "from mmm.launch.cli import main\n"
        "from mmm.launch import cli, hostloss\n"
        "from mmm.launch.plan import LaunchPlan\n"
        "alloc = Allocation('slurm', ['node1', 'node2'], 2, 0)\n"
        "plan = LaunchPlan('srun', ['srun', 'python3'], 4, 2, alloc)\n"
        "import time\n"
        f"probe = lambda hostfile, env: time.sleep({starting_s}) or LaunchPlan('srun', [{str(silent)!r}], 1, 1, "
        "alloc)\n"
        "cli._main = lambda argv: print('probing', flush=True) or hostloss.lost_hosts(plan, {}, probe) or 0\n"
        "sys.exit(main([]))\n"
    )
    with spawn([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE) as p:
        assert p.stdout.readline().strip() == "probing"
        time.sleep(1.0)
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=20)
        seconds = time.monotonic() - t0
    probes = subprocess.run(["pgrep", "-f", f"sleep 3{os.getpid() % 10}7"], capture_output=True, text=True).stdout
    assert p.returncode == 130 and "Traceback" not in err and seconds < 5, (p.returncode, seconds, err)
    assert "interrupted (Ctrl-C)" in err and not probes.split(), (err, probes)


def test_a_lost_host_whose_name_does_not_resolve_is_called_a_typo():
    """After a failed attempt, a host that does not answer because its name resolves nowhere (a typo in the
    hostfile) is said to be one, not a host lost to a crash with --drop-lost-hosts as the fix."""
    from mmm.launch.run import lost_hosts_message

    typo = lost_hosts_message(["localhost", "nosuchnode.invalid"], retries=False)
    assert typo.startswith("host nosuchnode.invalid: no such host (the name does not resolve here; a typo")
    assert "; host localhost did not answer after the failure: lost" in typo  # the others still said
    lost = lost_hosts_message(["localhost"], retries=False)
    assert lost.startswith("host localhost did not answer after the failure: lost") and "--drop-lost-hosts" in lost


def test_the_local_spawner_names_a_killed_rank_when_the_others_end_by_themselves():
    """A rank killed by a signal says nothing itself; the others end on their own (they found their peer gone):
    the spawner names it with its signal, as it does when it has to stop the others."""
    code = (
        "import os, signal, sys, time\n"
        "if os.environ['RANK'] == '1': os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(0.5); sys.exit(1)\n"
    )
    res = run(launch("--launcher", "local", "-n", "2", "python3", "-c", code), timeout=60)
    assert res.returncode == 137, res.output
    assert res.stderr.strip().splitlines()[1:] == ["launch: error: rank 1 was killed by SIGKILL (exit 137)"], res.stderr
