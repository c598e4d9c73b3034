"""``launch``: turn a scheduler allocation (or a laptop) into the right launcher command.

    launch -n 4 python3 -m mmm --tp 2          # local: 4 ranks on this machine
    launch python3 -m mmm.examples.fsdp_tp     # inside a PBS or Slurm job: every allocated rank
    launch --dry-run python3 train.py          # print the command, run nothing

Detection, in order: PBS (``PBS_NODEFILE``), Slurm (``SLURM_JOB_ID``), else no scheduler.
``--hostfile`` replaces the scheduler's host list. Ranks per host default to the
accelerators found on this host (NVIDIA via ``CUDA_VISIBLE_DEVICES`` or ``/dev/nvidia*``;
``MMM_GPUS_PER_NODE`` overrides), else the scheduler's slots per host, else (no
scheduler, CPU only) up to 4.

Launchers: ``mpiexec`` under PBS (Open MPI, MPICH/Intel MPI Hydra and Cray PALS flags),
``srun`` under Slurm, and with no scheduler the ``mpiexec`` of this virtual environment
if it has one, else a built-in torchrun-style spawner (no torch import, so it starts
fast). ``launch`` sets ``MASTER_ADDR``/``MASTER_PORT`` (unless already set),
``OMP_NUM_THREADS`` (unless set: cores per host / ranks per host) and ``MMM_LAUNCH_TIME``
(for startup timing; unless set, so that a benchmark can start the clock before ``launch``), and
returns the command's exit code.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mmm.dist.ranks import expand_nodelist, parse_tasks_per_node
from mmm.dist.rendezvous import free_port
from mmm.errors import ArgumentParser, UsageError, print_error

PROG = "launch"
MPI_FLAVORS = ("openmpi", "hydra", "pals")
LAUNCHERS = ("auto", "mpiexec", "srun", "local")
LOCAL_CPU_RANKS = 4
ESCALATE_AFTER_S = 10.0  # a forwarded SIGINT that stopped nothing is followed by SIGTERM after this
FORWARDED_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "MMM_LAUNCH_TIME",
    "OMP_NUM_THREADS",
    "MMM_LAUNCHER",
    "MMM_RUN_STAMP",
    "MMM_RESTART",
)


# --------------------------------------------------------------------------- host lists


def read_hostfile(path: str | os.PathLike) -> tuple[list[str], list[int]]:
    """Hosts in first-seen order and slots per host, from a PBS nodefile or an MPI hostfile.

    Accepts one host per line (repeats count as slots, as in ``PBS_NODEFILE``),
    ``host slots=N`` (Open MPI) and ``host:N`` (Hydra). ``#`` starts a comment.
    """
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"hostfile {str(path)!r} does not exist or is not a file")
    slots: dict[str, int] = {}
    for raw in p.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields_ = line.split()
        host, n = fields_[0], 1
        if ":" in host:
            host, _, count = host.partition(":")
            n = int(count) if count.isdigit() else 1
        for f in fields_[1:]:
            if f.startswith(("slots=", "max_slots=")) and f.split("=", 1)[1].isdigit():
                n = int(f.split("=", 1)[1]) if f.startswith("slots=") else n
        slots[host] = slots.get(host, 0) + n
    if not slots:
        raise UsageError(f"hostfile {str(path)!r} lists no hosts")
    return list(slots), list(slots.values())


# --------------------------------------------------------------------------- allocation
@dataclass
class Allocation:
    scheduler: str  # "pbs", "slurm" or "none"
    hosts: list[str]
    slots_per_host: int | None  # what the scheduler says (PBS mpiprocs, Slurm tasks per node)
    accelerators_per_host: int
    hostfile: str | None = None
    job_id: str | None = None

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)


def count_accelerators(env: Mapping[str, str] | None = None) -> int:
    """Accelerators on this host without importing torch (fast)."""
    env = os.environ if env is None else env
    if env.get("MMM_GPUS_PER_NODE"):
        try:
            return int(env["MMM_GPUS_PER_NODE"])
        except ValueError:
            raise UsageError(f"MMM_GPUS_PER_NODE={env['MMM_GPUS_PER_NODE']!r} is not an integer") from None
    for var in ("CUDA_VISIBLE_DEVICES", "ZE_AFFINITY_MASK"):
        if var in env:
            return len([d for d in env[var].split(",") if d.strip() and d.strip() != "-1"])
    return len([p for p in Path("/dev").glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)])


def detect_allocation(env: Mapping[str, str] | None = None, hostfile: str | None = None) -> Allocation:
    env = os.environ if env is None else env
    accel = count_accelerators(env)
    if env.get("PBS_NODEFILE"):
        path = hostfile or env["PBS_NODEFILE"]
        hosts, slots = read_hostfile(path)
        return Allocation("pbs", hosts, max(slots), accel, path, env.get("PBS_JOBID"))
    if env.get("SLURM_JOB_ID"):
        if hostfile:
            hosts, slots = read_hostfile(hostfile)
            per = max(slots)
        else:
            nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or socket.gethostname()
            hosts = expand_nodelist(nodelist)
            per = None
            tpn = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
            if tpn:
                try:
                    per = max(parse_tasks_per_node(tpn))
                except ValueError:
                    per = None
        return Allocation("slurm", hosts, per, accel, hostfile, env.get("SLURM_JOB_ID"))
    if hostfile:
        hosts, slots = read_hostfile(hostfile)
        return Allocation("none", hosts, max(slots), accel, hostfile)
    return Allocation("none", [socket.gethostname()], None, accel)


# --------------------------------------------------------------------------- MPI
def venv_mpiexec() -> str | None:
    cand = Path(sys.executable).parent / "mpiexec"
    return str(cand) if cand.is_file() and os.access(cand, os.X_OK) else None


def find_mpiexec() -> str | None:
    return venv_mpiexec() or shutil.which("mpiexec")


def mpi_flavor(mpiexec: str) -> str:
    """openmpi, hydra (MPICH, Intel MPI) or pals (Cray/HPE), from ``mpiexec --version``."""
    forced = os.environ.get("MMM_MPI_FLAVOR")
    if forced:
        if forced not in MPI_FLAVORS:
            raise UsageError(f"MMM_MPI_FLAVOR={forced!r}; choose one of: {', '.join(MPI_FLAVORS)}")
        return forced
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20)
        text = (out.stdout + out.stderr).lower()
    except (OSError, subprocess.TimeoutExpired):
        text = ""
    if "open mpi" in text or "openrte" in text or "prte" in text:
        return "openmpi"
    if "hydra" in text or "intel(r) mpi" in text or "mpich" in text:
        return "hydra"
    if "pals" in text or "cray" in text or "hpe" in text:
        return "pals"
    return "hydra"


# --------------------------------------------------------------------------- plan
@dataclass
class LaunchPlan:
    launcher: str  # "mpiexec", "srun" or "local"
    argv: list[str]  # the full command for mpiexec/srun; the per-rank command for local
    nproc: int
    ppn: int
    allocation: Allocation
    env: dict[str, str] = field(default_factory=dict)  # added to the environment
    mpi_flavor: str | None = None

    def describe(self) -> str:
        a = self.allocation
        where = (
            f"{a.num_hosts} host{'s' if a.num_hosts != 1 else ''}"
            if a.scheduler != "none" or a.hostfile
            else "this machine"
        )
        return (
            f"{self.nproc} ranks ({self.ppn} per host) on {where} via {self.launcher}"
            f"{f' ({self.mpi_flavor})' if self.mpi_flavor else ''}; scheduler: {a.scheduler}"
        )

    def command_line(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        cmd = shlex.join(self.argv)
        if self.launcher == "local":
            cmd = f"<{self.nproc} ranks, RANK=0..{self.nproc - 1}> {cmd}"
        return f"{env} {cmd}" if env else cmd


def _resolve_python(cmd: list[str]) -> list[str]:
    """A bare ``python``/``python3`` means this environment's interpreter, on every rank."""
    if cmd and cmd[0] in {"python", "python3"}:
        return [sys.executable, *cmd[1:]]
    return cmd


def plan_launch(
    command: Sequence[str],
    *,
    nproc: int | None = None,
    ppn: int | None = None,
    hostfile: str | None = None,
    launcher: str = "auto",
    mpi_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    flavor: str | None = None,
    dry_run: bool = False,
) -> LaunchPlan:
    """How to start ``command`` on this allocation. ``dry_run``: only to print it, so a launcher
    missing from PATH (a login node, a module not loaded) is named as is, not refused."""
    env = os.environ if env is None else env
    if not command:
        raise UsageError("no command to launch; e.g. `launch -n 4 python3 -m mmm --tp 2`")
    if launcher not in LAUNCHERS:
        raise UsageError(f"--launcher {launcher!r}; choose one of: {', '.join(LAUNCHERS)}")
    for name, value in (("-n/--nproc", nproc), ("--ppn", ppn)):
        if value is not None and value < 1:
            raise UsageError(f"{name} {value} must be >= 1")
    alloc = detect_allocation(env, hostfile)
    if launcher == "auto":
        launcher = {"pbs": "mpiexec", "slurm": "srun"}.get(alloc.scheduler) or (
            "mpiexec" if (venv_mpiexec() or alloc.hostfile) else "local"
        )
    if launcher == "local" and alloc.num_hosts > 1:
        raise UsageError(
            f"--launcher local runs on this machine only, but the allocation has {alloc.num_hosts} hosts; "
            "use --launcher mpiexec or srun"
        )
    cpus = os.cpu_count() or 1
    on_this_machine = alloc.scheduler == "none" and not alloc.hostfile
    if ppn is None:
        if on_this_machine and nproc is not None:
            ppn = nproc
        elif alloc.accelerators_per_host:
            ppn = alloc.accelerators_per_host
        elif alloc.slots_per_host and alloc.slots_per_host > 1:
            ppn = alloc.slots_per_host
        elif nproc is not None:
            ppn = -(-nproc // alloc.num_hosts)
        else:
            ppn = max(2, min(LOCAL_CPU_RANKS, cpus)) if on_this_machine else 1
    total = nproc if nproc is not None else ppn * alloc.num_hosts
    if not on_this_machine and total > ppn * alloc.num_hosts:
        raise UsageError(
            f"-n {total} needs more ranks than {alloc.num_hosts} host(s) x --ppn {ppn} = {ppn * alloc.num_hosts}; "
            f"lower -n or raise --ppn"
        )
    nodes = -(-total // ppn)
    hosts = alloc.hosts[:nodes]
    add_env: dict[str, str] = {}
    if not (env.get("MASTER_ADDR") and env.get("MASTER_PORT")):
        add_env["MASTER_ADDR"] = "127.0.0.1" if on_this_machine or nodes == 1 and _is_this_host(hosts[0]) else hosts[0]
        add_env["MASTER_PORT"] = str(free_port())
    per_task = env.get("SLURM_CPUS_PER_TASK", "") if launcher == "srun" else ""
    if not env.get("OMP_NUM_THREADS"):
        add_env["OMP_NUM_THREADS"] = (
            per_task
            if per_task.isdigit()
            else str(max(1, cpus // ppn if not on_this_machine else cpus // max(total, 1)))
        )
    if not env.get("MMM_LAUNCH_TIME"):  # an outer harness may have started the clock already
        add_env["MMM_LAUNCH_TIME"] = repr(time.time())
    add_env["MMM_LAUNCHER"] = f"launch/{launcher}"
    if not env.get("MMM_RUN_STAMP"):  # one default output folder for every rank and every attempt
        add_env["MMM_RUN_STAMP"] = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    cmd = _resolve_python(list(command))

    if launcher == "local":
        return LaunchPlan("local", cmd, total, ppn, alloc, add_env)
    if launcher == "srun":
        exe = shutil.which("srun") or ("srun" if dry_run else None)
        if exe is None:
            where = f"inside Slurm job {env['SLURM_JOB_ID']}, " if env.get("SLURM_JOB_ID") else ""
            raise UsageError(
                f"--launcher srun: no srun on PATH ({where}PATH={env.get('PATH', '')!r}); load Slurm "
                "(e.g. `module load slurm`) or choose --launcher mpiexec"
            )
        # a rank that dies takes the step down at once, instead of leaving the others blocked in a
        # collective until its timeout
        # since Slurm 22.05 srun does not inherit the job's --cpus-per-task: pass it on
        cpt = [f"--cpus-per-task={per_task}"] if per_task.isdigit() else []
        argv = [
            exe,
            f"--nodes={nodes}",
            f"--ntasks={total}",
            f"--ntasks-per-node={ppn}",
            *cpt,
            "--export=ALL",
            "--kill-on-bad-exit=1",
            *mpi_args,
            *cmd,
        ]
        return LaunchPlan("srun", argv, total, ppn, alloc, add_env)
    exe = find_mpiexec()
    if exe is None:
        raise UsageError(
            f"--launcher mpiexec: no mpiexec in {Path(sys.executable).parent} or on PATH; install MPI "
            "(pip install 'mmm[mpi]' puts Open MPI's mpiexec in the virtual environment) or use --launcher local"
        )
    flavor = flavor or mpi_flavor(exe)
    argv = [
        exe,
        *_mpiexec_flags(flavor, total, ppn, alloc, nodes, on_this_machine, add_env, cpus, env),
        *mpi_args,
        *cmd,
    ]
    return LaunchPlan("mpiexec", argv, total, ppn, alloc, add_env, flavor)


def _mpiexec_flags(
    flavor: str,
    total: int,
    ppn: int,
    alloc: Allocation,
    nodes: int,
    local: bool,
    add_env: Mapping[str, str],
    cpus: int,
    env: Mapping[str, str],
) -> list[str]:
    names = [*add_env, *(k for k in FORWARDED_ENV if k not in add_env and k in env)]
    if flavor == "openmpi":
        flags = ["-n", str(total)]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            flags.append("--allow-run-as-root")
        if local:
            if total > cpus:
                flags.append("--oversubscribe")
        else:
            flags += ["--map-by", f"ppr:{ppn}:node"]
            if alloc.hostfile:
                flags += ["--hostfile", alloc.hostfile]
            else:
                flags += ["--host", ",".join(f"{h}:{ppn}" for h in alloc.hosts[:nodes])]
        for k in names:
            flags += ["-x", k]
        return flags
    if flavor == "pals":
        flags = ["-n", str(total), "--ppn", str(ppn)]
        if alloc.hostfile:
            flags += ["--hostfile", alloc.hostfile]
        for k in names:
            flags += ["--env", f"{k}={add_env.get(k, env.get(k, ''))}"]
        return flags
    flags = ["-n", str(total), "-ppn", str(ppn)]  # hydra
    if alloc.hostfile:
        flags += ["-hostfile", alloc.hostfile]
    elif not local:
        flags += ["-hosts", ",".join(alloc.hosts[:nodes])]
    for k in names:
        flags += ["-genv", k, add_env.get(k, env.get(k, ""))]
    return flags


def _is_this_host(host: str) -> bool:
    return host in {"localhost", "127.0.0.1", socket.gethostname(), socket.gethostname().split(".")[0]}


# --------------------------------------------------------------------------- run
def spawn_local(
    cmd: Sequence[str],
    nproc: int,
    env: Mapping[str, str],
    *,
    settle_s: float = 5.0,
    grace_s: float = ESCALATE_AFTER_S,
    signalled: list[int] | None = None,
) -> int:
    """Run ``nproc`` copies of ``cmd`` with torchrun-style variables; stop all when one fails.

    When a rank fails the others get ``settle_s`` seconds to exit on their own (bad input
    fails every rank alike, and each says so), then SIGTERM, then SIGKILL after ``grace_s``
    more. Returns 0 if every rank exited 0, else the first failing rank's code (128+N for a
    signal). SIGINT/SIGTERM are forwarded to the ranks at once; a SIGINT that has not stopped every
    rank after ``grace_s`` is followed by SIGTERM (a rank may ignore SIGINT).
    """
    procs: list[subprocess.Popen] = []
    base = dict(env)
    signalled = [] if signalled is None else signalled  # the signals forwarded (the caller may watch)

    def forward(signum, frame):
        signalled.append(signum)
        for p in procs:
            if p.poll() is None:
                try:
                    p.send_signal(signum)
                except ProcessLookupError:
                    pass

    # before the ranks start: exec gives a caught signal its default handling in the child, while an
    # inherited "ignore" (a background job's SIGINT) would stay and make the forwarded signal a no-op
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    for rank in range(nproc):
        rank_env = {
            **base,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0",
            "NODE_RANK": "0",
        }
        try:
            procs.append(subprocess.Popen(list(cmd), env=rank_env))
        except OSError as e:
            for p in procs:
                p.kill()
            for s, h in old.items():
                signal.signal(s, h)
            raise UsageError(f"cannot start {cmd[0]!r}: {e.strerror}") from None

    code = 0
    failed_rank: int | None = None
    term_at: float | None = None
    kill_at: float | None = None
    escalate = _Escalation(grace_s)
    try:
        while True:
            running = [p for p in procs if p.poll() is None]
            if running and escalate.due(signalled):
                for q in running:
                    q.send_signal(signal.SIGTERM)
            for rank, p in enumerate(procs):
                rc = p.returncode
                if rc not in (None, 0) and code == 0:
                    code, failed_rank = (128 - rc if rc < 0 else rc), rank
                    term_at = time.monotonic() + (0.0 if signalled else settle_s)
            if not running:
                return code
            now = time.monotonic()
            if term_at is not None and now >= term_at:
                if not signalled:  # after a forwarded signal, exits are expected, not news
                    print_error(
                        f"rank {failed_rank} exited with code {code}; stopping the other {len(running)} rank(s)",
                        prog=PROG,
                    )
                for q in running:
                    q.send_signal(signal.SIGTERM)
                term_at, kill_at = None, now + grace_s
            if kill_at is not None and now >= kill_at:
                for q in running:
                    q.kill()
                kill_at = None
            time.sleep(0.05)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


NOT_RETRIED = {
    0: "it succeeded",
    2: "bad input fails again",
    130: "interrupted (Ctrl-C)",
    143: "terminated (SIGTERM: preemption or the scheduler's limit)",
}


class RankWatch(threading.Thread):
    """Which of this host's ranks ended first. mmm's ranks note their process in ``folder``
    (``MMM_PID_DIR``) at setup and their exit when they leave by their own hand; this thread waits on
    every such process (pidfds) and records the order in which they end. MPICH's Hydra kills every rank
    the moment one dies and names only some process; this names the rank that died. It stays silent
    rather than guess: ranks on other hosts, a kernel without pidfds, a note it could not read."""

    def __init__(self, folder: str, nproc: int) -> None:
        super().__init__(name="mmm-rank-watch", daemon=True)
        self.folder, self.nproc = Path(folder), nproc
        self.host = socket.gethostname()
        self.rank_of: dict[int, str] = {}  # pid -> rank
        self.ended: list[list[int]] = []  # pids, one list per wake-up, in order
        self.blind = False  # the order cannot be known (then first_silent says nothing)
        self.done = threading.Event()

    def run(self) -> None:
        import select

        poller, fds = select.poll(), {}

        def collect(timeout_ms: int) -> None:
            events = poller.poll(timeout_ms)
            if events:
                self.ended.append([fds[fd] for fd, _ in events])
                for fd, _ in events:
                    poller.unregister(fd)
                    del fds[fd]
                    os.close(fd)

        try:
            while not self.done.is_set():
                if len(self.rank_of) < self.nproc:  # ranks still starting: look for their notes
                    collect(0)  # what ended before this look comes first
                    self._look(poller, fds)
                collect(50 if len(self.rank_of) < self.nproc else 250)
            collect(0)
        except Exception:  # never a traceback from a helper thread; never a guess either
            self.blind = True
        finally:
            for fd in fds:
                os.close(fd)

    def _look(self, poller, fds: dict[int, int]) -> None:
        import errno
        import select

        for f in self.folder.iterdir():
            host, _, pid_s = f.name.rpartition(".")
            if host != self.host or not pid_s.isdigit() or int(pid_s) in self.rank_of:
                continue  # an exit note, a note being written, a rank of another host
            pid = int(pid_s)
            self.rank_of[pid] = f.read_text().strip()
            try:
                fd = os.pidfd_open(pid)
            except OSError as e:
                if e.errno != errno.ESRCH:  # no pidfds here (old kernel, seccomp): the order is unknown
                    self.blind = True
                self.ended.append([pid])  # gone already
                continue
            fds[fd] = pid
            poller.register(fd, select.POLLIN)

    def first_silent(self) -> str | None:
        """After a failed job: the rank(s) that ended first without leaving by their own hand (killed
        by a signal, a crash, ``os._exit``), as a message; None when a rank that failed first said so
        itself, or when the order cannot be known here (ranks on other hosts, no pidfds)."""
        if self.blind or len(self.rank_of) < self.nproc:
            return None
        for batch in self.ended:
            how = {pid: self._exit_of(pid) for pid in batch}
            failed = [pid for pid in batch if how[pid] != "0"]
            if not failed:
                continue
            if any(how[pid] is not None for pid in failed):
                return None  # it left with an error of its own, and said so
            ranks = [(self.rank_of.get(pid, "?"), pid) for pid in failed]
            if any(not r.isdigit() for r, _ in ranks):
                return None
            ranks.sort(key=lambda rp: int(rp[0]))
            names = ", ".join(f"{r} (pid {p})" for r, p in ranks)
            return (
                f"rank{'s' if len(ranks) > 1 else ''} {names} died first, without a word: killed by a "
                "signal (e.g. the out-of-memory killer), a crash or os._exit"
            )
        return None

    def _exit_of(self, pid: int) -> str | None:
        try:
            return (self.folder / f"{self.host}.{pid}.exit").read_text().strip()
        except OSError:
            return None


def run_attempt(plan: LaunchPlan, env: Mapping[str, str], signalled: list[int]) -> int:
    """Run the plan once as a child (mpiexec/srun) or with the local spawner; its exit code.
    SIGINT/SIGTERM are forwarded to the child and recorded in ``signalled``. Under a Hydra ``mpiexec``
    launch watches this host's ranks (:class:`RankWatch`) and names the one that died first."""
    if plan.launcher == "local":
        code = spawn_local(plan.argv, plan.nproc, env, signalled=signalled)
        return code
    watcher = None
    if plan.launcher == "mpiexec" and plan.mpi_flavor == "hydra" and hasattr(os, "pidfd_open"):
        watcher = RankWatch(tempfile.mkdtemp(prefix="mmm-pids-"), plan.nproc)
        env = {**env, "MMM_PID_DIR": str(watcher.folder)}
    child: list[subprocess.Popen] = []
    try:
        rc = _wait_forwarding(lambda: _start_child(plan.argv, env, watcher, child), signalled)
    finally:
        if watcher is not None:
            watcher.done.set()
            watcher.join(timeout=2.0)
            if not watcher.is_alive():
                named = watcher.first_silent() if child and child[0].returncode and not signalled else None
                shutil.rmtree(watcher.folder, ignore_errors=True)
                if named:
                    print_error(named, prog=PROG)
    return rc


def _ctrl_c_reached_the_child() -> bool:
    """A Ctrl-C typed in launch's terminal went to the whole foreground process group, the child included."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return False  # no controlling terminal: someone sent it to launch alone
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


_STOPPING = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")  # recorded: a job stopped on purpose is not retried
_PASSED_ON = ("SIGUSR1", "SIGUSR2")  # e.g. SIGUSR1: every mmm rank writes its stacks


def _start_child(
    argv: Sequence[str], env: Mapping[str, str], watcher: RankWatch | None, started: list[subprocess.Popen]
) -> subprocess.Popen:
    try:
        p = subprocess.Popen(list(argv), env=dict(env))
    except OSError as e:
        if watcher is not None:
            shutil.rmtree(watcher.folder, ignore_errors=True)
        raise UsageError(f"cannot run {argv[0]!r}: {e.strerror}") from None
    started.append(p)
    if watcher is not None:
        watcher.start()
    return p


class _Escalation:
    """A forwarded SIGINT that has not stopped the job after ``grace_s`` is followed by one SIGTERM:
    a program may ignore SIGINT (or have inherited "ignore" from a shell's background job), and launch
    must not wait forever. SIGTERM itself is never escalated to SIGKILL here: mmm's trainers answer it by
    saving a checkpoint, which takes the time it takes (the scheduler bounds it, e.g. Slurm's KillWait)."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s, self.since, self.done = grace_s, None, False

    def due(self, signalled: Sequence[int]) -> bool:
        if self.done or signal.SIGINT not in signalled or signal.SIGTERM in signalled:
            return False
        now = time.monotonic()
        if self.since is None:
            self.since = now
        if now - self.since < self.grace_s:
            return False
        self.done = True
        print_error(f"SIGINT did not stop the job within {self.grace_s:.0f} s; sending SIGTERM", prog=PROG)
        return True


def _wait_forwarding(
    start: Callable[[], subprocess.Popen], signalled: list[int], *, grace_s: float = ESCALATE_AFTER_S
) -> int:
    """Start the child and wait for it, passing on the signals launch gets (as when the child had taken
    launch's place). The handlers go in before the child starts, so it begins with the default handling
    of each (never an "ignore" launch inherited); a signal launch inherited as ignored (nohup's SIGHUP)
    is left alone."""
    holder: list[subprocess.Popen] = []

    def forward(signum, frame):
        if signal.Signals(signum).name in _STOPPING:
            signalled.append(signum)
        if signum == signal.SIGINT and _ctrl_c_reached_the_child():
            return  # a second SIGINT would make mpiexec abort instead of stopping the ranks
        if holder and holder[0].poll() is None:
            holder[0].send_signal(signum)

    sigs = [getattr(signal, name) for name in (*_STOPPING, *_PASSED_ON) if hasattr(signal, name)]
    mine = (signal.SIGINT, signal.SIGTERM)  # always launch's to forward, even if inherited as ignored
    old = {sig: signal.signal(sig, forward) for sig in sigs if sig in mine or signal.getsignal(sig) != signal.SIG_IGN}
    escalate = _Escalation(grace_s)
    try:
        holder.append(start())
        p = holder[0]
        while True:
            try:
                rc = p.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if escalate.due(signalled):
                    p.send_signal(signal.SIGTERM)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return 128 - rc if rc < 0 else rc


def _unignore_stop_signals() -> None:
    """A shell starts a background job (``launch ... &`` in a batch script, ``nohup make test &``) with
    SIGINT ignored, and an ignored signal stays ignored across exec: ranks started from such a launch
    would ignore the SIGINT launch forwards. SIGINT and SIGTERM are launch's to handle and forward, so
    they start from their defaults here, whatever launch inherited."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def run_with_retries(
    replan: Callable[[Mapping[str, str]], LaunchPlan], first: LaunchPlan, retries: int, *, quiet: bool = False
) -> int:
    """Run the job; when it fails, run it again (at most ``retries`` more times) in the same allocation.
    Every attempt gets ``MMM_RESTART=<attempt>`` and the first attempt's output stamp; when launch chose
    the rendezvous port, each relaunch gets a fresh one. ``replan`` rebuilds the command for an
    environment (MPI launchers carry variables on their command line). A trainer with
    ``--checkpoint-dir`` resumes from its latest checkpoint on a restart. Not retried: success, bad
    input (2), Ctrl-C (130), SIGTERM (143), and a signal sent to launch itself."""
    fresh_port = "MASTER_PORT" in first.env
    base = {**os.environ, **first.env}
    attempt = 0
    while True:
        env = {**base, "MMM_RESTART": str(attempt)}
        if attempt:
            env["MMM_LAUNCH_TIME"] = repr(time.time())  # startup of this attempt
            if fresh_port:
                env["MASTER_PORT"] = str(free_port())
        plan = replan(env)
        signalled: list[int] = []
        code = run_attempt(plan, {**env, **plan.env}, signalled)
        why = "launch itself was signalled" if signalled else NOT_RETRIED.get(code)
        if why is not None or attempt >= retries:
            if code and attempt and not quiet:
                print_error(
                    f"attempt {attempt + 1} of {retries + 1} failed with exit code {code}; "
                    f"{'giving up' if why is None else f'not retried: {why}'}",
                    prog=PROG,
                )
            return code
        attempt += 1
        if not quiet:
            print_error(
                f"attempt {attempt} of {retries + 1} failed with exit code {code}; relaunching "
                f"(MMM_RESTART={attempt}{', fresh rendezvous port' if fresh_port else ''})",
                prog=PROG,
            )


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog=PROG,
        description="Run a command on every rank of this allocation (PBS, Slurm) or on this machine.",
        epilog="examples:\n"
        "  launch -n 4 python3 -m mmm --tp 2\n"
        "  launch python3 -m mmm.examples.fsdp_tp --tpsize 2   # inside a PBS/Slurm job\n"
        "  launch --dry-run --ppn 4 python3 train.py\n\n"
        "Environment: MMM_GPUS_PER_NODE (ranks per host default), MMM_MPI_FLAVOR (openmpi|hydra|pals).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "-n",
        "--nproc",
        "--np",
        dest="nproc",
        type=int,
        default=None,
        metavar="N",
        help="total ranks (default: hosts x ranks per host)",
    )
    p.add_argument(
        "--ppn",
        type=int,
        default=None,
        metavar="N",
        help="ranks per host (default: accelerators per host, else scheduler slots, else up to 4 CPU ranks)",
    )
    p.add_argument(
        "--hostfile",
        default=None,
        metavar="FILE",
        help="hosts to use instead of the scheduler's (one per line; 'host slots=N' or 'host:N')",
    )
    p.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="auto",
        help="auto: mpiexec under PBS, srun under Slurm, else this venv's mpiexec if any, else local",
    )
    p.add_argument(
        "--mpi-args",
        default="",
        metavar="ARGS",
        help='extra launcher flags, one quoted string (e.g. "--cpu-bind depth -d 8")',
    )
    p.add_argument(
        "--retries",
        type=int,
        default=0,
        metavar="N",
        help="relaunch a failed job up to N times in the same allocation (fresh rendezvous port, "
        "MMM_RESTART=<attempt>); trainers with --checkpoint-dir resume from their latest "
        "checkpoint. Bad input (exit 2), Ctrl-C and SIGTERM are not retried [0]",
    )
    p.add_argument("--dry-run", action="store_true", help="print the command and exit")
    p.add_argument("-q", "--quiet", action="store_true", help="do not print the launch line")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    _unignore_stop_signals()
    try:
        args = build_parser().parse_args(argv)
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        plan = plan_launch(
            command,
            nproc=args.nproc,
            ppn=args.ppn,
            hostfile=args.hostfile,
            launcher=args.launcher,
            mpi_args=shlex.split(args.mpi_args),
            dry_run=args.dry_run,
        )
        if args.retries < 0:
            raise UsageError(f"--retries {args.retries} must be >= 0 (the number of relaunches after a failure)")
    except UsageError as e:
        print_error(str(e), prog=PROG)
        return 2
    if args.dry_run:
        print(f"# {plan.describe()}")
        print(plan.command_line())
        return 0
    if not args.quiet:
        print(f"launch: {plan.describe()}", file=sys.stderr, flush=True)
    if args.retries:

        def replan(env: Mapping[str, str]) -> LaunchPlan:
            return plan_launch(
                command,
                nproc=args.nproc,
                ppn=args.ppn,
                hostfile=args.hostfile,
                launcher=args.launcher,
                mpi_args=shlex.split(args.mpi_args),
                env=env,
                flavor=plan.mpi_flavor,
            )

        try:
            return run_with_retries(replan, plan, args.retries, quiet=args.quiet)
        except UsageError as e:
            print_error(str(e), prog=PROG)
            return 2
    env = {**os.environ, **plan.env}
    if plan.launcher == "local" or plan.mpi_flavor == "hydra":  # hydra: launch stays to name a failed rank
        try:
            return run_attempt(plan, env, [])
        except UsageError as e:
            print_error(str(e), prog=PROG)
            return 2
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(plan.argv[0], plan.argv, env)  # the launcher takes over: signals and exit code are its own
    except OSError as e:
        print_error(f"cannot run {plan.argv[0]!r}: {e.strerror}", prog=PROG)
        return 127


if __name__ == "__main__":
    sys.exit(main())
