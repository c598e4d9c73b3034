"""Distributed bootstrap: who am I, which device and backend, the process group, seeds, teardown.

The flow every mmm program follows::

    info = mmm.dist.setup(seed=0)      # ranks, device, backend, process group, logging
    ...                                # build mesh, model, train
    mmm.dist.teardown()                # barrier + destroy, never an exit abort

Programs run as ``python -m ...`` wrap their ``main`` in :func:`run_main`, which adds
one-line errors for bad input, SIGTERM handling and the clean-exit sequence.

Environment variables read here (all optional):

- ``MMM_DEVICE``: ``auto`` (default: cuda > xpu > mps > cpu), ``cpu``, ``cuda``, ``xpu``, ``mps``.
- ``MMM_BACKEND``: force a process-group backend (``gloo``, ``nccl``, ``xccl``, ``ccl``).
- ``MMM_TIMEOUT``: collective timeout in seconds (default 600).
- ``MASTER_ADDR`` / ``MASTER_PORT``: rendezvous; set by ``launch`` and torchrun, otherwise
  shared over MPI (mpi4py), derived from the Slurm step, or local for one-node jobs.
- ``LOG_FROM_ALL_RANKS=1``: log from every rank, not only rank 0.
"""

from __future__ import annotations

import atexit
import datetime
import os
import signal
import socket
import sys
import threading
import time
import traceback
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

from mmm.errors import UsageError, print_error
from mmm.log import get_logger

if TYPE_CHECKING:  # pragma: no cover
    import torch

DEFAULT_TIMEOUT_S = 600.0
USAGE_ERROR_GRACE_S = 3.0  # other ranks wait this long before exiting so rank 0 can print a shared error
DEVICE_CHOICES = ("auto", "cpu", "cuda", "xpu", "mps")
_BACKEND_FOR = {"cuda": "nccl", "cpu": "gloo", "mps": "gloo"}

log = get_logger("dist")


# --------------------------------------------------------------------------- ranks
@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job, as the launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    source: str  # which launcher's variables: torchrun, openmpi, mpich, pals, slurm, mpi4py, single

    @property
    def num_nodes(self) -> int:
        """Node count, assuming the same number of ranks on every node (ceil)."""
        return -(-self.world_size // max(1, self.local_world_size))


# (source, rank var, size var, local rank var, local size var); first match wins.
_ENV_SOURCES: tuple[tuple[str, str, str, str, str], ...] = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("pals", "PALS_RANKID", "PMI_SIZE", "PALS_LOCAL_RANKID", "PMI_LOCAL_SIZE"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)
# Variables that say "an MPI launcher started me" without giving the world size.
_MPI_HINTS = ("PMIX_RANK", "PMI_FD", "PMI_RANK", "PALS_RANKID", "HYDI_CONTROL_FD", "MPI_LOCALRANKID")


def _int_var(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw.strip())
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not an integer; fix or unset it", same_on_all_ranks=False) from None


def parse_tasks_per_node(spec: str) -> list[int]:
    """Slurm's ``SLURM_STEP_TASKS_PER_NODE`` form: ``"4(x2),3"`` -> ``[4, 4, 3]``."""
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if "(x" in part:
            count, reps = part.rstrip(")").split("(x")
            out += [int(count)] * int(reps)
        else:
            out.append(int(part))
    return out


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
    tpn = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if tpn:
        per_node = parse_tasks_per_node(tpn)
        node = int(env.get("SLURM_NODEID", "0"))
        if per_node:
            local_size = per_node[min(node, len(per_node) - 1)]
    return RankInfo(rank, world, local_rank, local_size, "slurm")


def discover_ranks(env: Mapping[str, str] | None = None, *, use_mpi4py: bool = True) -> RankInfo:
    """Rank, world size and local rank from the launcher's environment.

    Order: torchrun-style variables, Open MPI, Cray PALS, MPICH/Intel MPI (Hydra), a Slurm
    step; then, if an MPI launcher is evident but gave no sizes (PMIx), mpi4py; else a
    single process. Missing local-rank variables fall back to a single-node assumption.
    """
    env = os.environ if env is None else env
    for source, rank_v, size_v, lrank_v, lsize_v in _ENV_SOURCES:
        if rank_v in env and size_v in env:
            rank, world = _int_var(env, rank_v), _int_var(env, size_v)
            local_rank = _int_var(env, lrank_v) if lrank_v in env else rank
            local_size = _int_var(env, lsize_v) if lsize_v in env else world
            return _checked(RankInfo(rank, world, local_rank, local_size, source), rank_v, size_v)
    slurm = _slurm_ranks(env)
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
    return RankInfo(0, 1, 0, 1, "single")


def _checked(info: RankInfo, rank_v: str, size_v: str) -> RankInfo:
    if info.world_size < 1 or not 0 <= info.rank < info.world_size:
        raise UsageError(
            f"{rank_v}={info.rank} with {size_v}={info.world_size} is not a valid rank; "
            "a rank lies in [0, world size)",
            same_on_all_ranks=False,
        )
    return info


def _mpi_comm():
    """COMM_WORLD from mpi4py, or None if mpi4py is not installed."""
    if os.environ.get("MMM_NO_MPI4PY", "") in {"1", "true"}:
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.COMM_WORLD


# --------------------------------------------------------------------------- rendezvous
def free_port() -> int:
    """A TCP port free on this host right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def derived_port(key: str) -> int:
    """A port every rank computes alike from a job key; kept below Linux's ephemeral range."""
    return 10000 + zlib.crc32(key.encode()) % 20000


def _job_key(env: Mapping[str, str]) -> str | None:
    for names in (("PMIX_NAMESPACE",), ("SLURM_JOB_ID", "SLURM_STEP_ID"), ("PALS_APID",), ("PBS_JOBID",),
                  ("OMPI_MCA_orte_hnp_uri",)):
        if all(n in env for n in names):
            return ".".join(env[n] for n in names)
    return None


def rendezvous(info: RankInfo, env: Mapping[str, str] | None = None) -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT for this job, the same on every rank."""
    env = os.environ if env is None else env
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if addr and port:
        try:
            return addr, int(port)
        except ValueError:
            raise UsageError(f"MASTER_PORT={port!r} is not a port number") from None
    if info.world_size == 1:
        return "127.0.0.1", free_port()
    if info.source in {"openmpi", "mpich", "pals", "mpi4py"}:
        comm = _mpi_comm()
        if comm is not None:
            found = (socket.gethostname(), free_port()) if comm.Get_rank() == 0 else None
            found = comm.bcast(found, root=0)
            host, port_ = found
            return ("127.0.0.1" if info.num_nodes == 1 else host), port_
    key = _job_key(env)
    if info.source == "slurm" and key:
        from mmm.launch import expand_nodelist

        nodes = expand_nodelist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""))
        if nodes:
            return nodes[0], derived_port(key)
    if info.num_nodes == 1 and key:
        return "127.0.0.1", derived_port(key)
    raise UsageError(
        f"cannot find a rendezvous for {info.world_size} ranks started by {info.source}: set MASTER_ADDR and "
        "MASTER_PORT, start with `launch` (it sets them), or install mpi4py (pip install 'mmm[mpi]')"
    )


# --------------------------------------------------------------------------- device
def _available(kind: str) -> int:
    import torch

    if kind == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "xpu":
        xpu = getattr(torch, "xpu", None)
        return xpu.device_count() if xpu is not None and xpu.is_available() else 0
    if kind == "mps":
        return 1 if torch.backends.mps.is_available() else 0
    return 1


def pick_device(local_rank: int = 0, requested: str | None = None) -> torch.device:
    """The device for this rank: ``requested`` or ``MMM_DEVICE``, else cuda > xpu > mps > cpu."""
    import torch

    origin = "requested" if requested else "MMM_DEVICE"
    kind = (requested or os.environ.get("MMM_DEVICE") or "auto").strip().lower()
    if kind not in DEVICE_CHOICES:
        raise UsageError(f"unknown device {kind!r} ({origin}); choose one of: {', '.join(DEVICE_CHOICES)}")
    if kind == "auto":
        kind = next((k for k in ("cuda", "xpu", "mps") if _available(k)), "cpu")
    count = _available(kind)
    if count == 0:
        have = [k for k in ("cuda", "xpu", "mps") if _available(k)] + ["cpu"]
        raise UsageError(
            f"device {kind!r} was {origin} but this machine has none (torch {torch.__version__}); "
            f"available: {', '.join(have)}; set MMM_DEVICE=auto or one of those"
        )
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, local_rank % count)


def pick_backend(device: torch.device) -> str:
    """Process-group backend for a device: nccl for cuda, xccl (or oneCCL's ccl) for xpu, else gloo."""
    forced = os.environ.get("MMM_BACKEND")
    if forced:
        return forced
    if device.type == "xpu":
        import torch.distributed as dist

        if getattr(dist, "is_xccl_available", lambda: False)():
            return "xccl"
        try:  # older stacks: Intel's oneCCL bindings register the "ccl" backend on import
            import oneccl_bindings_for_pytorch  # noqa: F401
        except ImportError:
            raise UsageError(
                "device xpu needs a collective backend: use a torch built with XCCL, or install the oneCCL "
                "bindings (pip install 'mmm[xpu]'); or set MMM_DEVICE=cpu"
            ) from None
        return "ccl"
    return _BACKEND_FOR.get(device.type, "gloo")


def timeout_seconds(value: float | None = None) -> float:
    raw = value if value is not None else os.environ.get("MMM_TIMEOUT", DEFAULT_TIMEOUT_S)
    try:
        seconds = float(raw)
    except (TypeError, ValueError):
        raise UsageError(f"MMM_TIMEOUT={raw!r} is not a number of seconds") from None
    if not seconds > 0:
        where = f"--timeout {seconds:g}" if value is not None else f"MMM_TIMEOUT={raw}"
        raise UsageError(f"{where}: the collective timeout must be a positive number of seconds")
    return seconds


# --------------------------------------------------------------------------- setup
@dataclass
class DistInfo:
    """What :func:`setup` established; also available later as :func:`info`."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    num_nodes: int
    launcher: str
    device: Any  # torch.device
    backend: str | None  # None for a single process without a process group
    hostname: str = field(default_factory=socket.gethostname)
    timeout_s: float = DEFAULT_TIMEOUT_S
    seed: int | None = None
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


_INFO: DistInfo | None = None


def info() -> DistInfo:
    """The :class:`DistInfo` from :func:`setup` (which it calls if nobody has yet)."""
    return _INFO if _INFO is not None else setup()


def banner(di: DistInfo | None = None) -> str:
    """One line on where this job runs: launcher, ranks, nodes, device, backend, versions."""
    import platform

    import torch

    from mmm import __version__

    di = di or info()
    mpi = f" mpi4py={sys.modules['mpi4py'].__version__}" if "mpi4py" in sys.modules else ""
    return (f"mmm {__version__} | launcher={di.launcher} world={di.world_size} nodes={di.num_nodes} "
            f"local_world={di.local_world_size} | device={di.device} backend={di.backend} | "
            f"python={platform.python_version()} torch={torch.__version__}{mpi}")


def launch_time() -> float | None:
    """Wall-clock time ``launch`` started (``MMM_LAUNCH_TIME``), if launched by it."""
    raw = os.environ.get("MMM_LAUNCH_TIME")
    try:
        return float(raw) if raw else None
    except ValueError:
        return None


def setup(
    *,
    device: str | None = None,
    seed: int | None = None,
    timeout: float | None = None,
    all_ranks_log: bool | None = None,
    init_process_group: bool | None = None,
) -> DistInfo:
    """Discover ranks, pick device and backend, start the process group, seed, configure logging.

    Idempotent: a second call returns the first call's result. ``init_process_group``
    defaults to True (a world of one gets a one-rank gloo group so that meshes and
    collectives work the same everywhere); pass False to skip it for a single process.
    """
    global _INFO
    if _INFO is not None:
        return _INFO
    t0 = time.perf_counter()
    ranks = discover_ranks()
    from mmm import log as mlog

    mlog.configure(rank=ranks.rank, world_size=ranks.world_size, all_ranks=all_ranks_log)
    timeout_s = timeout_seconds(timeout)
    t_import = time.perf_counter()
    import torch
    import torch.distributed as dist

    timings = {"import_torch_s": time.perf_counter() - t_import}
    dev = pick_device(ranks.local_rank, device)
    if dev.type != "cpu":
        getattr(torch, dev.type).set_device(dev)  # before the process group, so NCCL/XCCL bind here
    want_pg = True if init_process_group is None else init_process_group
    backend = None
    if want_pg and not dist.is_initialized():
        backend = pick_backend(dev)
        t_pg = time.perf_counter()
        _init_process_group(ranks, backend, dev, timeout_s)
        timings["init_process_group_s"] = time.perf_counter() - t_pg
    elif dist.is_initialized():
        backend = dist.get_backend()
    if seed is not None:
        seed_all(seed)
    launcher = os.environ.get("MMM_LAUNCHER") or ranks.source
    _INFO = DistInfo(
        rank=ranks.rank, world_size=ranks.world_size, local_rank=ranks.local_rank,
        local_world_size=ranks.local_world_size, num_nodes=ranks.num_nodes, launcher=launcher,
        device=dev, backend=backend, timeout_s=timeout_s, seed=seed, timings=timings,
    )
    timings["setup_s"] = time.perf_counter() - t0
    atexit.register(_atexit_teardown)
    log.debug("setup: %s", _INFO)
    return _INFO


def _init_process_group(ranks: RankInfo, backend: str, dev, timeout_s: float) -> None:
    import torch.distributed as dist

    kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if dev.type in {"cuda", "xpu"}:
        kwargs["device_id"] = dev  # eager init: communicators are ready before the first collective
    if ranks.world_size == 1:
        store = dist.HashStore()  # no port, no network for a one-rank group
        dist.init_process_group(backend, store=store, rank=0, world_size=1, **kwargs)
        return
    addr, port = rendezvous(ranks)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    dist.init_process_group(
        backend, init_method=f"tcp://{addr}:{port}", rank=ranks.rank, world_size=ranks.world_size, **kwargs
    )


def seed_all(seed: int) -> None:
    """Identical weight init on every rank: seed python, numpy (if loaded) and torch with ``seed``."""
    import random

    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    if "numpy" in sys.modules:
        import numpy as np

        np.random.seed(seed % 2**32)


DATA_SEED_STRIDE = 2**20  # data-parallel ranks per seed without collision


def data_seed(seed: int, dp_rank: int) -> int:
    """Seed of a data stream: distinct for every (seed, dp_rank) with dp_rank < 2**20.

    Ranks that share a dp rank (TP, CP, PP peers) get the same stream, as they must.
    """
    if not 0 <= dp_rank < DATA_SEED_STRIDE:
        raise ValueError(f"dp_rank={dp_rank} out of range [0, {DATA_SEED_STRIDE})")
    return (seed * DATA_SEED_STRIDE + dp_rank + 1) % 2**63


def data_generator(seed: int, dp_rank: int, device="cpu") -> torch.Generator:
    import torch

    g = torch.Generator(device=device)
    g.manual_seed(data_seed(seed, dp_rank))
    return g


# --------------------------------------------------------------------------- teardown
def teardown(*, ok: bool = True, finalize_mpi: bool | None = None) -> None:
    """Leave the process group cleanly (PLATFORM.md, "Exit abort").

    On success every rank meets at a barrier before destroying the group, so no gloo
    worker still holds a collective's buffers while the interpreter shuts down. After a
    failure the barrier is skipped (peers may be gone); the group is destroyed anyway.
    ``MPI.Finalize`` (when mpi4py started MPI) waits for every rank, so it runs only when all
    ranks are leaving together (``finalize_mpi``, default ``ok``): after a failure a stalled
    peer would hold it forever, and skipping it lets mpiexec see the exit and stop the job.
    """
    global _INFO
    dist = sys.modules.get("torch.distributed")
    try:  # absent, or cut short mid-import by a signal: then there is no process group to leave
        ready = dist is not None and dist.is_available() and dist.is_initialized()
    except Exception:
        ready = False
    if ready:
        if ok and dist.get_world_size() > 1:
            try:
                dist.barrier()
            except Exception as e:  # a peer died after we finished: say so, still tear down
                log.warning("teardown barrier failed: %s", _first_line(e))
        try:
            dist.destroy_process_group()
        except Exception as e:  # pragma: no cover
            log.warning("destroy_process_group failed: %s", _first_line(e))
    if "mpi4py.MPI" in sys.modules and (ok if finalize_mpi is None else finalize_mpi):
        MPI = sys.modules["mpi4py.MPI"]
        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    _INFO = None


def _atexit_teardown() -> None:
    # A program that forgot teardown(): destroy without a barrier (peers may have exited).
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


class Terminated(SystemExit):
    """Raised in the main thread when SIGTERM arrives (preemption, launcher shutting down)."""


def _on_sigterm(signum, frame):  # pragma: no cover - exercised through subprocess tests
    raise Terminated(128 + signum)


_STOP_SIGNAL: int | None = None


def _on_sigterm_graceful(signum, frame):  # pragma: no cover - exercised through subprocess tests
    global _STOP_SIGNAL
    if _STOP_SIGNAL is not None:  # a second SIGTERM: stop now
        raise Terminated(128 + signum)
    _STOP_SIGNAL = signum


def graceful_sigterm() -> None:
    """From now on the first SIGTERM only asks the training loop to stop after the current step
    (see :func:`stop_agreed`); a second one stops at once, as before."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm_graceful)


def stop_agreed() -> str | None:
    """Whether any rank got SIGTERM, agreed by every rank (one small all-reduce): all ranks leave the
    loop after the same step. Returns the signal's name, or None."""
    import torch
    import torch.distributed as dist

    flag = _STOP_SIGNAL or 0
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([flag], dtype=torch.int32, device=info().device if _INFO is not None else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        flag = int(t.item())
    return signal.Signals(flag).name if flag else None


def _is_user_error(e: BaseException) -> bool:
    return isinstance(e, UsageError)


def run_main(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None,
             *, prog: str | None = None) -> NoReturn:
    """Run a distributed program's ``main`` and exit the way a cluster job should.

    - bad input (:class:`~mmm.errors.UsageError`, argparse errors): one line on stderr
      (rank 0 only when every rank hits it alike), exit 2, no traceback;
    - an unexpected exception: its traceback, prefixed by the rank, exit 1;
    - SIGTERM: exit 143 after teardown; Ctrl-C: exit 130;
    - always: barrier (on success) + destroy the process group + ``MPI.Finalize`` if
      MPI was started, flush, then ``os._exit`` so no interpreter-shutdown race can abort.
    """
    prog = prog or os.path.basename(sys.argv[0])
    if prog == "__main__.py":
        prog = "mmm"
    signal.signal(signal.SIGTERM, _on_sigterm)
    code, together = 0, None
    try:
        code = int(main(argv) or 0)
    except UsageError as e:
        code = e.exit_code
        together = e.same_on_all_ranks
        rank = _rank_for_messages()
        if rank == 0 or not e.same_on_all_ranks:
            print_error(str(e), prog=prog, rank=rank if not e.same_on_all_ranks and rank else None)
        elif rank is not None:
            # rank 0 reports it; give it time to, since mpiexec/srun kill the job at the first exit
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(USAGE_ERROR_GRACE_S)
    except Terminated as e:
        code = int(e.code)
        print_error("terminated by SIGTERM; shutting down", prog=prog, rank=_rank_for_messages())
    except KeyboardInterrupt:
        code = 130
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print_error(e.code, prog=prog)
    except BaseException as e:
        code = 1
        rank = _rank_for_messages()
        peer = peer_failure_message(e)
        if peer is not None:  # one line per rank, not a wall of tracebacks
            lost = silent_ranks()
            if lost:
                peer = f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} stopped answering; " + peer
            print_error(peer, prog=prog, rank=rank)
            finish(code)
        tb = traceback.format_exc()
        prefix = f"[rank {rank}] " if rank is not None else ""
        sys.stderr.write("".join(f"{prefix}{line}\n" for line in tb.rstrip().splitlines()))
    finish(code, together=together)


_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "econnreset",
              "connection refused", "read error", "recv error", "socket closed", "no route to host")
_PEER_TIMEOUT = ("timed out", "timeout", "deadline exceeded")


def peer_failure_message(e: BaseException) -> str | None:
    """A one-line explanation when ``e`` is a collective failing because another rank died or
    stalled (gloo/NCCL/MPI errors), else None."""
    text = " ".join(str(e).split())
    low = text.lower()
    try:
        import torch.distributed as dist

        is_dist = isinstance(e, dist.DistError)
    except (ImportError, AttributeError):
        is_dist = False
    first = text[:200] + ("..." if len(text) > 200 else "")
    if any(k in low for k in _PEER_TIMEOUT) and (is_dist or "gloo" in low or "nccl" in low or "operation" in low):
        try:
            t = f"{_INFO.timeout_s if _INFO is not None else timeout_seconds(None):g} s"
        except UsageError:
            t = "see MMM_TIMEOUT"
        return (f"no answer from another rank within the collective timeout ({t}; set it with --timeout or "
                f"MMM_TIMEOUT): a rank stalled or died; the launcher's message names it ({first})")
    if any(k in low for k in _PEER_LOST) or is_dist:
        return (f"lost contact with another rank during a collective: a rank died or was killed; the launcher's "
                f"message names it ({first})")
    return None


def silent_ranks(wait_s: float = 3.0) -> list[int] | None:
    """After a failed collective: the ranks that do not check in through the rendezvous store within
    ``wait_s`` (the dead or stalled ones), or None when that cannot be known (the store lived on
    the lost rank, or there is no process group)."""
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=wait_s))
        rank, world = dist.get_rank(), dist.get_world_size()
        store.set(f"mmm/alive/{rank}", "1")
        deadline = time.monotonic() + wait_s
        while True:
            missing = [r for r in range(world) if not store.check([f"mmm/alive/{r}"])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.1)
    except Exception:
        return None


def _rank_for_messages() -> int | None:
    if _INFO is not None:
        return _INFO.rank
    try:
        return discover_ranks(use_mpi4py=False).rank
    except Exception:
        return None


def finish(code: int = 0, *, together: bool | None = None) -> NoReturn:
    """Tear down, flush, and leave the process with ``code`` (skipping interpreter shutdown).
    ``together``: every rank is leaving the same way (success, or a usage error all ranks saw)."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        teardown(ok=code == 0, finalize_mpi=code == 0 if together is None else together)
    except BaseException as e:  # never let teardown turn a result into a hang or abort
        print_error(f"teardown: {_first_line(e)}")
        code = code or 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` on every rank (an explicit collective, for end-of-run reports)."""
    import torch.distributed as tdist

    if not tdist.is_initialized() or tdist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, obj)
    return out
