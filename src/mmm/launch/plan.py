"""The launch plan: which launcher, how many ranks where, the full command and the variables it sets."""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mmm import env as mmm_env
from mmm.dist.rendezvous import free_port
from mmm.errors import UsageError
from mmm.launch.allocation import Allocation, detect_allocation
from mmm.launch.hosts import is_this_host
from mmm.launch.mpi import FLAVORS, find_mpiexec, mpi_flavor, mpiexec_flags, venv_mpiexec
from mmm.launch.supervision import SRUN, Supervision

LAUNCHERS = ("auto", "mpiexec", "srun", "local")
LOCAL_CPU_RANKS = 4
FORWARDED_ENV = (  # passed on to every rank by an MPI launcher, when set
    "MASTER_ADDR",
    "MASTER_PORT",
    "MMM_LAUNCH_TIME",
    "OMP_NUM_THREADS",
    "MMM_LAUNCHER",
    "MMM_RUN_STAMP",
    "MMM_RUN_ID",
    "MMM_RESTART",
    "MMM_DROPPED_HOSTS",
)


@dataclass
class LaunchPlan:
    launcher: str  # "mpiexec", "srun" or "local"
    argv: list[str]  # the full command for mpiexec/srun; the per-rank command for local
    nproc: int
    ppn: int
    allocation: Allocation
    env: dict[str, str] = field(default_factory=dict)  # added to the environment
    mpi_flavor: str | None = None

    @property
    def supervision(self) -> Supervision | None:
        """What launch does for this plan's launcher as its child (None: the local spawner, launch's own)."""
        if self.launcher == "srun":
            return SRUN
        flavor = FLAVORS.get(self.mpi_flavor or "") if self.launcher == "mpiexec" else None
        return flavor.supervision if flavor is not None else None

    def describe(self) -> str:
        a = self.allocation
        where = (
            f"{a.num_hosts} host{'s' if a.num_hosts != 1 else ''}"
            if a.scheduler != "none" or a.hostfile
            else "this machine"
        )
        how = self.mpi_flavor or ""
        if self.launcher == "mpiexec" and os.path.isabs(self.argv[0]) and self.argv[0] != venv_mpiexec():  # which
            how = f"{how}: {self.argv[0]}"
        return (
            f"{self.nproc} ranks ({self.ppn} per host) on {where} via {self.launcher}"
            f"{f' ({how})' if how else ''}; scheduler: {a.scheduler}"
        )

    def command_line(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        cmd = shlex.join(self.argv)
        if self.launcher == "local":
            cmd = f"<{self.nproc} ranks, RANK=0..{self.nproc - 1}> {cmd}"
        return f"{env} {cmd}" if env else cmd


def _resolve_python(cmd: list[str]) -> list[str]:
    """A bare ``python``/``python3`` means this environment's interpreter, on every rank."""
    if cmd and cmd[0] in {"python", "python3"}:
        return [sys.executable, *cmd[1:]]
    return cmd


def _check_program(program: str, env: Mapping[str, str]) -> None:
    """Refuses a command no rank could start, before any launcher runs (mpiexec would say it in a box of
    its own, exit 66, and ``--retries`` would relaunch it). Judged on this host: the ranks' hosts share
    its file system on the clusters mmm knows."""
    if program in {"python", "python3"}:
        return  # this environment's interpreter (_resolve_python)
    if "/" in program:
        if not os.path.isabs(program) and not os.path.exists(program):
            return  # relative to the ranks' working folder, which the launcher's options may change
        if os.path.isdir(program):
            raise UsageError(f"cannot start {program!r}: it is a folder, not a program")
        if not os.path.isfile(program):
            raise UsageError(f"cannot start {program!r}: no such file")
        if not os.access(program, os.X_OK):
            raise UsageError(f"cannot start {program!r}: not executable (chmod +x it, or run it with its interpreter)")
    elif shutil.which(program, path=env.get("PATH")) is None:
        raise UsageError(f"cannot start {program!r}: not found on PATH; check its spelling, or give its path")


# launchers of their own: under launch each rank would start ranks of its own, in a job of its own
_NESTED = {"torchrun", "mpiexec", "mpirun", "prterun", "orterun", "srun"}  # and their flavours: mpiexec.hydra
_NESTED_MODULES = {"torch.distributed.run", "torch.distributed.launch", "mmm.launch"}


def _nested_launcher(command: Sequence[str]) -> str | None:
    """The launcher ``command`` runs (``torchrun``, ``mpiexec.hydra``, ``python -u -m torch.distributed.run``...),
    None for a program."""
    name = os.path.basename(command[0])
    if name.split(".")[0] in _NESTED:
        return name
    if not name.startswith("python"):
        return None
    args = iter(command[1:])
    for arg in args:  # the interpreter's own options come before -m
        module = arg[2:] if arg.startswith("-m") and len(arg) > 2 else (next(args, "") if arg == "-m" else None)
        if module is not None:
            return f"{name} -m {module}" if module in _NESTED_MODULES else None
        if not arg.startswith("-") or arg in ("-c", "-"):
            return None  # a script, or code: the program itself
        if arg in ("-W", "-X"):
            next(args, None)  # (their value)
    return None


def new_run_id() -> str:
    """A launch's own id: its UTC time and 8 random hex digits."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(4)


def plan_launch(
    command: Sequence[str],
    *,
    nproc: int | None = None,
    ppn: int | None = None,
    hostfile: str | None = None,
    launcher: str = "auto",
    mpi_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    flavor: str | None = None,
    dry_run: bool = False,
    run_id: str | None = None,
) -> LaunchPlan:
    """How to start ``command`` on this allocation. ``dry_run``: only to print it, so a launcher
    missing from PATH (a login node, a module not loaded) is named as is, not refused. ``run_id``: this
    launch's ``MMM_RUN_ID`` (the same for all its attempts; a fresh one when None)."""
    env = os.environ if env is None else env
    if not command:
        raise UsageError("no command to launch; e.g. `launch -n 4 python3 -m mmm --tp 2`")
    nested = _nested_launcher(command)
    if nested:
        raise UsageError(
            f"{nested} is a launcher: launch starts the ranks itself, and each would start ranks of its own, in "
            f"jobs of their own; give launch the program (launch -n 4 python3 train.py), or run {nested} alone"
        )
    if not dry_run:
        _check_program(command[0], env)
    if launcher not in LAUNCHERS:
        raise UsageError(f"--launcher {launcher!r}; choose one of: {', '.join(LAUNCHERS)}")
    for name, value in (("-n/--nproc", nproc), ("--ppn", ppn)):
        if value is not None and value < 1:
            raise UsageError(f"{name} {value} must be >= 1")
    alloc = detect_allocation(env, hostfile)
    if launcher == "auto":
        launcher = {"pbs": "mpiexec", "slurm": "srun"}.get(alloc.scheduler) or (
            "mpiexec" if (venv_mpiexec() or alloc.hostfile) else "local"
        )
    if launcher == "local" and alloc.num_hosts > 1:
        raise UsageError(
            f"--launcher local runs on this machine only, but the allocation has {alloc.num_hosts} hosts; "
            "use --launcher mpiexec or srun"
        )
    if launcher == "local" and mpi_args:
        raise UsageError(
            f"--mpi-args {' '.join(mpi_args)!r} are flags for mpiexec or srun, and --launcher local starts the ranks "
            "itself; drop them or choose --launcher mpiexec/srun"
        )
    # a --hostfile given (a scheduler's node file names this node as the scheduler spells it: left alone)
    if launcher == "local" and hostfile and not all(is_this_host(h) for h in alloc.hosts):
        raise UsageError(
            f"--launcher local runs the ranks on this machine, but {alloc.hostfile} names "
            f"{', '.join(h for h in alloc.hosts if not is_this_host(h))}; use --launcher mpiexec, or drop the hostfile"
        )
    cpus = os.cpu_count() or 1
    on_this_machine = alloc.scheduler == "none" and not alloc.hostfile
    if on_this_machine and ppn is not None and nproc is not None and nproc > ppn:
        raise UsageError(
            f"--ppn {ppn} with -n {nproc}: this machine is one host (no allocation or --hostfile), so all {nproc} "
            f"ranks would run here; drop --ppn, or give -n {ppn}, or a --hostfile of more hosts"
        )
    if ppn is None:
        if on_this_machine and nproc is not None:
            ppn = nproc
        elif alloc.accelerators_per_host:
            ppn = alloc.accelerators_per_host
        elif alloc.slots_per_host and alloc.slots_per_host > 1:
            ppn = alloc.slots_per_host
        elif nproc is not None:
            ppn = -(-nproc // alloc.num_hosts)
        else:
            ppn = max(2, min(LOCAL_CPU_RANKS, cpus)) if on_this_machine else 1
    total = nproc if nproc is not None else ppn * alloc.num_hosts
    if not on_this_machine and total > ppn * alloc.num_hosts:
        raise UsageError(
            f"-n {total} needs more ranks than {alloc.num_hosts} host(s) x --ppn {ppn} = {ppn * alloc.num_hosts}; "
            f"lower -n or raise --ppn"
        )
    nodes = -(-total // ppn)
    hosts = alloc.hosts[:nodes]
    add_env: dict[str, str] = {}
    if not (mmm_env.is_set("MASTER_ADDR", env) and mmm_env.get("MASTER_PORT", env=env)):
        local = on_this_machine or nodes == 1 and is_this_host(hosts[0])
        if local or launcher != "srun":
            add_env["MASTER_ADDR"] = "127.0.0.1" if local else hosts[0]
        # else srun places rank 0 (on the step's first node, which need not be hosts[0]): each rank
        # reads rank 0's host from the step itself (mmm.dist.rendezvous)
        add_env["MASTER_PORT"] = str(free_port())
    per_task = str(mmm_env.get("SLURM_CPUS_PER_TASK", "", env=env)) if launcher == "srun" else ""
    if not env.get("OMP_NUM_THREADS"):
        add_env["OMP_NUM_THREADS"] = (
            per_task
            if per_task.isdigit()
            else str(max(1, cpus // ppn if not on_this_machine else cpus // max(total, 1)))
        )
    if mmm_env.get("MMM_LAUNCH_TIME", env=env) is None:  # an outer harness may have started the clock already
        add_env["MMM_LAUNCH_TIME"] = repr(time.time())
    add_env["MMM_LAUNCHER"] = f"launch/{launcher}"
    # which launch this is, never taken from the environment: a relaunch resumes only what its own job saved
    # (MMM_RUN_STAMP is kept when set, and may be exported across jobs)
    add_env["MMM_RUN_ID"] = run_id or new_run_id()
    if mmm_env.get("MMM_RUN_STAMP", env=env) is None:  # one default output folder for every rank and every attempt
        add_env["MMM_RUN_STAMP"] = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    cmd = _resolve_python(list(command))

    if launcher == "local":
        return LaunchPlan("local", cmd, total, ppn, alloc, add_env)
    if launcher == "srun":
        exe = shutil.which("srun") or ("srun" if dry_run else None)
        if exe is None:
            where = f"inside Slurm job {env['SLURM_JOB_ID']}, " if env.get("SLURM_JOB_ID") else ""
            raise UsageError(
                f"--launcher srun: no srun on PATH ({where}PATH={env.get('PATH', '')!r}); load Slurm "
                "(e.g. `module load slurm`) or choose --launcher mpiexec"
            )
        # a rank that dies takes the step down at once, instead of leaving the others blocked in a
        # collective until its timeout
        # since Slurm 22.05 srun does not inherit the job's --cpus-per-task: pass it on
        cpt = [f"--cpus-per-task={per_task}"] if per_task.isdigit() else []
        # --hostfile under Slurm: run on those hosts (Slurm still orders them: rank 0's host is the step's)
        where = [f"--nodelist={','.join(hosts)}"] if alloc.hostfile else []
        argv = [
            exe,
            f"--nodes={nodes}",
            *where,
            f"--ntasks={total}",
            f"--ntasks-per-node={ppn}",
            *cpt,
            "--export=ALL",
            "--kill-on-bad-exit=1",
            *mpi_args,
            *cmd,
        ]
        return LaunchPlan("srun", argv, total, ppn, alloc, add_env)
    try:
        exe = find_mpiexec()
    except UsageError:  # none of the flavour asked for here (a login node, a module not loaded)
        if not dry_run:
            raise
        exe = "mpiexec"  # named as is, as a missing srun is
    if exe is None and dry_run:
        exe = "mpiexec"
    if exe is None:
        raise UsageError(
            f"--launcher mpiexec: no mpiexec in {Path(sys.executable).parent} or on PATH; install MPI "
            "(pip install 'mmm[mpi]' puts Open MPI's mpiexec in the virtual environment) or use --launcher local"
        )
    flavor = flavor or mpi_flavor(exe)
    names = [*add_env, *(k for k in FORWARDED_ENV if k not in add_env and k in env)]
    flags = mpiexec_flags(
        flavor,
        nproc=total,
        ppn=ppn,
        hosts=hosts,
        hostfile=alloc.hostfile,
        one_host=on_this_machine,
        env={k: add_env.get(k, env.get(k, "")) for k in names},
        cpus=cpus,
    )
    return LaunchPlan("mpiexec", [exe, *flags, *mpi_args, *cmd], total, ppn, alloc, add_env, flavor)
