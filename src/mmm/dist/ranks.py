"""Who am I: rank, local rank, world size and nodes from the launcher's variables (torchrun, Open MPI,
MPICH/Intel MPI, Cray PALS, Slurm), or from MPI itself; Slurm node lists."""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from mmm import env as mmm_env
from mmm.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    pass


# --------------------------------------------------------------------------- ranks
@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job, as the launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    source: str  # which launcher's variables: torchrun, openmpi, mpich, pals, slurm, mpi4py, single
    # False when the launcher did not say which ranks share this host (local rank and size are then a
    # guess); rendezvous then never assumes that every rank is on this host
    local_known: bool = field(default=True, compare=False)

    @property
    def num_nodes(self) -> int:
        """Node count, assuming the same number of ranks on every node (ceil)."""
        return -(-self.world_size // max(1, self.local_world_size))


# (source, rank var, size var, local rank var, local size vars (the first set wins)); first match wins.
_ENV_SOURCES: tuple[tuple[str, str, str, str, tuple[str, ...]], ...] = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", ("LOCAL_WORLD_SIZE",)),
    (
        "openmpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        ("OMPI_COMM_WORLD_LOCAL_SIZE",),
    ),
    ("pals", "PALS_RANKID", "PMI_SIZE", "PALS_LOCAL_RANKID", ("PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE")),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", ("MPI_LOCALNRANKS",)),
)
# Prefixes and names of what launchers put in a rank's environment (see without_launcher_vars)
_LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "PALS_", "SLURM_", "HYDI_", "HYDRA_", "MPI_", "I_MPI_", "TORCHELASTIC_")
_LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
# what mmm's launch gives its ranks: the rank watch's folder and address, the stack folder, the attempt
_LAUNCHER_NAMES += ("MMM_PID_DIR", "MMM_WATCH", "MMM_STACK_DIR", "MMM_RESTART", "MMM_DROPPED_HOSTS", "MMM_RUN_ID")


def without_launcher_vars(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (this process's) without the variables a launcher gave this rank: for a helper process a
    rank starts, which must not take itself for a rank of the job (or talk to its MPI)."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if not (k.startswith(_LAUNCHER_PREFIXES) or k in _LAUNCHER_NAMES)}


# Variables that say "an MPI launcher started me" without giving the world size.
_MPI_HINTS = ("PMIX_RANK", "PMI_FD", "PMI_RANK", "PALS_RANKID", "HYDI_CONTROL_FD", "MPI_LOCALRANKID")


def _int_var(env: Mapping[str, str], name: str) -> int:
    value = mmm_env.get(name, env=env)
    if value is None:
        raise UsageError(f"{name} is empty; the launcher sets it, so unset it or start the job with launch")
    return value


def parse_tasks_per_node(spec: str) -> list[int]:
    """Slurm's ``SLURM_STEP_TASKS_PER_NODE`` form: ``"4(x2),3"`` -> ``[4, 4, 3]`` (ValueError if malformed)."""
    return mmm_env.TASKS_PER_NODE.parse(spec)


def _slurm_ranks(env: Mapping[str, str]) -> RankInfo | None:
    # In a batch script SLURM_PROCID=0 is set but nothing was srun'd: require a step.
    if "SLURM_PROCID" not in env or "SLURM_STEP_ID" not in env:
        return None
    size_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    if size_var not in env:
        return None
    rank, world = _int_var(env, "SLURM_PROCID"), _int_var(env, size_var)
    local_rank = _int_var(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
    local_size = world
    per_node = mmm_env.get("SLURM_STEP_TASKS_PER_NODE", env=env) or mmm_env.get("SLURM_TASKS_PER_NODE", env=env)
    if per_node:
        node = mmm_env.get("SLURM_NODEID", 0, env=env)
        local_size = per_node[min(node, len(per_node) - 1)]
    return RankInfo(rank, world, local_rank, local_size, "slurm")


def discover_ranks(env: Mapping[str, str] | None = None, *, use_mpi4py: bool = True) -> RankInfo:
    """Rank, world size and local rank from the launcher's environment.

    Order: torchrun-style variables, Open MPI, Cray PALS, MPICH/Intel MPI (Hydra; but inside a
    Slurm step that set only PMI_RANK/PMI_SIZE, as ``srun --mpi=pmi2`` does, the step's own
    variables, which also give the local rank and node), a Slurm step; then, if an MPI launcher is
    evident but gave no sizes (PMIx), mpi4py; else a single process. Inside a Slurm step, ``RANK`` and
    ``WORLD_SIZE`` equal to the step's own (a job script that exported them) without ``LOCAL_RANK``
    do not hide the step's local ids. When the launcher gives no local rank or size, mpi4py's
    node-local communicator says which ranks share this host; without it the local layout is marked
    unknown (``local_known=False``) rather than assumed to be a single node.
    """
    env = os.environ if env is None else env
    slurm = _slurm_ranks(env)
    for source, rank_v, size_v, lrank_v, lsize_vs in _ENV_SOURCES:
        if (
            slurm is not None
            and source in ("mpich", "torchrun")
            and lrank_v not in env
            and _same_as(slurm, env, rank_v, size_v)
        ):
            break  # srun --mpi=pmi2 (PMI_RANK/PMI_SIZE only) or a script's own RANK: the Slurm step says more
        if rank_v in env and size_v in env:
            rank, world = _int_var(env, rank_v), _int_var(env, size_v)
            lsize_v = next((v for v in lsize_vs if v in env), None)
            if lrank_v in env and lsize_v is not None:
                info = RankInfo(rank, world, _int_var(env, lrank_v), _int_var(env, lsize_v), source)
            else:
                info = _local_from_mpi(RankInfo(rank, world, rank, world, source, local_known=False), use_mpi4py)
            return _checked(info, rank_v, size_v)
    if slurm is not None:
        return _checked(slurm, "SLURM_PROCID", "SLURM_NTASKS")
    if use_mpi4py and any(v in env for v in _MPI_HINTS):
        comm = _mpi_comm()
        if comm is None:
            hint = next(v for v in _MPI_HINTS if v in env)
            raise UsageError(
                f"started by an MPI launcher ({hint}={env[hint]}) that does not export the world size; "
                "install mpi4py (pip install 'mmm[mpi]') or start with `launch`, torchrun or mpiexec",
                same_on_all_ranks=False,
            )
        from mpi4py import MPI

        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        info = RankInfo(comm.Get_rank(), comm.Get_size(), local.Get_rank(), local.Get_size(), "mpi4py")
        local.Free()
        return info
    world = mmm_env.get("WORLD_SIZE", env=env)  # checked as a count
    if world not in (None, 1):  # a script's own, half set: not one process
        raise UsageError(
            f"WORLD_SIZE={world} is set but RANK is not: set both (each rank its own RANK), or start "
            "with `launch` or torchrun (they set them); unset WORLD_SIZE for a single process",
            same_on_all_ranks=False,
        )
    return RankInfo(0, 1, 0, 1, "single")


def _same_as(slurm: RankInfo, env: Mapping[str, str], rank_v: str, size_v: str) -> bool:
    return (
        rank_v in env
        and size_v in env
        and (_int_var(env, rank_v), _int_var(env, size_v)) == (slurm.rank, slurm.world_size)
    )


def _local_from_mpi(info: RankInfo, use_mpi4py: bool) -> RankInfo:
    """The launcher named rank and world but not who shares this host: ask MPI's node-local communicator
    (when mpi4py is there and sees the same world); else keep ``local_known=False``."""
    comm = _mpi_comm() if use_mpi4py and info.world_size > 1 else None
    if comm is None or comm.Get_size() != info.world_size:
        return info
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return replace(info, local_rank=local.Get_rank(), local_world_size=local.Get_size(), local_known=True)
    finally:
        local.Free()


def _checked(info: RankInfo, rank_v: str, size_v: str) -> RankInfo:
    if info.world_size < 1 or not 0 <= info.rank < info.world_size:
        raise UsageError(
            f"{rank_v}={info.rank} with {size_v}={info.world_size} is not a valid rank; a rank lies in [0, world size)",
            same_on_all_ranks=False,
        )
    return info


def _mpi_comm():
    """COMM_WORLD from mpi4py, or None if mpi4py is not installed."""
    if mmm_env.get("MMM_NO_MPI4PY", False):
        return None
    try:
        with warnings.catch_warnings():  # another MPI's mpiexec: rendezvous names the mismatch in one line
            warnings.filterwarnings("ignore", message="suspicious MPI execution environment")
            from mpi4py import MPI
    except ImportError:
        return None
    return MPI.COMM_WORLD


def _split_top_level(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_one(item: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", item)
    if not m:
        return [item]
    head, tail = item[: m.start()], item[m.end() :]
    out: list[str] = []
    for rng in m.group(1).split(","):
        rng = rng.strip()
        if "-" in rng:
            lo, hi = rng.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise UsageError(f"bad range {rng!r} in Slurm node list {item!r}")
            out += [f"{head}{n:0{len(lo)}d}" for n in range(int(lo), int(hi) + 1)]
        elif rng.isdigit():
            out.append(f"{head}{rng}")
        else:
            raise UsageError(f"bad entry {rng!r} in Slurm node list {item!r}")
    return [host + rest for host in out for rest in _expand_one(tail)]


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list: ``"nid[001-003,010],login1"`` -> 4 + 1 hosts, zero padding kept."""
    if text.count("[") != text.count("]"):
        raise UsageError(f"unbalanced brackets in Slurm node list {text!r}")
    return [h for item in _split_top_level(text) for h in _expand_one(item)]
