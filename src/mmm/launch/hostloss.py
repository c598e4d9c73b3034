"""After a failed attempt on several hosts: which hosts still answer (``--drop-lost-hosts``).

Each host of the plan is asked to run ``true`` through the job's own launcher (one rank, that host
alone: ``mpiexec`` with a one-line hostfile, ``srun --nodelist``), all at once, each within
``PROBE_TIMEOUT_S``. A host whose probe fails or does not return is lost. The relaunch then runs on
the hosts that remain with the same ranks per host: only the data-parallel degree of the trainer's mesh
shrinks (its tp, pp and cp are flags and stay), the global batch stays, and a trainer with
``--checkpoint-dir`` resumes its latest checkpoint on the new mesh.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mmm.errors import UsageError
from mmm.launch import tempdirs
from mmm.launch.mpi import FLAVORS
from mmm.launch.plan import LaunchPlan
from mmm.launch.supervision import session_folder

PROBE_TIMEOUT_S = 30.0
PROBES_AT_ONCE = 64


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
    ``true`` on the hosts a file names). Up to ``PROBES_AT_ONCE`` probes run at a time, each in a
    process group of its own (a probe that times out is killed with whatever it started); order as in
    the plan."""
    hosts = plan_hosts(plan)
    children: list[subprocess.Popen] = []
    stopping = threading.Event()  # Ctrl-C: a probe starting or waiting in its thread stops at once too
    with tempfile.TemporaryDirectory(prefix=tempdirs.prefix("probe")) as folder:

        def answers(host: str) -> bool:
            if stopping.is_set():
                return False
            hostfile = write_hostfile(plan, Path(folder), [host], 1, name=f"probe-{host}")
            errors = Path(folder) / f"probe-{host}.err"
            try:
                p = probe_plan(str(hostfile), env)
                probe_env = {**env, **p.env}
                # (prterun's session files in a folder of the probe's own, as an attempt's)
                probe_env |= session_folder(p.supervision, p.argv, probe_env, folder)
                with open(errors, "wb") as err:
                    child = subprocess.Popen(
                        p.argv,
                        env=probe_env,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=err,
                        start_new_session=True,
                    )
                children.append(child)
            except (OSError, UsageError):
                return False
            deadline = time.monotonic() + timeout_s
            while not stopping.is_set():
                try:
                    return child.wait(timeout=max(0.0, min(0.2, deadline - time.monotonic()))) == 0
                except subprocess.TimeoutExpired:
                    if time.monotonic() >= deadline:
                        break
            _stop(child)  # timed out, or Ctrl-C
            if stopping.is_set():
                return False
            # held up by the scheduler, not by the host: the scheduler vouches for it (srun: "Requested
            # nodes are busy", "step creation temporarily disabled"); the relaunch will wait as this did
            said = errors.read_text(errors="replace").lower() if errors.exists() else ""
            return any(words in said for words in BUSY)

        pool = ThreadPoolExecutor(max_workers=min(PROBES_AT_ONCE, max(1, len(hosts))))
        try:
            answered = dict(zip(hosts, pool.map(answers, hosts)))
        except KeyboardInterrupt:  # Ctrl-C while probing: stop every probe now, then leave as asked
            stopping.set()
            for child in children:
                _stop(child)
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    return [h for h in hosts if not answered[h]]


BUSY = ("nodes are busy", "temporarily disabled", "resources are busy")


def _stop(child: subprocess.Popen) -> None:
    """A probe and whatever it started (its own process group), killed and reaped."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except OSError:
        pass
    child.wait()


def plan_hosts(plan: LaunchPlan) -> list[str]:
    """The hosts a plan runs on (as many as its ranks need, in the allocation's order)."""
    nodes = -(-plan.nproc // plan.ppn)
    return list(plan.allocation.hosts[:nodes])
