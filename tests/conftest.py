"""Helpers for tests that launch real ranks (gloo on CPU) under torchrun, mpiexec and `launch`."""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).resolve().parent.parent
_STRIP = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PBS_NODEFILE",
    "PBS_JOBID",
    "SLURM_JOB_ID",
    "SLURM_PROCID",
    "SLURM_STEP_ID",
    "MMM_DEVICE",
    "MMM_BACKEND",
    "LOG_FROM_ALL_RANKS",
    "MMM_LOG_ALL_RANKS",
    "MMM_LAUNCH_TIME",
    "MMM_LAUNCHER",
    "CUDA_VISIBLE_DEVICES",
)


# the tiny Llama most tests train: GQA (8 query / 4 kv heads, so the query and key shapes differ), 2 blocks,
# dim 64: every TP split of the equivalence matrix is valid, and a step takes milliseconds
TINY_LLAMA = {"dim": 64, "n-layers": 2, "n-heads": 8, "n-kv-heads": 4, "seq-len": 32, "batch-size": 8}


def tiny_llama(*, plots: bool = False, **changes) -> list[str]:
    """The tiny Llama's flags for mmm.examples.fsdp_tp, with ``changes`` (``max_iters=5``: underscores for
    hyphens; None leaves a flag out) and ``--no-plots`` unless ``plots``."""
    values = {**TINY_LLAMA, **{k.replace("_", "-"): v for k, v in changes.items()}}
    flags = [x for k, v in values.items() if v is not None for x in (f"--{k}", str(v))]
    return flags if plots else [*flags, "--no-plots"]


# the tiny ViT and the short CNN run of the data-parallel tests
TINY_VIT = ["-m", "mmm.examples.vit", "--max-iters", "5", "--depth", "2", "--num-heads", "4", "--head-dim", "8"]
TINY_VIT += ["--img-size", "16", "--batch-size", "8", "--no-plots"]
SHORT_CNN = ["-m", "mmm.examples.fsdp", "--epochs", "2", "--steps-per-epoch", "3", "--batch-size", "32", "--no-plots"]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a test's ranks. MMM_PEAK_TFLOPS gives the MFU's peak: a CPU rank would otherwise
    time matmuls for 0.3 s at the end of every run (both cores, ~350 runs: ~2 minutes of the suite);
    ``calibrated_env()`` leaves it out, for the tests of that measurement."""
    env = {k: v for k, v in os.environ.items() if k not in _STRIP and not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MMM_RICH="0", MMM_PEAK_TFLOPS="1")
    env.update(extra)
    return env


def calibrated_env(**extra: str) -> dict[str, str]:
    """:func:`clean_env` where every CPU rank measures its peak FLOP/s, as a user's run does."""
    env = clean_env(**extra)
    del env["MMM_PEAK_TFLOPS"]
    return env


def run(cmd: list[str], *, env: dict[str, str] | None = None, timeout: float = 120, cwd=None) -> Result:
    """Run ``cmd`` to the end in a session of its own; on a timeout (a hang) every process it started
    is killed, not only the first, after SIGUSR1 (``launch`` relays it: every mmm rank prints its stacks,
    so the failure shows where each rank waits)."""
    t0 = time.monotonic()
    with spawn(cmd, env=env or clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGUSR1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.communicate(timeout=10)  # the stacks, read on
            kill_group(p)
            out, err = p.communicate()
            pytest.fail(f"timed out after {timeout}s (a hang): {cmd}\n{out}\n{err}{_stacks_of(cmd)}")
    return Result(p.returncode, out, err, time.monotonic() - t0)


@contextlib.contextmanager
def spawn(cmd: list[str], *, env: dict[str, str] | None = None, preexec_fn=None, **kw) -> Iterator[subprocess.Popen]:
    """Start ``cmd`` in a new session (its own process group) and, when the block ends, pass or fail,
    kill whatever of that group is still alive: a test never leaves ranks behind. ``cmd`` starts with SIGINT
    and SIGQUIT at their defaults, as a terminal's foreground job does, whatever this process inherited (a
    suite started as a background job, `make test &`, ignores both, and an ignored signal stays ignored
    across exec: a Python program then never sees a KeyboardInterrupt); ``preexec_fn`` runs after that."""

    def start() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)
        if preexec_fn is not None:
            preexec_fn()

    p = subprocess.Popen(
        cmd, env=env or clean_env(), text=True, stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=start, **kw
    )
    try:
        yield p
    finally:
        kill_group(p)
        p.wait()
        for f in (p.stdout, p.stderr):
            if f is not None:
                f.close()


def _stacks_of(cmd: list[str]) -> str:
    """The stacks a trainer's ranks wrote on SIGUSR1 (``<outdir>/stacks``), when ``cmd`` names an outdir."""
    if "--outdir" not in cmd[:-1]:
        return ""
    files = sorted((Path(cmd[cmd.index("--outdir") + 1]) / "stacks").glob("rank-*.txt"))
    return "".join(f"\n--- {f}\n{f.read_text(errors='replace')}" for f in files)


def proc_stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command's name (state, ppid, pgrp, ...); None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    fields = proc_stat(pid)
    return fields is not None and fields[0] != "Z"


def _processes() -> Iterator[tuple[int, list[str]]]:
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (fields := proc_stat(d.name)) is not None:
            yield int(d.name), fields


def descendants(pid: int) -> list[int]:
    """Every living process started by ``pid``, its children's children too."""
    children: dict[int, list[int]] = {}
    for child, fields in _processes():
        children.setdefault(int(fields[1]), []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_group(p: subprocess.Popen) -> None:
    """SIGKILL to ``p``'s process group and to every process it started, also those in groups of their own
    (the ranks an MPI launcher's daemon starts: left alone, they would live on, orphaned)."""
    tree = descendants(p.pid)
    for kill, target in ((os.killpg, p.pid), *((os.kill, pid) for pid in tree)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(target, signal.SIGKILL)


def group_alive(pgid: int) -> list[int]:
    """Processes still in process group ``pgid`` (zombies excluded)."""
    return [pid for pid, fields in _processes() if int(fields[2]) == pgid and fields[0] != "Z"]


def torchrun(n: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *args]


@functools.cache
def _mpi_sessions() -> str:
    """One folder of this test process for bare mpiexec's session folders, removed when it ends."""
    folder = tempfile.mkdtemp(prefix="mmm-mpi-sessions-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def mpiexec(n: int, *args: str) -> list[str]:
    """Open MPI's own mpiexec, its session files in a new folder as `launch` gives it (one left in $TMPDIR by
    a killed prterun would fail the next prterun that gets its process id)."""
    session = ["--prtemca", "prte_local_tmpdir_base", tempfile.mkdtemp(prefix="mpi-", dir=_mpi_sessions())]
    flags = ["--allow-run-as-root", "--oversubscribe", "-n", str(n)]
    return [str(BIN / "mpiexec"), *session, *flags, sys.executable, *args]


def launch(*args: str) -> list[str]:
    return [str(BIN / "launch"), *args]


def on_ranks(n: int, *args: str) -> list[str]:
    """``python <args>`` on n local ranks through ``launch`` (which imports no torch: torchrun's agent does,
    ~2 s of CPU a run). torchrun where the launcher is what a test is about."""
    return launch("-n", str(n), "python3", *args)


def until_steps(history: Path, steps: int, proc: subprocess.Popen, seconds: float = 90) -> None:
    """Wait until ``history`` (a run's history.jsonl) holds ``steps`` rows, ``proc`` has ended, or ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        if history.exists() and len(history.read_text().splitlines()) >= steps:
            return
        time.sleep(0.2)


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "error:" in line]


def assert_clean_user_error(res: Result, *needles: str) -> None:
    """Non-zero exit, no traceback, and an error line that names each needle."""
    assert res.returncode != 0, res.output
    assert "Traceback" not in res.output, res.output
    lines = error_lines(res.stderr)
    assert lines, res.output
    for needle in needles:
        assert any(needle in line for line in lines), (needle, res.output)


def run_ranks(
    n: int, args: list[str], outdir, *, runner: str = "launch", timeout: float = 300, env: dict | None = None
) -> Result:
    """Run ``python <args> --outdir outdir`` on n ranks under torchrun or `launch`; it must succeed."""
    full = [*args, "--outdir", str(outdir)]
    cmd = torchrun(n, *full) if runner == "torchrun" else launch("-n", str(n), "python3", *full)
    res = run(cmd, timeout=timeout, env=env)
    assert res.returncode == 0, res.output
    return res


def single_process_run(tmp_path_factory, name: str, args: list[str], timeout: float = 180) -> Path:
    """The one-process reference run of a trainer; returns its output folder."""
    out = tmp_path_factory.mktemp(name)
    res = run([sys.executable, *args, "--outdir", str(out)], timeout=timeout)
    assert res.returncode == 0, res.output
    return out


def jsonl(path, key: str | None = "loss") -> list:
    """One field (or whole records, key=None) of each line of a history file."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return rows if key is None else [r[key] for r in rows]


def max_rel_diff(a, b) -> float:
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


SIGNALS_RANK = str(ROOT / "tests" / "scripts" / "signals_rank.py")


def _signal_ranks_left(out) -> list[str]:
    """The ranks of this job (their command names its own ``out``) still running."""
    return subprocess.run(["pgrep", "-f", f"{SIGNALS_RANK} {out}"], capture_output=True, text=True).stdout.split()


def signal_promise(
    launch_cmd: list[str], env: dict[str, str], out, stop: signal.Signals, *, srun: bool = False
) -> None:
    """launch's signal promise (docs/launch.md) under ``launch_cmd`` (2 ranks of tests/scripts/signals_rank.py):
    SIGUSR1 and SIGUSR2 sent to launch reach every rank, the job going on; ``stop`` ends every rank, nothing
    is left running, ``--retries 1`` does not relaunch."""
    out.mkdir()
    env = {**env, "MMM_STACK_DIR": str(out), "MMM_TIMEOUT": "60"}
    cmd = [*launch_cmd, "-n", "2", "--retries", "1", "python3", SIGNALS_RANK, str(out)]
    with spawn(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as p:
        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(iter(p.stdout.readline, "")), daemon=True).start()
        deadline = time.monotonic() + 90
        while "".join(lines).count("READY") < 2 and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.1)
        assert "".join(lines).count("READY") == 2, (lines, p.poll())
        time.sleep(0.5)  # under Hydra, launch's rank watch finds the ranks' notes
        want = [out / f"rank-{r}.txt" for r in (0, 1)] + [out / f"usr2-rank{r}" for r in (0, 1)]
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            p.send_signal(sig)
            time.sleep(0.3)
        deadline = time.monotonic() + 20
        # a stack file counts once something is in it; a SIGUSR2 note is empty
        while time.monotonic() < deadline and not all(
            f.exists() and (f.name.startswith("usr2") or f.stat().st_size > 0) for f in want
        ):
            time.sleep(0.1)
        got = sorted(f.name for f in out.iterdir())
        assert all(f.exists() for f in want) and p.poll() is None, (got, p.poll())
        assert "signals_rank.py" in (out / "rank-0.txt").read_text()  # SIGUSR1: the stacks of a live rank
        p.send_signal(stop)
        try:
            _, stderr = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{stop.name} did not stop the job")
        time.sleep(1.0 if srun else 0.3)
        assert p.returncode != 0 and "relaunching" not in stderr, (p.returncode, stderr)
        assert not group_alive(p.pid) and not _signal_ranks_left(out), "ranks left running"


# --------------------------------------------------------------------------- a real Slurm cluster
@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A one-node Slurm cluster (munged, slurmctld, slurmd on this host, see tests/slurm_cluster.py)
    for the session; skips, saying why, where the machine cannot run one; stopped by PID at the end."""
    from slurm_cluster import ClusterFailed, ClusterUnavailable, SlurmCluster

    try:
        cluster = SlurmCluster.start(tmp_path_factory.mktemp("slurm"))
    except ClusterUnavailable as e:
        pytest.skip(str(e))
    except ClusterFailed as e:
        pytest.fail(f"the test Slurm cluster did not come up: {e}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()


# --------------------------------------------------------------------------- several hosts
@pytest.fixture(scope="session")
def two_hosts():
    """Two hosts node1, node2 on this machine (tests/hosts.py) for the session; skips, saying why, where
    the machine cannot make them (not root, no iproute2); removed at the end (and, after a crash, by
    the next session's start)."""
    from hosts import Hosts, HostsUnavailable

    try:
        hosts = Hosts.up(2)
    except HostsUnavailable as e:
        pytest.skip(f"no multi-host cluster on this machine: {e}")
    try:
        yield hosts
    finally:
        hosts.down()


@pytest.fixture
def shared_dir(two_hosts, request) -> Path:
    """A folder every host sees at the same path (each host's /tmp is its own)."""
    d = two_hosts.state / "shared" / request.node.name
    d.mkdir(parents=True)
    return d


def pbs_job(hosts, folder: Path, *, ranks_per_host: int = 2, **extra: str) -> dict[str, str]:
    """The environment of a PBS job on ``hosts``: a nodefile with a line per slot, and the remote-shell
    agent (ssh on a real cluster) for Open MPI's daemons and Hydra's proxies."""
    nodefile = folder / "nodefile"
    nodefile.write_text("".join(f"{h}\n" for h in hosts.names for _ in range(ranks_per_host)))
    agent = str(hosts.agent())
    return clean_env(
        PBS_NODEFILE=str(nodefile),
        PBS_JOBID="4242.pbs",
        PRTE_MCA_plm_ssh_agent=agent,
        HYDRA_LAUNCHER="ssh",
        HYDRA_LAUNCHER_EXEC=agent,
        I_MPI_HYDRA_BOOTSTRAP="ssh",  # Intel MPI's names for the same
        I_MPI_HYDRA_BOOTSTRAP_EXEC=agent,
        **extra,
    )


# --------------------------------------------------------------------------- other MPIs
def mpi_env(name: str) -> Path:
    """The environment of another MPI (``mpich`` or ``impi``: its mpiexec and an mpi4py that loads it;
    torch and mmm from the main venv), built once by scripts/mpi_env.sh; skips with the reason when it
    cannot be built."""
    dest = os.environ.get("MMM_TEST_ENVS", str(ROOT / ".venvs"))
    try:
        out = subprocess.run(
            ["bash", str(ROOT / "scripts" / "mpi_env.sh"), name, f"{dest}/{name}"],
            capture_output=True,
            text=True,
            timeout=600,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        pytest.skip(f"building the {name} environment took over 600 s")
    if out.returncode != 0:
        pytest.skip(f"no {name} environment: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else '?'}")
    return Path(out.stdout.strip().splitlines()[-1]).resolve()


def env_of(envdir: Path, **extra: str) -> dict[str, str]:
    """A clean environment with ``envdir``'s bin (its mpiexec) first on PATH."""
    return clean_env(PATH=f"{envdir / 'bin'}:{os.environ.get('PATH', '')}", **extra)


@pytest.fixture(scope="session")
def slurm_on_two_hosts(two_hosts, tmp_path_factory):
    """A 2-node Slurm cluster: slurmctld here, a slurmd in each host (node1, node2); client commands
    go through ``cluster.command`` (on node1, the submit host). Skips, saying why, like ``slurm_cluster``."""
    from slurm_cluster import ClusterFailed, ClusterUnavailable, SlurmCluster

    try:
        cluster = SlurmCluster.start(tmp_path_factory.mktemp("slurm2"), hosts=two_hosts)
    except ClusterUnavailable as e:
        pytest.skip(str(e))
    except ClusterFailed as e:
        pytest.fail(f"the 2-node test Slurm cluster did not come up: {e}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()


_FAULT_ROWS: list[tuple[str, str, str]] = []
_BAD_INPUT_ROWS: list[tuple] = []  # rows of the bad-input campaign (tests/test_bad_input.py)

# tests that share this machine's global resources (network namespaces and their /24, the Slurm
# daemons' ports, the MPI environments built under .venvs/) run one at a time, on one xdist worker
_ONE_AT_A_TIME = {"test_multihost.py", "test_slurm.py", "test_mpi_flavors.py"}
_HOST_FIXTURES = {"two_hosts", "shared_dir", "slurm_cluster", "slurm_on_two_hosts"}


# run after the others, with no other test beside them (make test's second pytest run): a real Slurm's
# steps meet at a port derived from the job id, and under a parallel run one collided (EADDRINUSE)
ALONE = {"test_slurm.py"}
# `make test-fast` (-m "not slow") runs the tests recorded at FAST_S seconds or less in a whole `make test`
# on 2 cores (tests/durations.json; `make durations` rewrites it from the last run), those not recorded
# yet, and those marked fast; the others are marked slow here
FAST_S = 6.0
DURATIONS_FILE = Path(__file__).parent / "durations.json"
RECORDED = ROOT / ".pytest_cache" / "mmm-durations.json"  # what the last runs measured (make durations)
_DURATIONS: dict[str, float] = {}
# the CPU each test's processes used (the worker's own and every child it reaped): on 2 busy cores the suite's
# time is its CPU, most of it ranks importing torch; listed at the end to show what a trim would save
CPU_RECORDED = ROOT / ".pytest_cache" / "mmm-cpu.json"
_CPU: dict[str, float] = {}
_CPU_KEY = pytest.StashKey[float]()


def _cpu_now() -> float:
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


# a module whose tests read a run its own module- or session-scoped fixture makes (a reference run, a
# trained model to export) sends those tests to one worker, so that the run is made once, not once per
# worker (hf_export's and schedule_eval's took 50 and 41 s on each of two); not the equivalence matrix,
# whose 44 layouts would load one worker with a third of the suite for 4 short reference runs
_SHARED_RUNS_SPREAD = {"test_equivalence.py"}


def _reads_a_shared_run(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    for defs in info.name2fixturedefs.values() if info else ():
        for fixture in defs:
            if fixture.scope in ("module", "session") and fixture.baseid.split("::")[0].endswith(item.path.name):
                return True
    return False


def _node(nodeid: str) -> str:
    return re.sub(r"@\w+$", "", nodeid)  # without the @group pytest-xdist writes at the end of a grouped test's id


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups to schedule by
def pytest_collection_modifyitems(config, items):
    recorded = json.loads(DURATIONS_FILE.read_text()) if DURATIONS_FILE.exists() else {}
    seconds = {item: recorded.get(_node(item.nodeid), 0.0) for item in items}
    # a run a module's tests share is timed in whichever of them comes first: each reader counts it
    shared: dict[str, float] = {}
    for item in items:
        if item.path.name not in _SHARED_RUNS_SPREAD and _reads_a_shared_run(item):
            shared[item.path.name] = max(shared.get(item.path.name, 0.0), seconds[item])
    for item in items:
        if item.path.name not in _SHARED_RUNS_SPREAD and _reads_a_shared_run(item):
            seconds[item] = shared[item.path.name]
        if "fast" not in item.keywords and seconds[item] > FAST_S:
            item.add_marker(pytest.mark.slow)
        if item.path.name in ALONE:
            item.add_marker(pytest.mark.alone)
        hosts = "hosts2" in item.name or _HOST_FIXTURES & set(getattr(item, "fixturenames", ()))
        if item.path.name in _ONE_AT_A_TIME or hosts:
            item.add_marker(pytest.mark.xdist_group("machine"))
        elif item.path.name not in _SHARED_RUNS_SPREAD and _reads_a_shared_run(item):
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
    if getattr(config.option, "loadgroup", False):  # a pytest-xdist worker under --dist loadgroup
        items[:] = longest_first(items, recorded)


def longest_first(items: list, recorded: dict[str, float]) -> list:
    """``items`` with the longest work first (a group's tests, which run on one worker one after another,
    as one unit: their recorded times summed; the tests of a unit keep their order), so that the workers
    end together rather than one finishing a long test started late while the others sit idle (pytest-xdist
    takes units in this order: pytest_configure turns its own reordering, by test count, off)."""

    def unit(item) -> str:
        group = item.get_closest_marker("xdist_group")
        return group.args[0] if group is not None and group.args else item.nodeid

    cost: dict[str, float] = {}
    for item in items:
        cost[unit(item)] = cost.get(unit(item), 0.0) + recorded.get(_node(item.nodeid), 0.0)
    return sorted(items, key=lambda item: -cost[unit(item)])  # stable: a unit's tests in their order


def pytest_configure(config):
    """pytest 9 keeps a node's id where pytest-xdist 3.8 writes a test's group: under ``--dist loadgroup`` the
    groups above would silently not hold (measured: shared runs made twice, machine-wide tests side by side)."""
    if config.getoption("dist", "no") != "loadgroup":
        return
    config.option.loadscopereorder = False  # the units in longest_first's order, not by how many tests each holds
    import xdist

    xdist_version = tuple(int(x) for x in xdist.__version__.split(".")[:2])
    if int(pytest.__version__.split(".")[0]) >= 9 and xdist_version <= (3, 8):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} with pytest-xdist {xdist.__version__} does not keep --dist loadgroup's "
            "groups: install pyproject.toml's dev extra (pip install -e '.[dev]': pytest < 9)"
        )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_CPU_KEY] = _cpu_now()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_makereport(item, call):
    if call.when == "teardown" and _CPU_KEY in item.stash:  # carried to the controller by the teardown report
        item.user_properties.append(("cpu_s", _cpu_now() - item.stash[_CPU_KEY]))


def pytest_runtest_logreport(report):
    """Rows of the fault campaign's table, as each report arrives (from this process or an xdist worker);
    each test's time (setup, call and teardown) for :data:`RECORDED`, its CPU for :data:`CPU_RECORDED`."""
    node = _node(report.nodeid)
    _DURATIONS[node] = _DURATIONS.get(node, 0.0) + report.duration
    if report.when == "teardown":
        _CPU.update({node: value for name, value in report.user_properties if name == "cpu_s"})
    if report.when == "call":
        _FAULT_ROWS.extend(tuple(value) for name, value in report.user_properties if name == "fault_outcome")
        _BAD_INPUT_ROWS.extend(tuple(value) for name, value in report.user_properties if name == "bad_input")


def pytest_sessionfinish(session):
    """Add this run's test times to :data:`RECORDED` (the controller's, not an xdist worker's)."""
    if not _DURATIONS or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with contextlib.suppress(OSError, ValueError):
        old = json.loads(RECORDED.read_text()) if RECORDED.exists() else {}
        RECORDED.parent.mkdir(parents=True, exist_ok=True)
        merged = {**old, **{k: round(v, 1) for k, v in _DURATIONS.items()}}
        RECORDED.write_text(json.dumps(dict(sorted(merged.items())), indent=0) + "\n")
        if _CPU:  # merged as the times are (make test's second run adds the Slurm tests')
            old = json.loads(CPU_RECORDED.read_text()) if CPU_RECORDED.exists() else {}
            merged = {**old, **{k: round(v, 1) for k, v in _CPU.items()}}
            CPU_RECORDED.write_text(json.dumps(dict(sorted(merged.items())), indent=0) + "\n")


def pytest_terminal_summary(terminalreporter):
    """The fault campaign's table (tests/test_faults.py) and the bad-input campaign's (tests/test_bad_input.py),
    after the run."""
    rows = _FAULT_ROWS
    if rows:
        width = max(len(f) for f, _, _ in rows)
        terminalreporter.write_sep("-", "fault campaign: fault / outcome / lost")
        for fault, outcome, lost in rows:
            terminalreporter.write_line(f"{fault:<{width}}  {outcome} / lost: {lost}")
    if _BAD_INPUT_ROWS:
        rows = sorted(_BAD_INPUT_ROWS, key=lambda r: r[0])
        width = min(60, max(len(r[0]) for r in rows))
        terminalreporter.write_sep("-", "bad-input campaign: input / exit / seconds / the one line")
        for what, line, code, seconds in rows:
            terminalreporter.write_line(f"{what:<{width}}  exit {code}  {seconds:5.2f}s  {line}")
    if len(_CPU) > 20:
        top = sorted(_CPU.items(), key=lambda kv: -kv[1])[:20]
        terminalreporter.write_sep("-", f"CPU: {sum(_CPU.values()):,.0f} s over {len(_CPU)} tests; the most (s)")
        for node, seconds in top:
            terminalreporter.write_line(f"{seconds:7.1f}  {node}")


@pytest.fixture(scope="session", autouse=True)
def _deepspeed_cpu_adam_built_in_the_background(request):
    """``--offload-optimizer`` runs DeepSpeed's CPU Adam, JIT-compiled on first use (60-120 s on 2 cores,
    then cached under ~/.cache/torch_extensions): when a test that offloads is collected, start that
    build at session start, at the lowest CPU priority, so it overlaps the tests that leave a core idle
    instead of holding up the test. The test still loads and runs the op itself (a build that failed
    here is retried there, in the foreground)."""
    wanted = any("offload" in item.name for item in request.session.items)
    wanted &= os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0"  # one build, not one per worker
    proc, started = None, time.time() - 1
    if wanted and importlib.util.find_spec("deepspeed") is not None:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=clean_env(),
            start_new_session=True,
            preexec_fn=lambda: os.nice(19),
        )
    yield
    if proc is not None and proc.poll() is None:
        kill_group(proc)
        # the build it stopped holds torch's build lock, which every later build would wait on for ever
        from mmm.parallel.zero import stale_build_lock

        lock = stale_build_lock("cpu_adam")
        lock = lock if lock is not None else _build_lock("cpu_adam")
        if lock.exists() and lock.stat().st_mtime >= started:
            lock.unlink()


def _build_lock(op: str) -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(op, verbose=False)) / "lock"
