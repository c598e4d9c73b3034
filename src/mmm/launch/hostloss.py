"""After a failed attempt on several hosts: which hosts still answer (``--drop-lost-hosts``).

Each host of the plan is asked to run ``true`` through the job's own launcher (one rank, that host
alone: ``mpiexec`` with a one-line hostfile, ``srun --nodelist``), all at once, each within
``PROBE_TIMEOUT_S``. A host whose probe fails or does not return is lost. The relaunch then runs on
the hosts that remain with the same ranks per host: only the data-parallel degree of the trainer's mesh
shrinks (its tp, pp and cp are flags and stay), the global batch stays, and a trainer with
``--checkpoint-dir`` resumes its latest checkpoint on the new mesh.
"""

from __future__ import annotations

import subprocess
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from mmm.errors import UsageError
from mmm.launch.mpi import FLAVORS
from mmm.launch.plan import LaunchPlan

PROBE_TIMEOUT_S = 30.0


def write_hostfile(
    plan: LaunchPlan, folder: Path, hosts: Sequence[str], slots: int, *, name: str | None = None
) -> Path:
    """A hostfile in the syntax of the plan's launcher (Open MPI's ``host slots=N``, Hydra's ``host:N``...)."""
    flavor = FLAVORS.get(plan.mpi_flavor or "") if plan.launcher == "mpiexec" else None
    line = flavor.hostfile_line if flavor is not None else "{host} slots={slots}"
    path = folder / (name or f"hosts-{len(hosts)}")
    path.write_text("".join(line.format(host=h, slots=slots) + "\n" for h in hosts))
    return path


def lost_hosts(
    plan: LaunchPlan,
    env: Mapping[str, str],
    probe_plan: Callable[[str, Mapping[str, str]], LaunchPlan],
    *,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> list[str]:
    """The hosts of ``plan`` that do not run a probe (``probe_plan(hostfile, env)`` plans one rank of
    ``true`` on the hosts a file names). Probes run in parallel; order as in the plan."""
    hosts = plan_hosts(plan)
    answered: dict[str, bool] = {}
    with tempfile.TemporaryDirectory(prefix="mmm-probe-") as folder:

        def probe(host: str) -> None:
            hostfile = write_hostfile(plan, Path(folder), [host], 1, name=f"probe-{host}")
            try:
                p = probe_plan(str(hostfile), env)
                done = subprocess.run(
                    p.argv, env={**env, **p.env}, capture_output=True, timeout=timeout_s, stdin=subprocess.DEVNULL
                )
                answered[host] = done.returncode == 0
            except (subprocess.TimeoutExpired, OSError, UsageError):
                answered[host] = False

        threads = [threading.Thread(target=probe, args=(h,), daemon=True) for h in hosts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s + 5)
    return [h for h in hosts if not answered.get(h, False)]


def plan_hosts(plan: LaunchPlan) -> list[str]:
    """The hosts a plan runs on (as many as its ranks need, in the allocation's order)."""
    nodes = -(-plan.nproc // plan.ppn)
    return list(plan.allocation.hosts[:nodes])
