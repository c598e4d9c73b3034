"""``launch``'s command line: flags, the plan, and then run it (or hand the process to the launcher)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

from mmm import env as mmm_env
from mmm import faults  # noqa: F401  (declares MMM_FAULT's and MMM_SAVE_FAULT's kinds: checked here too)
from mmm.cli import nonempty_text, nonnegative_int, positive_int, shell_words
from mmm.errors import ArgumentParser, UsageError, print_error
from mmm.launch import tempdirs
from mmm.launch.hostloss import plan_hosts
from mmm.launch.plan import LAUNCHERS, LaunchPlan, new_run_id, plan_launch
from mmm.launch.run import (
    added_at_run_time,
    find_lost_hosts,
    lost_hosts_message,
    run_attempt,
    run_with_retries,
    stays_parent,
)
from mmm.launch.signals import PROG, _unignore_stop_signals


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog=PROG,
        description="Run a command on every rank of this allocation (PBS, Slurm) or on this machine.",
        epilog="examples:\n"
        "  launch -n 4 python3 -m mmm --tp 2\n"
        "  launch python3 -m mmm.examples.fsdp_tp --tpsize 2   # inside a PBS/Slurm job\n"
        "  launch --dry-run --ppn 4 python3 train.py\n\n"
        "Environment: MMM_GPUS_PER_NODE (ranks per host default), MMM_MPI_FLAVOR (openmpi|hydra|pals).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "-n",
        "--nproc",
        "--np",
        dest="nproc",
        type=positive_int,
        default=None,
        metavar="N",
        help="total ranks (default: hosts x ranks per host)",
    )
    p.add_argument(
        "--ppn",
        type=positive_int,
        default=None,
        metavar="N",
        help="ranks per host (default: accelerators per host, else scheduler slots, else up to 4 CPU ranks)",
    )
    p.add_argument(
        "--hostfile",
        type=nonempty_text,
        default=None,
        metavar="FILE",
        help="hosts to use instead of the scheduler's (one per line; 'host slots=N' or 'host:N')",
    )
    p.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="auto",
        help="auto: mpiexec under PBS (the first on PATH, else this environment's), srun under Slurm, else "
        "mpiexec if this environment has one, else local",
    )
    p.add_argument(
        "--mpi-args",
        type=shell_words,
        default=[],
        metavar="ARGS",
        help='extra launcher flags, one quoted string (e.g. "--cpu-bind depth -d 8"; one flag alone after '
        "'=': --mpi-args=--oversubscribe)",
    )
    p.add_argument(
        "--retries",
        type=nonnegative_int,
        default=0,
        metavar="N",
        help="relaunch a failed job up to N times in the same allocation (fresh rendezvous port, "
        "MMM_RESTART=<attempt>); trainers with --checkpoint-dir resume from their latest "
        "checkpoint. Bad input (exit 2), Ctrl-C and SIGTERM are not retried [0]",
    )
    p.add_argument(
        "--drop-lost-hosts",
        action="store_true",
        help="with --retries, on several hosts: after a failure, ask each host to run `true` through the "
        "launcher; relaunch on the hosts that answer (same ranks per host: the trainer's data-parallel degree "
        "shrinks, tp/pp/cp and the global batch stay; MMM_DROPPED_HOSTS names the others)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the command and exit")
    p.add_argument("-q", "--quiet", action="store_true", help="do not print the launch line")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``launch``: its exit code (the job's, 2 for bad input, 130 for a Ctrl-C outside the job)."""
    _unignore_stop_signals()  # first: a Ctrl-C must reach the handling below even in a background job
    try:
        return _main(argv)
    except KeyboardInterrupt:  # between attempts, or while probing hosts: every probe already stopped
        print_error("interrupted (Ctrl-C); nothing is left running", prog=PROG)
        return 130
    except BrokenPipeError:  # `launch --dry-run | head -1`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 0


def _main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        mmm_env.check()  # the values every rank would refuse, refused here before any starts
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        run_id = new_run_id()
        plan = plan_launch(
            command,
            run_id=run_id,
            nproc=args.nproc,
            ppn=args.ppn,
            hostfile=args.hostfile,
            launcher=args.launcher,
            mpi_args=args.mpi_args,
            dry_run=args.dry_run,
        )
        if args.retries < 0:
            raise UsageError(f"--retries {args.retries} must be >= 0 (the number of relaunches after a failure)")
        if args.drop_lost_hosts and not args.retries:
            raise UsageError("--drop-lost-hosts acts on a relaunch: add --retries N")
        if args.drop_lost_hosts and (plan.launcher == "local" or len(plan_hosts(plan)) < 2):
            raise UsageError(
                f"--drop-lost-hosts needs a job on several hosts; this one runs on {', '.join(plan_hosts(plan))} "
                f"only (via {plan.launcher})"
            )
    except UsageError as e:
        print_error(str(e), prog=PROG)
        return 2
    if args.dry_run:
        print(f"# {plan.describe()}")
        added = added_at_run_time(plan, os.environ)
        if added:
            print(f"# and, new for each attempt: {'; '.join(added)}")
        print(plan.command_line())
        return 0
    if not args.quiet:
        print(f"launch: {plan.describe()}", file=sys.stderr, flush=True)
    tempdirs.remove_left_behind()  # the folders of launches killed before they could remove them

    def probe(hostfile: str, env: Mapping[str, str]) -> LaunchPlan:
        return plan_launch(
            ["true"], nproc=1, ppn=1, hostfile=hostfile, launcher=plan.launcher, env=env, flavor=plan.mpi_flavor
        )

    if args.retries:

        def replan(env: Mapping[str, str], *, hostfile: str | None = None, nproc: int | None = None) -> LaunchPlan:
            return plan_launch(
                command,
                run_id=run_id,
                nproc=nproc or args.nproc,
                ppn=args.ppn or plan.ppn,
                hostfile=hostfile or args.hostfile,
                launcher=plan.launcher,
                mpi_args=args.mpi_args,
                env=env,
                flavor=plan.mpi_flavor,
            )

        try:
            return run_with_retries(
                replan, plan, args.retries, quiet=args.quiet, probe=probe, drop=args.drop_lost_hosts
            )
        except UsageError as e:
            print_error(str(e), prog=PROG)
            return 2
    env = {**os.environ, **plan.env}
    if stays_parent(plan):
        signalled: list[int] = []
        try:
            code = run_attempt(plan, env, signalled)
            lost = find_lost_hosts(plan, env, probe, code, signalled)
        except UsageError as e:
            print_error(str(e), prog=PROG)
            return 2
        if lost:
            print_error(lost_hosts_message(lost, retries=False), prog=PROG)
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(plan.argv[0], plan.argv, env)  # the launcher takes over: signals and exit code are its own
    except OSError as e:
        print_error(f"cannot run {plan.argv[0]!r}: {e.strerror}", prog=PROG)
        return 127
