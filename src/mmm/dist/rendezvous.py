"""Where ranks meet: MASTER_ADDR/MASTER_PORT, shared over MPI, derived from the Slurm step, or local."""

from __future__ import annotations

import os
import random
import resource
import socket
import zlib
from collections.abc import Mapping

from mmm import env as mmm_env
from mmm.dist.ranks import RankInfo, _mpi_comm, expand_nodelist
from mmm.errors import UsageError


# --------------------------------------------------------------------------- rendezvous
def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; other systems use higher ranges


def free_port() -> int:
    """A TCP port free on this host right now, chosen below the kernel's ephemeral range.

    A port the kernel hands out for ``bind(0)`` comes from the range it also gives to every outgoing
    connection, so in the seconds between choosing it and rank 0's store binding it, one of the many
    connections gloo opens (this job's or another's on the same host) may take it, and rank 0 fails
    with EADDRINUSE. Ports below that range are only ever taken by a program that asks for them.
    """
    top = _ephemeral_low()
    bottom = max(1024, top - 12000)
    pick = random.SystemRandom()
    if top - bottom >= 1000:
        for _ in range(64):
            port = pick.randrange(bottom, top)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("", port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def derived_port(key: str) -> int:
    """A port every rank computes alike from a job key; kept below Linux's ephemeral range."""
    return 10000 + zlib.crc32(key.encode()) % 20000


def _job_key(env: Mapping[str, str]) -> str | None:
    # each names one run of a launcher (one mpiexec, one srun step), never a whole job: two mpiexec runs
    # inside one PBS job must not meet at the same port (so PBS_JOBID is not a key)
    for names in (("PMIX_NAMESPACE",), ("SLURM_JOB_ID", "SLURM_STEP_ID"), ("PALS_APID",), ("OMPI_MCA_orte_hnp_uri",)):
        if all(n in env for n in names):
            return ".".join(env[n] for n in names)
    return None


def rendezvous(info: RankInfo, env: Mapping[str, str] | None = None) -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT for this job, the same on every rank."""
    env = os.environ if env is None else env
    addr, port = mmm_env.get("MASTER_ADDR", env=env), mmm_env.get("MASTER_PORT", env=env)
    if port and not addr and info.source == "slurm":  # `launch` under srun: the port, not rank 0's host
        addr = slurm_rank0_host(env)
    if addr and port:
        return addr, port
    if info.world_size == 1:
        return "127.0.0.1", free_port()
    if info.source in {"openmpi", "mpich", "pals", "mpi4py"}:
        comm = _mpi_comm()
        if comm is not None:
            check_mpi_world(comm, info)
            found = (socket.gethostname(), free_port()) if comm.Get_rank() == 0 else None
            found = comm.bcast(found, root=0)
            host, port_ = found
            return ("127.0.0.1" if info.local_known and info.num_nodes == 1 else host), port_
    key = _job_key(env)
    if info.source == "slurm" and key:
        host = slurm_rank0_host(env)
        if host:
            return host, derived_port(key)
    if info.local_known and info.num_nodes == 1 and key:
        return "127.0.0.1", derived_port(key)
    raise UsageError(
        f"cannot find a rendezvous for {info.world_size} ranks started by {info.source}: set MASTER_ADDR and "
        "MASTER_PORT, start with `launch` (it sets them), or install mpi4py (pip install 'mmm[mpi]')"
    )


def slurm_rank0_host(env: Mapping[str, str]) -> str | None:
    """The host of rank 0 of this Slurm step: the first line of ``SLURM_HOSTFILE`` under
    ``--distribution=arbitrary`` (tasks follow the file), else the step's first node (block, cyclic and
    plane distributions all start there)."""
    if env.get("SLURM_DISTRIBUTION", "").startswith("arbitrary") and env.get("SLURM_HOSTFILE"):
        try:
            with open(env["SLURM_HOSTFILE"]) as f:
                first = next((line.split()[0] for line in f if line.strip() and not line.startswith("#")), None)
        except OSError:
            first = None
        if first:
            return first
    nodes = expand_nodelist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""))
    return nodes[0] if nodes else None


def check_mpi_world(comm, info: RankInfo) -> None:
    """mpi4py's MPI must be the launcher's: an Open MPI mpi4py under MPICH's (or Cray's) mpiexec sees a
    1-rank world in every process, and each would act as rank 0 of its own job."""
    size = comm.Get_size()
    if size == info.world_size:
        return
    from mpi4py import MPI

    library = MPI.Get_library_version().strip().splitlines()[0].split(",")[0]
    raise UsageError(
        f"mpi4py's MPI ({library}) sees a world of {size} rank(s) but the launcher ({info.source}) started "
        f"{info.world_size}: mpi4py was built for another MPI than the mpiexec that started this job; run "
        "the mpiexec of mpi4py's MPI, rebuild mpi4py against the site's MPI "
        "(`pip install --no-binary mpi4py mpi4py`), or start with `launch`/torchrun",
        same_on_all_ranks=True,
    )


FILES_PER_RANK = 2  # connections to rank 0's store per rank: the process group's and the liveness watcher's
FILES_SPARE = 512  # gloo's pairs, libraries, logs, checkpoint files


def raise_open_file_limit(info: RankInfo) -> int:
    """Make room for this job's connections; the soft open-file limit it leaves.

    Rank 0 hosts the job's TCPStore, which holds two connections per rank. Measured with a store whose
    host had a soft limit of 64 open files: the 26th client was never accepted and timed out; so with
    the common soft limit of 1,024 a job of ~500 ranks waits until its timeout. The soft limit is
    raised as far as the job needs (never above the hard limit, the administrator's); if the hard
    limit is too low on rank 0, that is said in one line, at once, instead of a late timeout."""
    need = FILES_PER_RANK * info.world_size + FILES_SPARE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return soft
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < need and info.rank == 0:
        raise UsageError(
            f"rank 0 hosts the rendezvous store for {info.world_size} ranks and needs ~{need} open files, but "
            f"its hard limit is {hard}: raise it (`ulimit -Hn {need}` by the administrator, or a node with a "
            "higher limit)",
            same_on_all_ranks=False,
        )
    return target


def unknown_host(name: str) -> bool:
    """``name`` (a host name or address; IPv6 in brackets too) certainly names no host: the resolver says
    so (not a temporary failure of it, which torch's own retries may outlast)."""
    try:
        socket.getaddrinfo(name.strip("[]"), None)
    except UnicodeError:
        return True
    except socket.gaierror as e:
        return e.errno in {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}
    return False
