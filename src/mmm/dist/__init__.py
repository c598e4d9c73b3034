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
- ``MMM_STACK_DIR``: folder for each rank's Python stacks (``rank-<r>.txt``), written when a
  collective fails and on ``SIGUSR1`` (the trainers use ``<outdir>/stacks``).

Split by concern: :mod:`~mmm.dist.ranks` (who am I), :mod:`~mmm.dist.rendezvous` (where ranks
meet), :mod:`~mmm.dist.device` (device, backend, timeout), :mod:`~mmm.dist.state` (setup, seeds,
teardown), :mod:`~mmm.dist.exits` (signals, run_main, exit codes), :mod:`~mmm.dist.liveness`
(roll call of live ranks after a failure, stack files). Everything public is here too.
"""

from __future__ import annotations

from mmm.dist.device import (  # noqa: F401
    DEFAULT_TIMEOUT_S,
    DEVICE_CHOICES,
    pick_backend,
    pick_device,
    return_freed_host_memory,
    timeout_seconds,
)
from mmm.dist.exits import (  # noqa: F401
    USAGE_ERROR_GRACE_S,
    RankZeroFailed,
    Terminated,
    all_ok,
    finish,
    gather_objects,
    graceful_sigterm,
    on_rank0,
    peer_failure_message,
    run_main,
    stop_flag,
    uninterrupted,
)
from mmm.dist.liveness import dump_stacks, set_stack_dir, silent_ranks, stack_dir  # noqa: F401
from mmm.dist.ranks import RankInfo, discover_ranks, expand_nodelist, parse_tasks_per_node, without_launcher_vars  # noqa: F401
from mmm.dist.rendezvous import derived_port, free_port, rendezvous  # noqa: F401
from mmm.dist.state import (  # noqa: F401
    DATA_SEED_STRIDE,
    DistInfo,
    banner,
    current,
    data_generator,
    data_seed,
    hold_to_timeout,
    info,
    launch_time,
    process_groups,
    seed_all,
    setup,
    teardown,
)
