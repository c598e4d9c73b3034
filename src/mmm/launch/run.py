"""Running a plan with launch as the parent: one attempt (signals passed on, the first rank to die named,
Open MPI's exit box dropped after a usage error), and relaunches after a failure (``--retries``)."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from mmm.dist.ranks import without_launcher_vars
from mmm.dist.rendezvous import free_port, unknown_host
from mmm.errors import DIVERGED_EXIT, UsageError, print_error
from mmm.launch import tempdirs
from mmm.launch.hostloss import lost_hosts, plan_hosts, write_hostfile
from mmm.launch.hosts import is_this_host
from mmm.launch.mpi import export_flags
from mmm.launch.output import ExitBoxFilter
from mmm.launch.plan import LaunchPlan
from mmm.launch.signals import _PASSED_ON, PROG, _ctrl_c_reached_the_child, _wait_forwarding
from mmm.launch.spawn import spawn_local
from mmm.launch.supervision import Supervision, placed_by_user, session_folder
from mmm.launch.watch import RankWatch

NOT_RETRIED = {
    0: "it succeeded",
    2: "bad input fails again",
    DIVERGED_EXIT: "the run stopped itself on a non-finite loss (a relaunch would replay it)",
    130: "interrupted (Ctrl-C)",
    143: "terminated (SIGTERM: preemption or the scheduler's limit)",
}


def stays_parent(plan: LaunchPlan) -> bool:
    """Whether launch runs the plan as its child rather than handing its process to the launcher: the
    local spawner always; a launcher whose ranks launch watches (Hydra's mpiexec), whose stopping signals it
    delivers itself (Open MPI's mpiexec, srun) or whose exit box it drops (Open MPI)."""
    sup = plan.supervision
    return plan.launcher == "local" or sup is not None and sup.stays_parent


def _watched(plan: LaunchPlan) -> bool:
    """Whether launch watches the plan's ranks (their process ids, through ``MMM_PID_DIR``)."""
    sup = plan.supervision
    return sup is not None and (sup.watch_ranks or bool(sup.stops_ranks_at_once)) and hasattr(os, "pidfd_open")


def added_at_run_time(plan: LaunchPlan, env: Mapping[str, str]) -> list[str]:
    """What each attempt adds to the plan's command (``--dry-run`` says so): the variables of launch's rank
    watch and the launcher's session folder, new for every attempt."""
    if plan.launcher == "local":
        return []
    out = []
    if _watched(plan):
        out.append("MMM_PID_DIR=<a new folder>")
        if any(not is_this_host(h) for h in plan_hosts(plan)):
            out.append("MMM_WATCH=<launch's host, port and token>")
        if plan.launcher == "mpiexec":
            out[-1] += " (exported to the ranks)"
    sup = plan.supervision
    if sup is not None and sup.session_folder_var and not placed_by_user(sup, plan.argv, env):
        out.append(f"{sup.session_folder_var}=<a new folder, removed after the run>")
    return out


def run_attempt(plan: LaunchPlan, env: Mapping[str, str], signalled: list[int]) -> int:
    """Run the plan once as a child (mpiexec/srun) or with the local spawner; its exit code.
    SIGINT/SIGTERM are forwarded to the child and recorded in ``signalled``. Under a Hydra ``mpiexec``
    launch watches the ranks of every host (:class:`RankWatch`) and names the one that died first; under Open
    MPI and srun it watches them to send SIGINT/SIGTERM to them itself (prterun would kill them at once, srun
    force the step's end), and drops Open MPI's exit box after a usage error or a stop (:class:`ExitBoxFilter`)."""
    if plan.launcher == "local":
        return spawn_local(plan.argv, plan.nproc, env, signalled=signalled)
    sup = plan.supervision
    watcher, argv = None, list(plan.argv)
    names_first = sup is not None and sup.watch_ranks  # else the launcher names a failed rank itself
    if _watched(plan):
        # each other host's first rank starts a watcher that reports here (launch's host may run none)
        several = any(not is_this_host(h) for h in plan_hosts(plan))
        watcher = RankWatch(tempdirs.make("pids"), plan.nproc, listen=several, hosts=plan_hosts(plan))
        watch_env = {"MMM_PID_DIR": str(watcher.folder), **({"MMM_WATCH": watcher.address} if several else {})}
        env = {**env, **watch_env}  # and exported to the other hosts' ranks (Open MPI passes only what it is told)
        if plan.launcher == "mpiexec":
            argv = [argv[0], *export_flags(plan.mpi_flavor or "", watch_env), *argv[1:]]  # srun: --export=ALL
    box = ExitBoxFilter(sup.exit_box) if sup is not None and sup.exit_box else None
    session = session_folder(sup, argv, env)
    env = {**env, **session}
    child: list[subprocess.Popen] = []
    rc: int | None = None
    in_foreground = _ctrl_c_reached_the_child()  # launch is the terminal's foreground job
    try:
        rc = _wait_forwarding(
            # a group of its own unless launch is a terminal's foreground job: there a typed Ctrl-C, the
            # terminal's input (rank 0's stdin) and job control stay the launcher's, as before
            lambda: _start_child(
                argv, env, watcher, box, child, own_group=sup is not None and sup.own_group and not in_foreground
            ),
            signalled,
            stuck=watcher.stuck if watcher is not None and names_first else None,
            relay=_relay(sup, watcher, child),
            instead={getattr(signal, a): getattr(signal, b) for a, b in sup.instead} if sup is not None else None,
        )
        if rc == 1 and signalled and sup is not None and sup.says_1_when_stopped:
            rc = 128 + signalled[0]  # prterun stopped the ranks itself (none had started): 130 or 143, as theirs
        return rc
    finally:
        if box is not None and child:
            box.finish(rc)
        if watcher is not None and watcher.ident is not None:
            watcher.done.set()
            watcher.join(timeout=2.0)
            if not watcher.is_alive():
                failed = names_first and child and child[0].returncode and not signalled
                named = watcher.first_silent() if failed else None
                shutil.rmtree(watcher.folder, ignore_errors=True)
                if named:
                    print_error(named, prog=PROG)
        if watcher is not None:
            watcher.close()
        for folder in session.values():
            shutil.rmtree(folder, ignore_errors=True)


def _relay(
    sup: Supervision | None, watcher: RankWatch | None, child: list[subprocess.Popen]
) -> tuple[set[int], Callable[[int], object]] | None:
    """The signals launch delivers to the ranks itself, through its rank watch (this host's ranks by process
    id, the others by their host's watcher), and how: those of launch's promise that this launcher does not
    pass on (Hydra's mpiexec dies of SIGUSR2), and the stopping signals it would answer by ending the ranks
    at once (Open MPI's prterun, srun: SIGINT, SIGTERM). A stopping signal also reaches the ranks noted later
    (still starting); before any rank has noted itself it goes to the launcher (nothing to save yet)."""
    if sup is None or watcher is None:
        return None
    missing = {getattr(signal, name) for name in _PASSED_ON if name not in sup.passes_on and hasattr(signal, name)}
    stops = {getattr(signal, name) for name in sup.stops_ranks_at_once if hasattr(signal, name)}
    if not missing | stops:
        return None

    def deliver(signum: int) -> None:
        if watcher.signal_ranks(signum, later=signum in stops) or signum not in stops:
            return
        if signum == signal.SIGINT and child and _ctrl_c_reached_the_child(child[0].pid):
            return  # a Ctrl-C typed at the terminal: the launcher has it already (a second would abort it)
        if child and child[0].poll() is None:  # no rank noted yet: the launcher stops them
            child[0].send_signal(signum)

    return missing | stops, deliver


def _start_child(
    argv: Sequence[str],
    env: Mapping[str, str],
    watcher: RankWatch | None,
    box: ExitBoxFilter | None,
    started: list[subprocess.Popen],
    *,
    own_group: bool = False,
) -> subprocess.Popen:
    try:
        p = subprocess.Popen(
            list(argv),
            env=dict(env),
            stderr=subprocess.PIPE if box is not None else None,
            preexec_fn=_own_group_ending_with(os.getpid()) if own_group else None,
        )
    except OSError as e:
        if watcher is not None:
            shutil.rmtree(watcher.folder, ignore_errors=True)
        raise UsageError(f"cannot run {argv[0]!r}: {e.strerror}") from None
    started.append(p)
    if box is not None:
        box.start(p.stderr)
    if watcher is not None:
        watcher.start()
    return p


def _own_group_ending_with(parent: int) -> Callable[[], None]:
    """What the child runs before its program: a process group of its own, and (Linux) SIGTERM when ``parent``
    (launch) dies, so that the launcher is never left running the ranks without launch. The child does as
    little as it can between fork and exec: two system calls (``prctl`` is looked up before the fork)."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None  # before the fork

    def child() -> None:
        os.setpgid(0, 0)
        if prctl is not None:
            prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # launch died before that took effect
                os._exit(143)

    return child


Replan = Callable[..., LaunchPlan]  # (env, *, hostfile=None, nproc=None) -> the plan of an attempt


def run_with_retries(
    replan: Replan,
    first: LaunchPlan,
    retries: int,
    *,
    quiet: bool = False,
    probe: Callable[[str, Mapping[str, str]], LaunchPlan] | None = None,
    drop: bool = False,
) -> int:
    """Run the job; when it fails, run it again (at most ``retries`` more times) in the same allocation.
    Every attempt gets ``MMM_RESTART=<attempt>`` and the first attempt's output stamp; when launch chose
    the rendezvous port, each relaunch gets a fresh one. ``replan`` rebuilds the command for an
    environment (MPI launchers carry variables on their command line). A trainer with
    ``--checkpoint-dir`` resumes from its latest checkpoint on a restart. Not retried: success, bad
    input (2), Ctrl-C (130), SIGTERM (143), and a signal sent to launch itself.

    With ``probe`` (plans one rank of ``true`` on a hostfile's hosts), a failed attempt on several hosts
    is followed by a probe of each, and the hosts that do not answer are named. With ``drop``
    (``--drop-lost-hosts``) the relaunch runs on the hosts that answer (same ranks per host, fewer
    ranks), ``MMM_DROPPED_HOSTS`` naming the others."""
    fresh_port = "MASTER_PORT" in first.env
    chose_addr = "MASTER_ADDR" in first.env
    base = {**os.environ, **first.env}
    folder = tempdirs.make("hosts") if drop else None
    try:
        return _attempts(replan, retries, quiet, probe, drop, folder, fresh_port, chose_addr, base)
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)  # launch's own hostfiles


CHECK_TIMEOUT_S = 120.0
TRAINERS = ("mmm.examples.", "mmm.training.trainer")  # commands that answer MMM_CHECK_WORLD


def trainer_refuses(argv: Sequence[str], world: int, env: Mapping[str, str]) -> str | None:
    """Whether the mmm trainer ``argv`` runs (its module after ``-m``) would refuse ``world`` ranks (a global
    batch the new data-parallel degree does not divide, an explicit ``--dp-shard``...): the trainer is run
    once here with ``MMM_CHECK_WORLD=<world>``, which parses and checks its flags and starts nothing. Its
    one line when it refuses; None when it fits, or when the command is not an mmm trainer (not run), or the
    check could not tell."""
    argv = list(argv)
    module = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-m"), "")
    if not module.startswith(TRAINERS):
        return None
    start = argv.index("-m") - 1  # the python that runs it (after mpiexec's or srun's own flags)
    try:
        res = subprocess.run(
            argv[start:],
            env={**without_launcher_vars(env), "MMM_CHECK_WORLD": str(world)},
            capture_output=True,
            text=True,
            timeout=CHECK_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if res.returncode != 2:
        return None
    lines = [ln.split("error: ", 1)[1] for ln in res.stderr.splitlines() if "error: " in ln]
    return lines[0] if lines else "it exits 2"


def find_lost_hosts(
    plan: LaunchPlan,
    env: Mapping[str, str],
    probe: Callable[[str, Mapping[str, str]], LaunchPlan] | None,
    code: int,
    signalled: Sequence[int],
) -> list[str]:
    """After a failed attempt on several hosts (not bad input, not a signal to launch): the hosts that
    no longer run a probe through the job's launcher (:func:`lost_hosts`)."""
    if probe is None or signalled or code in NOT_RETRIED or plan.launcher == "local" or len(plan_hosts(plan)) < 2:
        return []
    return lost_hosts(plan, env, probe)


def lost_hosts_message(lost: Sequence[str], *, retries: bool) -> str:
    """Why the job ended: hosts whose names do not resolve (a typo in the hostfile, more likely than a host
    lost), else the hosts that stopped answering."""
    unknown = [h for h in lost if unknown_host(h)]
    lost = [h for h in lost if h not in unknown]
    said = []
    if unknown:
        s = "s" if len(unknown) > 1 else ""
        said.append(
            f"host{s} {', '.join(unknown)}: no such host (the name does not resolve here; a typo in the hostfile "
            "or host list?): fix or drop it"
        )
    if lost:
        s = "s" if len(lost) > 1 else ""
        fix = "launch --retries N --drop-lost-hosts" if not retries else "--drop-lost-hosts"
        said.append(
            f"host{s} {', '.join(lost)} did not answer after the failure: lost (crashed, powered off or cut off "
            f"from the others), which ended the job; {fix} relaunches on the hosts that remain"
        )
    return "; ".join(said)


def _attempts(replan, retries, quiet, probe, drop, folder, fresh_port, chose_addr, base) -> int:
    attempt = 0
    where: dict[str, object] = {}  # hostfile and nproc of the hosts that remain, once one is lost
    dropped: list[str] = []
    while True:
        env = {**base, "MMM_RESTART": str(attempt)}
        if attempt:
            env["MMM_LAUNCH_TIME"] = repr(time.time())  # startup of this attempt
            if fresh_port:
                env["MASTER_PORT"] = str(free_port())
            if chose_addr and where:
                env.pop("MASTER_ADDR", None)  # the first host may be the lost one: plan it again
        plan = replan(env, **where)
        signalled: list[int] = []
        code = run_attempt(plan, {**env, **plan.env}, signalled)
        why = "launch itself was signalled" if signalled else NOT_RETRIED.get(code)
        lost = find_lost_hosts(plan, env, probe, code, signalled) if why is None else []
        if lost and (not drop or attempt >= retries):
            print_error(lost_hosts_message(lost, retries=retries > 0), prog=PROG)
        if why is not None or attempt >= retries:
            if code and attempt and not quiet:
                print_error(
                    f"attempt {attempt + 1} of {retries + 1} failed with exit code {code}; "
                    f"{'giving up' if why is None else f'not retried: {why}'}",
                    prog=PROG,
                )
            return code
        attempt += 1
        if drop and folder is not None:
            if lost:
                alive = [h for h in plan_hosts(plan) if h not in lost]
                dropped += lost
                base["MMM_DROPPED_HOSTS"] = ",".join(dropped)
                if not alive:
                    print_error(f"no host answered after the failure ({', '.join(lost)}); giving up", prog=PROG)
                    return code
                refused = trainer_refuses(plan.argv, plan.ppn * len(alive), base)
                if refused is not None:
                    print_error(
                        f"host{'s' if len(lost) > 1 else ''} {', '.join(lost)} did not answer after the failure; "
                        f"not relaunched on the {len(alive)} host(s) left ({plan.ppn * len(alive)} ranks): the "
                        f"trainer refuses them: {refused}",
                        prog=PROG,
                    )
                    return code
                where = {
                    "hostfile": str(write_hostfile(plan, Path(folder), alive, plan.ppn)),
                    "nproc": plan.ppn * len(alive),
                }
                print_error(
                    f"host{'s' if len(lost) > 1 else ''} {', '.join(lost)} did not answer after the failure: "
                    f"relaunching on {', '.join(alive)} ({plan.ppn * len(alive)} ranks, {plan.ppn} per host; "
                    "the trainer's data-parallel degree shrinks, its global batch stays)",
                    prog=PROG,
                )
        if not quiet:
            print_error(
                f"attempt {attempt} of {retries + 1} failed with exit code {code}; relaunching "
                f"(MMM_RESTART={attempt}{', fresh rendezvous port' if fresh_port else ''})",
                prog=PROG,
            )
