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

One concern a module: ``hosts`` (host files), ``allocation`` (scheduler, hosts, accelerators), ``mpi``
(finding ``mpiexec``; its flavours' flags as a table), ``plan`` (the command), ``spawn`` (the local
spawner), ``watch`` (which rank died first), ``signals`` (forwarding, escalation), ``supervision`` (each
launcher's habits that launch works around, as data), ``output`` (mpiexec's stderr), ``run`` (an attempt,
retries) and ``cli``.
"""

from __future__ import annotations

from mmm.dist.ranks import expand_nodelist
from mmm.launch.allocation import Allocation, count_accelerators, detect_allocation
from mmm.launch.cli import build_parser, main
from mmm.launch.hosts import read_hostfile
from mmm.launch.mpi import FLAVORS, MPI_FLAVORS, Flavor, find_mpiexec, mpi_flavor, mpiexec_flags
from mmm.launch.plan import LAUNCHERS, LaunchPlan, plan_launch
from mmm.launch.run import NOT_RETRIED, run_attempt, run_with_retries
from mmm.launch.spawn import spawn_local
from mmm.launch.watch import RankWatch

__all__ = [
    "FLAVORS",
    "LAUNCHERS",
    "MPI_FLAVORS",
    "NOT_RETRIED",
    "Allocation",
    "Flavor",
    "LaunchPlan",
    "RankWatch",
    "build_parser",
    "count_accelerators",
    "detect_allocation",
    "expand_nodelist",
    "find_mpiexec",
    "main",
    "mpi_flavor",
    "mpiexec_flags",
    "plan_launch",
    "read_hostfile",
    "run_attempt",
    "run_with_retries",
    "spawn_local",
]
