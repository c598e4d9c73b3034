"""Setup: the process group, this process's DistInfo, seeds and per-dp-rank data streams."""

from __future__ import annotations

import atexit
import datetime
import os
import platform
import random
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mmm import __version__, env, faults  # faults: MMM_FAULT's kind, checked with the others
from mmm.dist import liveness
from mmm.dist.device import DEFAULT_TIMEOUT_S, pick_backend, pick_device, return_freed_host_memory, timeout_seconds
from mmm.dist.ranks import RankInfo, discover_ranks
from mmm.dist.rendezvous import raise_open_file_limit, rendezvous, unknown_host
from mmm.errors import RunError, UsageError, first_line
from mmm.log import configure as configure_logging
from mmm.log import get_logger

if TYPE_CHECKING:  # pragma: no cover
    import torch


log = get_logger("dist")


# --------------------------------------------------------------------------- setup
def bind_device(dev) -> None:
    """Make ``dev`` this process's current device (cuda/xpu: before the process group, so that
    NCCL/XCCL bind to it). Backends without a current-device notion (cpu, mps) need nothing."""
    import torch

    module = getattr(torch, dev.type, None)
    if dev.type != "cpu" and hasattr(module, "set_device"):
        module.set_device(dev)


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


def current() -> DistInfo | None:
    """This process's DistInfo once :func:`setup` ran (None before, and after teardown)."""
    return _INFO


def info() -> DistInfo:
    """The :class:`DistInfo` from :func:`setup` (which it calls if nobody has yet)."""
    return _INFO if _INFO is not None else setup()


def hold_to_timeout(groups) -> None:
    """Give ``groups`` (made after :func:`setup`: a DeviceMesh's axes, ``new_group`` without a timeout) the
    job's collective timeout. torch starts each new group with its backend's default (30 min for gloo, 10
    for NCCL), not the timeout the default group was started with, so without this a collective stuck on
    a mesh axis (FSDP's, an expert all-to-all, a pipeline's send) would outlast ``--timeout`` by far."""
    import torch.distributed as dist

    di = info()
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None or di.backend in (None, "fake") or "init_process_group_s" not in di.timings:
        return  # a process group the program started itself keeps the timeouts it chose
    timeout = datetime.timedelta(seconds=di.timeout_s)
    for group in groups:
        if any(name in str(dist.get_backend(group)) for name in ("gloo", "nccl")):  # the two torch can set
            set_timeout(timeout, group)


def process_groups() -> list:
    """Every process group this process belongs to or has made, as torch's registry lists them (empty
    where this torch has none): with :func:`hold_to_timeout`, the groups a library made behind the
    program's back (DeepSpeed's clone of the world group) can be found and held too."""
    import torch.distributed as dist

    world = getattr(dist.distributed_c10d, "_world", None)
    return list(getattr(world, "pg_map", {}) or {})


def banner(di: DistInfo | None = None) -> str:
    """One line on where this job runs: launcher, ranks, nodes, device, backend, versions."""
    import torch

    di = di or info()
    mpi = f" mpi4py={sys.modules['mpi4py'].__version__}" if "mpi4py" in sys.modules else ""
    return (
        f"mmm {__version__} | launcher={di.launcher} world={di.world_size} nodes={di.num_nodes} "
        f"local_world={di.local_world_size} | device={di.device} backend={di.backend} | "
        f"python={platform.python_version()} torch={torch.__version__}{mpi}"
    )


def launch_time() -> float | None:
    """Wall-clock time ``launch`` started (``MMM_LAUNCH_TIME``), if launched by it."""
    return env.get("MMM_LAUNCH_TIME")


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
    env.check()  # every mmm variable's value, before any work (one read late would fail a finished run)
    ranks = discover_ranks()
    if far := faults.unreachable(ranks.world_size):
        raise UsageError(far[0])
    liveness.record_pid(ranks.rank, ranks.local_world_size)
    configure_logging(rank=ranks.rank, world_size=ranks.world_size, all_ranks=all_ranks_log)
    timeout_s = timeout_seconds(timeout)
    t_import = time.perf_counter()
    import torch  # noqa: F401  (timed: the first import of torch is part of startup)
    import torch.distributed as dist

    timings = {"import_torch_s": time.perf_counter() - t_import}
    dev = pick_device(ranks.local_rank, device)
    bind_device(dev)
    if dev.type == "cpu" and env.get("MMM_HOST_MALLOC") == "return":  # see the function
        return_freed_host_memory()
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
    launcher = env.get("MMM_LAUNCHER") or ranks.source
    _INFO = DistInfo(
        rank=ranks.rank,
        world_size=ranks.world_size,
        local_rank=ranks.local_rank,
        local_world_size=ranks.local_world_size,
        num_nodes=ranks.num_nodes,
        launcher=launcher,
        device=dev,
        backend=backend,
        timeout_s=timeout_s,
        seed=seed,
        timings=timings,
    )
    timings["setup_s"] = time.perf_counter() - t0
    if backend not in (None, "fake") and ranks.world_size > 1:  # "fake": one simulated rank (mmm.plan)
        if env.is_set("MMM_STACK_DIR"):
            liveness.set_stack_dir(env.get("MMM_STACK_DIR"), ranks.rank)
        liveness.start_watcher(ranks.rank)
        liveness.leave_when_orphaned(ranks.rank, grace_s=timeout_s)
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
    raise_open_file_limit(ranks)
    addr, port = rendezvous(ranks)
    if unknown_host(addr):  # one line now, not torch's store retrying the name (a warning a second)
        given = env.get("MASTER_ADDR") == addr
        raise UsageError(
            f"{'MASTER_ADDR=' + addr if given else 'the rendezvous host ' + repr(addr)}: no such host (the name "
            "does not resolve here); "
            + (
                "set it to rank 0's host name or address, or start with `launch` (it sets it)"
                if given
                else "set MASTER_ADDR to rank 0's host name or address"
            ),
            same_on_all_ranks=False,
        )
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    try:
        dist.init_process_group(
            backend, init_method=f"tcp://{addr}:{port}", rank=ranks.rank, world_size=ranks.world_size, **kwargs
        )
    except (dist.DistStoreError, dist.DistNetworkError) as e:  # the rendezvous's store, not a backend's
        text = " ".join(str(e).split())
        if "timed out" not in text.lower():
            raise
        who = "rank 0 waited for the others" if ranks.rank == 0 else f"rank {ranks.rank} could not reach rank 0"
        raise RunError(
            f"the {ranks.world_size} ranks did not all meet at {addr}:{port} within {timeout_s:g} s (MMM_TIMEOUT, "
            f"or the trainers' --timeout): {who}; a rank did not start, a firewall is between them, or they were "
            f"given different MASTER_ADDR/MASTER_PORT (...{text[-200:]})",
            same_on_all_ranks=False,
        ) from None


def seed_all(seed: int) -> None:
    """Identical weight init on every rank: seed python, numpy (if loaded) and torch with ``seed``."""
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
        liveness.release_watcher()  # before anyone may leave: its store request must not outlive the host
        if ok and dist.get_world_size() > 1:
            try:
                dist.barrier()
            except Exception as e:  # a peer died after we finished: say so, still tear down
                log.warning("teardown barrier failed: %s", first_line(e))
        try:
            dist.destroy_process_group()
        except Exception as e:  # pragma: no cover
            log.warning("destroy_process_group failed: %s", first_line(e))
    liveness.close_stack_file()  # removes only an empty file: stacks written after a failure stay
    if "mpi4py.MPI" in sys.modules and (ok if finalize_mpi is None else finalize_mpi):
        MPI = sys.modules["mpi4py.MPI"]
        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    _INFO = None


def _atexit_teardown() -> None:
    # A program that forgot teardown(): destroy without a barrier (peers may have exited), after ending the
    # watcher, whose store request would otherwise outlive the store's host (an abort at exit, exit 134)
    liveness.record_exit("atexit")
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            liveness.release_watcher()
            dist.destroy_process_group()
    except Exception:
        pass
