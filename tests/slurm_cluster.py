"""A real single-node Slurm cluster for tests: munged, slurmctld and slurmd on this host.

Everything lives in one private folder (config, munge key and socket, state, spool, logs, pid
files) and on free ports, so it touches no system configuration and can run beside another
cluster on the same host. The daemons run in the foreground as children of the test process
and are stopped by their PIDs. Needs root (slurmd starts jobs as any user) and Debian's
``slurm-wlm`` + ``munge`` (``scripts/test_deps.sh`` installs them where it can).

    cluster = SlurmCluster.start(folder)      # raises ClusterUnavailable / ClusterFailed
    subprocess.run(["srun", "-n", "2", "hostname"], env=cluster.environ())
    cluster.stop()

With ``hosts`` (a :class:`hosts.Hosts`), the cluster has one node per host: slurmctld stays in this
namespace (reached at the bridge's address), one slurmd runs in each host's namespace under its
hostname (``NodeName=node1`` ...), and client commands go through :meth:`SlurmCluster.command` on the
first host, as on a login node.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmm.dist import free_port

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd")
CLIENTS = ("srun", "salloc", "sbatch", "sinfo", "squeue", "scancel", "scontrol")
NODE_CPUS = 8
PARTITION = "debug"
# variables of an enclosing job or launcher that must not leak into the jobs of this cluster
_STRIP_PREFIXES = ("SLURM_", "SALLOC_", "SBATCH_", "SRUN_", "PMI_", "PMIX_", "OMPI_", "PALS_", "PBS_")
_STRIP = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "MMM_LAUNCHER",
    "MMM_LAUNCH_TIME",
    "MMM_DEVICE",
    "MMM_BACKEND",
    "LOG_FROM_ALL_RANKS",
    "MMM_LOG_ALL_RANKS",
    "MMM_FAULT",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
)


class ClusterUnavailable(RuntimeError):
    """This machine cannot host the cluster (not root, Slurm or munge not installed): skip."""


class ClusterFailed(RuntimeError):
    """The cluster was started but did not come up; the message carries the daemons' logs."""


def missing_requirements() -> str | None:
    """Why this machine cannot run the cluster, or None if it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "a real Slurm cluster needs root (slurmd starts job steps as their user)"
    absent = [c for c in (*DAEMONS, *CLIENTS) if shutil.which(c, path=_sbin_path()) is None]
    if absent:
        return (
            f"Slurm/munge not installed ({', '.join(absent)} not found); `make test-deps` (scripts/test_deps.sh) "
            "installs Debian's slurm-wlm and munge as root"
        )
    return None


def _sbin_path() -> str:
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin"])


def _which(name: str) -> str:
    exe = shutil.which(name, path=_sbin_path())
    if exe is None:
        raise ClusterUnavailable(f"{name} not found")
    return exe


def _free_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:  # below the ephemeral range, like launch's (mmm.dist.free_port)
        ports.add(free_port())
    return sorted(ports)


def tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"  ({path.name}: {e.strerror})"
    return "\n".join(f"  {ln}" for ln in text[-lines:]) or f"  ({path.name} is empty)"


@dataclass
class SlurmCluster:
    root: Path
    node: str
    conf: Path
    ctld_port: int
    slurmd_port: int
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    startup_s: float = 0.0
    hosts: Any = None  # a hosts.Hosts: one slurmd per host

    @property
    def nodes(self) -> list[str]:
        return self.hosts.names if self.hosts is not None else [self.node]

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` as run from the cluster's submit host (the first host of a multi-host cluster)."""
        return self.hosts.command(self.hosts.names[0], argv) if self.hosts is not None else argv

    # ------------------------------------------------------------------ environment
    @property
    def env(self) -> dict[str, str]:
        """What a client command needs on top of a clean environment."""
        return {"SLURM_CONF": str(self.conf)}

    def environ(self, **extra: str) -> dict[str, str]:
        """This process's environment without any enclosing job's or launcher's variables, pointed
        at this cluster, with one thread per rank, plain logs and unbuffered output."""
        env = {k: v for k, v in os.environ.items() if k not in _STRIP and not k.startswith(_STRIP_PREFIXES)}
        env.update(self.env, OMP_NUM_THREADS="1", MMM_RICH="0", PYTHONUNBUFFERED="1")
        env.update(extra)
        return env

    def logs(self, lines: int = 25) -> str:
        """The tails of the daemons' logs (munged runs in the foreground: its log is its output)."""
        files = [
            self.root / "slurmctld.log",
            *(self.root / f"slurmd-{n}.log" for n in self.nodes),
            self.root / "munged.out",
        ]
        return "\n".join(f"--- {f} (last {lines} lines):\n{tail(f, lines)}" for f in files)

    # ------------------------------------------------------------------ start
    @classmethod
    def start(cls, root: Path, *, timeout: float = 60.0, hosts=None) -> SlurmCluster:
        why = missing_requirements()
        if why:
            raise ClusterUnavailable(why)
        root = Path(root)
        if len(str(root)) > 60:  # unix socket paths (munge, slurmd's step sockets) must stay under 108 bytes
            root = Path(tempfile.mkdtemp(prefix="mmm-slurm-"))
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o711)
        for d in ("state", "spool"):
            (root / d).mkdir(exist_ok=True)
        ctld_port, slurmd_port = _free_ports(2)
        node = socket.gethostname().split(".")[0]
        cluster = cls(root, node, root / "slurm.conf", ctld_port, slurmd_port, hosts=hosts)
        t0 = time.monotonic()
        try:
            cluster._start(timeout)
        except BaseException:
            cluster.stop()
            raise
        cluster.startup_s = time.monotonic() - t0
        return cluster

    def _start(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        r = self.root
        key, sock = r / "munge.key", r / "munge.socket"
        if not key.exists():
            subprocess.run(
                [_which("mungekey"), "--create", "--keyfile", str(key)], check=True, timeout=30, capture_output=True
            )
        sock.unlink(missing_ok=True)  # a stale socket would pass for a running munged
        self._spawn(
            "munged",
            [
                _which("munged"),
                "--foreground",
                "--force",
                f"--socket={sock}",
                f"--key-file={key}",
                f"--pid-file={r / 'munged.pid'}",
                f"--seed-file={r / 'munged.seed'}",
            ],
        )
        self._wait("munge's socket", lambda: sock.exists(), deadline)
        self.conf.write_text(self.config())
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-c", "-f", str(self.conf)])
        for node in self.nodes:
            (r / "spool" / node).mkdir(parents=True, exist_ok=True)
            argv = [_which("slurmd"), "-D", "-f", str(self.conf), "-N", node]
            self._spawn(
                f"slurmd-{node}" if self.hosts else "slurmd", self.hosts.command(node, argv) if self.hosts else argv
            )
        self._wait(f"node(s) {', '.join(self.nodes)} idle in sinfo", self._node_idle, deadline)

    def config(self) -> str:
        r = self.root
        return f"""\
# a one-node test cluster; every path in {r}
ClusterName=mmmtest
SlurmctldHost={self.node}({self.hosts.bridge_address if self.hosts else "127.0.0.1"})
SlurmctldPort={self.ctld_port}
SlurmdPort={self.slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r / "munge.socket"}
StateSaveLocation={r / "state"}
SlurmdSpoolDir={r / "spool" / "%n"}
SlurmctldPidFile={r / "slurmctld.pid"}
SlurmdPidFile={r / "slurmd-%n.pid"}
SlurmctldLogFile={r / "slurmctld.log"}
SlurmdLogFile={r / "slurmd-%n.log"}
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
SwitchType=switch/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MailProg=/bin/true
ReturnToService=2
SlurmdParameters=config_overrides
InactiveLimit=0
KillWait=5
MinJobAge=30
MessageTimeout=20
SlurmctldTimeout=30
SlurmdTimeout=60
{self._node_lines()}
PartitionName={PARTITION} Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""

    def _node_lines(self) -> str:
        if self.hosts is None:
            return f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={NODE_CPUS} State=UNKNOWN"
        cpus = NODE_CPUS // 2  # per host; 2 cores shared by all
        return "\n".join(
            f"NodeName={h} NodeAddr={self.hosts.address(h)} CPUs={cpus} State=UNKNOWN" for h in self.hosts.names
        )

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.root, env=self.environ()
        )
        log.close()

    def _wait(self, what: str, ready, deadline: float) -> None:
        delay = 0.02
        while True:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise ClusterFailed(
                        f"{name} exited with code {p.returncode} while waiting for {what}\n{self._failure_context()}"
                    )
            if ready():
                return
            if time.monotonic() > deadline:
                raise ClusterFailed(f"timed out waiting for {what}\n{self._failure_context()}")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def _failure_context(self) -> str:
        out = [self.logs()]
        for name, p in self.procs.items():  # what a daemon said before its log file was open
            if p.poll() is not None and name != "munged":
                out.append(f"--- {name}'s own output (last 10 lines):\n{tail(self.root / f'{name}.out', 10)}")
        return "\n".join(out)

    def sinfo_state(self) -> str:
        try:
            p = subprocess.run(
                [_which("sinfo"), "-h", "-N", "-n", ",".join(self.nodes), "-o", "%t"],
                env=self.environ(),
                capture_output=True,
                text=True,
                timeout=10,
            )
        except subprocess.TimeoutExpired:
            return ""
        return p.stdout.strip() if p.returncode == 0 else ""

    def _node_idle(self) -> bool:
        states = self.sinfo_state().split()
        return len(states) == len(self.nodes) and all(s in {"idle", "mix", "alloc"} for s in states)

    # ------------------------------------------------------------------ jobs
    def wait_job(self, job_id: str, timeout: float) -> tuple[str, str]:
        """Poll until a batch job ends: its final state and exit code (``COMPLETED``, ``0:0``).

        Like ``sbatch --wait``, but polled at 0.2 s: ``sbatch --wait`` backs off to tens of
        seconds between its checks, which a short job spends idle."""
        deadline = time.monotonic() + timeout
        state = "?"
        while time.monotonic() < deadline:
            p = subprocess.run(
                [_which("scontrol"), "show", "job", "-o", job_id],
                env=self.environ(),
                capture_output=True,
                text=True,
                timeout=10,
            )
            fields = dict(f.split("=", 1) for f in p.stdout.split() if "=" in f)
            state = fields.get("JobState", "?")
            if state not in {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "?"}:
                return state, fields.get("ExitCode", "?")
            time.sleep(0.2)
        raise TimeoutError(f"job {job_id} still {state} after {timeout:.0f} s")

    # ------------------------------------------------------------------ stop
    def stop(self, grace: float = 10.0) -> None:
        """Cancel this cluster's jobs, then stop slurmd, slurmctld and munged by their PIDs."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            try:
                subprocess.run(
                    [_which("scancel"), "--full", f"--partition={PARTITION}"],
                    env=self.environ(),
                    capture_output=True,
                    timeout=10,
                )
                end = time.monotonic() + grace
                while time.monotonic() < end:
                    q = subprocess.run(
                        [_which("squeue"), "-h", "-o", "%i"],
                        env=self.environ(),
                        capture_output=True,
                        text=True,
                        timeout=10,
                    )
                    if q.returncode != 0 or not q.stdout.strip():
                        break
                    time.sleep(0.2)
            except (OSError, subprocess.TimeoutExpired, ClusterUnavailable):
                pass
        for name in (*(n for n in self.procs if n.startswith("slurmd")), "slurmctld", "munged"):
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.procs.clear()
