"""Bad input, dead ranks, signals and teardown, with real processes: clear, fast, never a hang."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import (
    SCRIPTS,
    alive,
    assert_clean_user_error,
    clean_env,
    descendants,
    group_alive,
    launch,
    mpiexec,
    run,
    spawn,
    torchrun,
)


@pytest.mark.parametrize("runner", ["launch-local", "mpiexec"])
def test_invalid_degrees_one_line_every_rank_fails(runner):
    args = ("-m", "mmm", "--tp", "3", "--pp", "0")
    cmd = launch("--launcher", "local", "-n", "4", "python3", *args) if runner == "launch-local" else mpiexec(4, *args)
    res = run(cmd, timeout=60)
    # argparse rejects pp=0 before anything starts
    assert_clean_user_error(res, "argument --pp/--ppsize: 0 is not a degree")
    res = run(
        launch("--launcher", "local", "-n", "4", "python3", "-m", "mmm", "--tp", "3")
        if runner == "launch-local"
        else mpiexec(4, "-m", "mmm", "--tp", "3"),
        timeout=60,
    )
    assert_clean_user_error(res, "tp=3 does not divide world size 4; valid tp for 4 ranks: 1, 2, 4")
    mmm_errors = [line for line in res.stderr.splitlines() if "python -m mmm: error:" in line]
    assert len(mmm_errors) == 1, res.stderr  # printed once (rank 0), yet every rank exits non-zero
    assert res.seconds < 30


def test_usage_error_under_open_mpi_ends_with_its_own_line():
    """`launch` over Open MPI's mpiexec: a usage error (exit 2) is the last line, without prterun's
    "exited with non-zero status" box after it; any other failure keeps the box."""
    res = run(launch("--launcher", "mpiexec", "-n", "2", "python3", "-m", "mmm", "--tp", "3"), timeout=60)
    assert res.returncode == 2, res.output
    assert "prterun" not in res.stderr and "-" * 20 not in res.stderr, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("python -m mmm: error: invalid mesh for 2 ranks: tp=3 does not divide world size 2"), last
    res = run(launch("--launcher", "mpiexec", "-n", "2", "python3", "-c", "import sys; sys.exit(3)"), timeout=60)
    assert res.returncode == 3 and "prterun detected that one or more processes exited" in res.stderr, res.output


def test_every_rank_exits_nonzero_on_bad_input():
    """Each of 4 ranks, started by hand (no launcher to stop the others at the first exit), leaves
    with exit code 2; rank 0 alone prints the one line; no traceback anywhere."""
    from mmm.dist import free_port

    env = clean_env(WORLD_SIZE="4", LOCAL_WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "mmm", "--tp", "3"],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        for r in range(4)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [2, 2, 2, 2], outs
    assert "tp=3 does not divide world size 4" in outs[0][1]
    assert all("error:" not in err for _, err in outs[1:]), outs
    assert all("Traceback" not in out + err for out, err in outs), outs


@pytest.mark.parametrize(
    "variables, needle",
    [
        ({"MMM_DEVICE": "cuda"}, "MMM_DEVICE=cuda but this machine has none"),
        ({"MMM_DEVICE": "gpu"}, "MMM_DEVICE='gpu': the device takes one of auto, cpu, cuda, xpu, mps"),  # by launch
        ({"MMM_BACKEND": "nccl"}, "MMM_BACKEND=nccl: this torch ("),  # a backend torch knows, not built here
    ],
    ids=["cuda", "gpu", "nccl"],
)
def test_unavailable_or_unknown_device_or_backend(variables, needle):
    import torch

    if variables.get("MMM_DEVICE") == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the refusal of a missing one cannot be seen here")
    if variables.get("MMM_BACKEND") == "nccl" and torch.distributed.is_nccl_available():
        pytest.skip("this torch has NCCL: the refusal of a backend it lacks cannot be seen here")
    res = run(launch("--launcher", "local", "-n", "2", "python3", "-m", "mmm"), env=clean_env(**variables), timeout=60)
    assert_clean_user_error(res, needle)


@pytest.mark.parametrize(
    "addr, code, needle",
    [
        ("no.such.host.invalid", 2, "MASTER_ADDR=no.such.host.invalid: no such host"),
        ("127.0.0.1", 1, "the 2 ranks did not all meet at 127.0.0.1:"),
    ],
    ids=["unknown-host", "no-peer"],
)
def test_a_rendezvous_that_cannot_happen_is_one_line(addr, code, needle):
    """Rank 0 of 2 alone (no launcher): a MASTER_ADDR no rank could reach is named at once (torch's store
    would retry it with a warning a second until the timeout); a peer that never comes is said with the
    timeout given (3 s here, not the 600 s default)."""
    from mmm.dist.rendezvous import free_port

    env = clean_env(WORLD_SIZE="2", RANK="0", MASTER_ADDR=addr, MASTER_PORT=str(free_port()), MMM_TIMEOUT="3")
    res = run([sys.executable, "-m", "mmm"], env=env, timeout=60)
    assert res.returncode == code, res.output
    assert_clean_user_error(res, needle)
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    if code == 1:
        assert "within 3 s (MMM_TIMEOUT, or the trainers' --timeout): rank 0 waited" in res.stderr, res.stderr


@pytest.mark.parametrize(
    "variables, needle",
    [
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0': a count launchers set takes a positive integer"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x': a rank or node id launchers set takes an integer >= 0"),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK is not"),
    ],
    ids=["world-0", "rank-x", "no-rank"],
)
def test_bad_rank_variables_are_said_by_the_process_itself(variables, needle):
    """Who this process is cannot be known, so it cannot leave the message to rank 0: it says it (was
    exit 2 with nothing printed)."""
    res = run([sys.executable, "-m", "mmm"], env=clean_env(**variables), timeout=60)
    assert res.returncode == 2, res.output
    assert_clean_user_error(res, needle)


def test_report_dir_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    res = run([sys.executable, "-m", "mmm", "--report-dir", str(f)])
    assert_clean_user_error(res, f"--report-dir {f} exists and is not a directory")


@pytest.mark.parametrize("runner", ["launch-local", "mpiexec", "torchrun"])
@pytest.mark.parametrize("mode", ["exit", "raise"])
def test_a_dead_rank_does_not_leave_the_others_waiting(runner, mode):
    script = str(SCRIPTS / "dead_rank.py")
    cmd = {
        "launch-local": launch("--launcher", "local", "-n", "3", "python3", script, mode),
        "mpiexec": mpiexec(3, script, mode),
        "torchrun": torchrun(3, script, mode),
    }[runner]
    res = run(cmd, env=clean_env(MMM_TIMEOUT="300"), timeout=90)
    assert res.returncode != 0, res.output
    assert res.seconds < 60, res.seconds  # far below the 300 s collective timeout
    if mode == "raise":
        assert "RuntimeError: rank 1 failed on purpose" in res.stderr
        assert "[rank 1] Traceback" in res.stderr


def _wait_ready(p: subprocess.Popen, ranks: int, timeout: float = 60) -> None:
    seen = ""  # two ranks share the pipe: their lines may interleave, so count the words
    deadline = time.monotonic() + timeout
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(p.stdout.readline, "")), daemon=True)
    reader.start()
    while (seen := "".join(lines)).count("READY") < ranks and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.1)
    assert seen.count("READY") == ranks, seen


def _as_background_job() -> None:
    """What a non-interactive shell does to `cmd &` (and what `nohup make test &` hands to pytest)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)


@pytest.mark.parametrize(
    "sig, code, inherited",
    [
        (signal.SIGTERM, 143, "default"),
        (signal.SIGINT, 130, "default"),
        (signal.SIGINT, 130, "background job"),  # launch started with SIGINT ignored
        (signal.SIGTERM, 143, "background job"),
    ],
)
def test_launch_forwards_signals_and_ranks_exit_cleanly(sig, code, inherited):
    cmd = launch("--launcher", "local", "-n", "2", "python3", str(SCRIPTS / "wait_forever.py"))
    pre = _as_background_job if inherited == "background job" else None
    with spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=pre) as p:
        _wait_ready(p, 2)
        p.send_signal(sig)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"launch did not stop within 30 s of a forwarded {sig.name}")
        err = p.stderr.read()
        assert p.returncode == code, err
        assert group_alive(p.pid) == [], "ranks left behind"
    if sig == signal.SIGTERM:
        assert err.count("terminated by SIGTERM") == 2, err
    assert "exited with code" not in err  # a forwarded signal is not reported as a rank failure
    assert "sending SIGTERM" not in err  # the signal itself stopped the ranks: no escalation


@pytest.mark.parametrize("runner, busy", [("mpiexec", False), ("torchrun", True)])
def test_ranks_whose_launcher_is_killed_leave_at_once(runner, busy, tmp_path):
    """SIGKILL to the launcher's process group (launch and its mpiexec; torchrun's agent) reaches no rank:
    mpiexec's daemon starts them in process groups of their own, torchrun in sessions of their own. Each
    rank sees that its launcher is gone and leaves within seconds: nothing runs on. ``busy``: the ranks
    are in a section that must not be cut (a checkpoint write, 5 s): they finish it, then leave."""
    script = str(SCRIPTS / "wait_forever.py")
    extra = ["--busy", str(tmp_path)] if busy else []
    cmd = launch("-n", "2", "python3", script, *extra) if runner == "mpiexec" else torchrun(2, script, *extra)
    with spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as p:
        _wait_ready(p, 2)
        ranks = [
            pid for pid in descendants(p.pid) if _cmdline(pid).startswith(sys.executable) and script in _cmdline(pid)
        ]
        ranks = [pid for pid in ranks if _cmdline(pid).split()[1] in ("-u", script)]  # not launch, not torchrun
        assert len(ranks) == 2, [_cmdline(pid) for pid in descendants(p.pid)]
        os.killpg(p.pid, signal.SIGKILL)
        t0 = time.monotonic()
        while [pid for pid in ranks if alive(pid)] and time.monotonic() - t0 < 20:
            time.sleep(0.1)
        left = [pid for pid in ranks if alive(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"ranks {left} outlived their launcher by 20 s"
        took = time.monotonic() - t0
        err = p.communicate(timeout=30)[1]  # every writer is gone
    if busy:
        assert sorted(f.name for f in tmp_path.iterdir()) == ["rank-0", "rank-1"]  # the sections ended first
        assert 3 < took < 13, took
    else:
        assert took < 8, took
    if runner == "torchrun":  # its ranks write to the stderr they inherited (mpiexec's relay is gone)
        assert err.count("its launcher (pid") == 2, err


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_a_sigint_that_stops_nothing_escalates_to_sigterm():
    """Ranks that ignore SIGINT (a user's program may): launch follows the forwarded SIGINT with SIGTERM
    after its grace period instead of waiting forever."""
    cmd = launch("--launcher", "local", "-n", "2", "python3", str(SCRIPTS / "wait_forever.py"), "--ignore-sigint")
    with spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as p:
        _wait_ready(p, 2)
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("launch did not stop a job whose ranks ignore SIGINT")
        took = time.monotonic() - t0
        err = p.stderr.read()
        assert group_alive(p.pid) == [], "ranks left behind"
    assert "SIGINT did not stop the job within 10 s; sending SIGTERM" in err, err
    assert err.count("terminated by SIGTERM") == 2, err
    assert p.returncode == 143, err
    assert 9 < took < 40, took


def test_import_mmm_and_parallel_stay_light():
    code = (
        "import sys, mmm; assert 'torch' not in sys.modules, 'import mmm pulled torch'\n"
        "from mmm.parallel import init_mesh\n"
        "heavy = [m for m in ('deepspeed', 'xarray', 'matplotlib', 'plotext', 'torchinfo', 'mpi4py',"
        " 'transformers', 'wandb', 'tensorboard', 'datasets') if m in sys.modules]\n"
        "assert not heavy, heavy\nprint('light')"
    )
    res = run([sys.executable, "-c", code])
    assert res.returncode == 0 and res.stdout.strip() == "light", res.output
    # the launch command starts ranks: it never imports torch itself
    code = "import sys, mmm.launch.cli; assert 'torch' not in sys.modules, 'launch pulled torch'; print('light')"
    res = run([sys.executable, "-c", code])
    assert res.returncode == 0 and res.stdout.strip() == "light", res.output


@pytest.mark.parametrize(
    "make, peer",
    [
        (lambda: ConnectionRefusedError("[Errno 111] Connection refused"), False),  # the user's own socket
        (lambda: TimeoutError("operation timed out"), False),
        (lambda: RuntimeError("read error while parsing config.json"), False),
        (
            lambda: RuntimeError(
                "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:51234"
            ),
            True,
        ),
        (
            lambda: RuntimeError(
                "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                "10000ms for recv operation to complete"
            ),
            True,
        ),
    ],
    ids=["user-socket", "user-timeout", "user-read-error", "gloo-peer-closed", "gloo-timeout"],
)
def test_only_collective_failures_become_one_line_peer_errors(make, peer):
    """A real bug whose text happens to say 'connection refused' or 'timed out' keeps its traceback."""
    from mmm.dist import peer_failure_message

    assert (peer_failure_message(make()) is not None) == peer


def test_run_main_runs_the_programs_atexit_handlers(tmp_path):
    res = run(launch("-n", "2", "python3", str(SCRIPTS / "atexit_rank.py"), str(tmp_path)), timeout=60)
    assert res.returncode == 0, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.txt", "rank1.txt"]


def test_a_program_that_never_tears_down_exits_cleanly(tmp_path):
    """The docs' first snippet: init_mesh starts the process group, and the program ends without
    teardown(). Every rank leaves at exit with 0 (each rank's watcher, waiting on rank 0's store, used to be
    cut off by rank 0's exit: an abort, exit 134 on 2 ranks as on 4, and pages of the store client's warnings)."""
    script = tmp_path / "mesh_only.py"
    script.write_text("from mmm.parallel import init_mesh\nmesh = init_mesh(tp=2)\nprint('dims', mesh.tp, mesh.dp)\n")
    res = run(launch("-n", "2", "python3", str(script)), timeout=120)
    assert res.returncode == 0, res.output
    assert res.stdout.count("dims 2 1") == 2, res.output
    assert "terminate called" not in res.output and "TCPStore" not in res.output, res.output


def test_a_usage_error_on_one_rank_only_is_reported_by_that_rank():
    """UsageError assumes every rank hit the same error and leaves the printing to rank 0; when rank 0
    did not (a file missing on one node), the rank that did says so instead of exiting silently."""
    res = run(launch("--launcher", "local", "-n", "2", "python3", str(SCRIPTS / "rank_local_error.py")), timeout=60)
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if "error:" in ln and "launch:" not in ln]
    assert lines[0] == (
        "[rank 1] rank_local_error.py: error: --data-dir '/nodes/own/disk': no such directory on this node"
    ), res.output
    assert len(lines) >= 2 and all("rank 1 stopped answering" in ln for ln in lines[1:]), res.output  # rank 0


def test_only_the_dead_rank_is_named_while_live_ones_are_busy(tmp_path):
    """Rank 1 dies while rank 2 waits inside another collective and rank 3 computes: the roll call is
    answered by each live rank's watcher thread, so every survivor names rank 1 and no other; each
    live rank writes where it was to <stack dir>/rank-<r>.txt and the message points there."""
    from mmm.dist import free_port

    env = clean_env(
        WORLD_SIZE="4",
        LOCAL_WORLD_SIZE="4",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        MMM_STACK_DIR=str(tmp_path / "stacks"),
        MMM_TIMEOUT="60",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPTS / "dead_rank.py"), "busy"],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        for r in range(4)
    ]
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            p.kill()  # pass or fail, no rank is left behind
    assert [p.returncode for p in procs] == [1, 3, 1, 1], outs
    for rank in (0, 2, 3):
        err = outs[rank][1]
        line = [ln for ln in err.splitlines() if f"[rank {rank}] dead_rank.py: error:" in ln]
        assert len(line) == 1 and "lost contact with another rank" in line[0], err
        assert f"{tmp_path / 'stacks'}/rank-*.txt" in line[0], err
        assert "Traceback" not in err, err
        # rank 0 holds the rendezvous store: it can always call the roll. Ranks 2 and 3 fail seconds
        # later, when rank 0 may have left with the store: then they name nobody, never a live rank.
        names_rank_1 = "error: rank 1 stopped answering" in line[0]  # "rank 1", not "ranks 1, 2"
        assert names_rank_1 if rank == 0 else names_rank_1 or "stopped answering" not in line[0], err
    stacks = (tmp_path / "stacks" / "rank-2.txt").read_text()
    assert "in_the_pair" in stacks and "roll call" in stacks, stacks  # rank 2 was in the pair's all-reduce
    assert (
        not (tmp_path / "stacks" / "rank-1.txt").exists()
        or "roll call" not in (tmp_path / "stacks" / "rank-1.txt").read_text()
    )


def test_a_teardown_that_hangs_is_cut_short():
    """After a failure a peer's host may be gone without a word (link cut): destroying the process group
    can then wait forever, and the rank would stay behind holding its device. finish() leaves anyway."""
    code = (
        "import time\n"
        "from mmm.dist import exits\n"
        "exits.TEARDOWN_AFTER_FAILURE_S = 1.0\n"
        "exits.teardown = lambda **kw: time.sleep(3600)  # what a dead peer's socket does to destroy()\n"
        "exits.finish(3)\n"
    )
    res = run([sys.executable, "-c", code], timeout=60)
    assert res.returncode == 3 and res.seconds < 30, res.output
    assert "teardown did not finish within 1 s" in res.stderr, res.output


def test_a_finished_run_whose_exit_handlers_outlast_the_teardown_bound_exits_0():
    """The teardown watchdog bounds teardown only: a finished run's atexit handlers (a pruned checkpoint's
    background delete waits up to 300 s) outlasting it must not turn the run's 0 into 1 (which would make
    `launch --retries` relaunch a finished job and Slurm mark it FAILED)."""
    code = (
        "import atexit, time\n"
        "from mmm.dist import exits\n"
        "exits.TEARDOWN_AFTER_FAILURE_S = 1.0\n"  # with MMM_TIMEOUT=1: the watchdog's bound is 2 s
        "atexit.register(lambda: time.sleep(3))  # a long background delete being waited for\n"
        "exits.finish(0)\n"
    )
    res = run([sys.executable, "-c", code], env=clean_env(MMM_TIMEOUT="1"), timeout=60)
    assert res.returncode == 0 and "did not finish" not in res.stderr, res.output


STORE_GONE = """
import datetime, subprocess, sys, time
import torch.distributed as dist
from mmm.dist import liveness
from mmm.dist.rendezvous import free_port
port = free_port()
host = subprocess.Popen([sys.executable, "-c", "import torch.distributed as d, time; "
                         f"s = d.TCPStore('127.0.0.1', {port}, 2, True, wait_for_workers=False); time.sleep(60)"])
deadline = time.monotonic() + 30
while True:
    try:
        store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=5))
        break
    except Exception:
        assert time.monotonic() < deadline
        time.sleep(0.2)
store.set("a", "1")
host.kill()
host.wait()
with liveness._stderr_without_store_warnings():
    print("a line of its own", file=sys.stderr)
    try:
        store.check(["a"])
    except Exception as e:
        print("the caller got", type(e).__name__, file=sys.stderr)
"""


def test_the_store_clients_warning_is_held_back_after_its_host_is_gone():
    """The store's host (rank 0) killed with the job: a roll call's store request made c10d's client print a
    warning and ~25 C++ frames on another host's rank (a wall before its one-line error). Held back now, and
    nothing else: the block's own lines pass, the caller still gets the error."""
    res = run([sys.executable, "-c", STORE_GONE], timeout=90)
    assert res.returncode == 0, res.output
    assert res.stderr.splitlines() == ["a line of its own", "the caller got DistNetworkError"], res.stderr
