"""launch's signals: passed on to the job it runs, a SIGINT that stops nothing followed by SIGTERM, and
SIGINT/SIGTERM taken back from an inherited "ignore"."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

from mmm.errors import print_error

PROG = "launch"  # the name on launch's own messages
ESCALATE_AFTER_S = 10.0  # a forwarded SIGINT that stopped nothing is followed by SIGTERM after this
KILL_AFTER_S = 5.0  # a launcher stopped for waiting on nothing is killed if SIGTERM has not ended it
_STOPPING = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")  # recorded: a job stopped on purpose is not retried
_PASSED_ON = ("SIGUSR1", "SIGUSR2")  # e.g. SIGUSR1: every mmm rank writes its stacks


def _ctrl_c_reached_the_child(child: int | None = None) -> bool:
    """A Ctrl-C typed in launch's terminal went to the whole foreground process group: whether that group is
    the child's (process id ``child``; None: launch's own, which the child shares unless it has its own)."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return False  # no controlling terminal: someone sent it to launch alone
    try:
        return os.tcgetpgrp(fd) == (os.getpgid(child) if child is not None else os.getpgrp())
    except OSError:
        return False
    finally:
        os.close(fd)


class _Escalation:
    """A forwarded SIGINT that has not stopped the job after ``grace_s`` is followed by one SIGTERM:
    a program may ignore SIGINT (or have inherited "ignore" from a shell's background job), and launch
    must not wait forever. SIGTERM itself is never escalated to SIGKILL here: mmm's trainers answer it by
    saving a checkpoint, which takes the time it takes (the scheduler bounds it, e.g. Slurm's KillWait)."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s, self.since, self.done = grace_s, None, False

    def due(self, signalled: Sequence[int]) -> bool:
        if self.done or signal.SIGINT not in signalled or signal.SIGTERM in signalled:
            return False
        now = time.monotonic()
        if self.since is None:
            self.since = now
        if now - self.since < self.grace_s:
            return False
        self.done = True
        print_error(f"SIGINT did not stop the job within {self.grace_s:.0f} s; sending SIGTERM", prog=PROG)
        return True


def _wait_forwarding(
    start: Callable[[], subprocess.Popen],
    signalled: list[int],
    *,
    grace_s: float = ESCALATE_AFTER_S,
    stuck: Callable[[], tuple[str, int] | None] | None = None,
    relay: tuple[set[int], Callable[[int], object]] | None = None,
    instead: dict[int, int] | None = None,
) -> int:
    """Start the child and wait for it, passing on the signals launch gets (as when the child had taken
    launch's place). The handlers go in before the child starts, so it begins with the default handling
    of each (never an "ignore" launch inherited); a signal launch inherited as ignored (nohup's SIGHUP)
    is left alone. ``stuck()``, asked while the child runs, returns why the child is waiting for
    nothing (e.g. an mpiexec waiting on a host that is gone) and the exit code to report: the child is
    then stopped (SIGTERM, SIGKILL after ``KILL_AFTER_S``). ``relay``: (signals, deliver): signals the child
    would not pass on to the ranks (Hydra's mpiexec dies of SIGUSR2), delivered by ``deliver`` instead.
    ``instead``: a signal the child would not survive with its ranks, and the one to send it in its place
    (Open MPI's prterun dies of SIGQUIT, leaving the ranks behind: it gets SIGTERM)."""
    holder: list[subprocess.Popen] = []

    def forward(signum, frame):
        if signal.Signals(signum).name in _STOPPING:
            signalled.append(signum)
        if relay is not None and signum in relay[0]:  # not in the handler: the watch's lock may be held here
            # also a Ctrl-C typed at a terminal: srun answers its own by printing the tasks' states only
            threading.Thread(target=relay[1], args=(signum,), name="mmm-relay-signal", daemon=True).start()
        elif signum == signal.SIGINT and _ctrl_c_reached_the_child(holder[0].pid if holder else None):
            return  # a second SIGINT would make mpiexec abort instead of stopping the ranks
        elif holder and holder[0].poll() is None:
            holder[0].send_signal((instead or {}).get(signum, signum))

    sigs = [getattr(signal, name) for name in (*_STOPPING, *_PASSED_ON) if hasattr(signal, name)]
    # always launch's to forward, even if inherited as ignored (a background job's SIGINT and SIGQUIT)
    mine = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGQUIT") if hasattr(signal, n))
    old = {sig: signal.signal(sig, forward) for sig in sigs if sig in mine or signal.getsignal(sig) != signal.SIG_IGN}
    escalate = _Escalation(grace_s)
    stopped_at: float | None = None
    stopped_code = 1
    try:
        holder.append(start())
        p = holder[0]
        while True:
            try:
                rc = p.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if escalate.due(signalled):
                    if relay is not None and signal.SIGTERM in relay[0]:
                        relay[1](signal.SIGTERM)
                    else:
                        p.send_signal(signal.SIGTERM)
                if stopped_at is None and stuck is not None and not signalled and (found := stuck()):
                    why, stopped_code = found
                    print_error(f"{why}: stopping {os.path.basename(p.args[0])}", prog=PROG)
                    p.send_signal(signal.SIGTERM)
                    stopped_at = time.monotonic()
                elif stopped_at is not None and time.monotonic() - stopped_at > KILL_AFTER_S:
                    p.kill()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if stopped_at is not None:
        return stopped_code
    return 128 - rc if rc < 0 else rc


def _unignore_stop_signals() -> None:
    """A shell starts a background job (``launch ... &`` in a batch script, ``nohup make test &``) with
    SIGINT ignored, and an ignored signal stays ignored across exec: ranks started from such a launch
    would ignore the SIGINT launch forwards. SIGINT and SIGTERM are launch's to handle and forward, so
    they start from their defaults here, whatever launch inherited; SIGQUIT too (a shell ignores it in a
    background job as it does SIGINT). An ignored SIGHUP (nohup) stays ignored."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if hasattr(signal, "SIGQUIT") and signal.getsignal(signal.SIGQUIT) == signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)  # a shell's background job has it ignored, as SIGINT
    if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
