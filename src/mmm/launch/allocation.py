"""The allocation: which scheduler (PBS, Slurm or none), its hosts, slots and accelerators per host."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mmm import env as mmm_env
from mmm.dist.ranks import expand_nodelist
from mmm.launch.hosts import read_hostfile


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
    forced = mmm_env.get("MMM_GPUS_PER_NODE", env=env)
    if forced is not None:
        return forced
    for var in ("CUDA_VISIBLE_DEVICES", "ZE_AFFINITY_MASK"):
        if var in env:
            return len([d for d in env[var].split(",") if d.strip() and d.strip() != "-1"])
    return len([p for p in Path("/dev").glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)])


def detect_allocation(env: Mapping[str, str] | None = None, hostfile: str | None = None) -> Allocation:
    """PBS (``PBS_NODEFILE``), else Slurm (``SLURM_JOB_ID``), else no scheduler; ``hostfile`` replaces
    the scheduler's host list."""
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
            tpn = mmm_env.get("SLURM_NTASKS_PER_NODE", env=env) or mmm_env.get("SLURM_TASKS_PER_NODE", env=env)
            if tpn:
                per = max(tpn)
        return Allocation("slurm", hosts, per, accel, hostfile, env.get("SLURM_JOB_ID"))
    if hostfile:
        hosts, slots = read_hostfile(hostfile)
        return Allocation("none", hosts, max(slots), accel, hostfile)
    return Allocation("none", [socket.gethostname()], None, accel)
