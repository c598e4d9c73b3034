"""The local spawner: ``nproc`` copies of a command on this machine with torchrun-style variables, no
torch import (so it starts fast); the first rank to fail stops the others."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Mapping, Sequence

from mmm.errors import UsageError, print_error
from mmm.launch.signals import _PASSED_ON, _STOPPING, ESCALATE_AFTER_S, PROG, _Escalation


def spawn_local(
    cmd: Sequence[str],
    nproc: int,
    env: Mapping[str, str],
    *,
    settle_s: float = 5.0,
    grace_s: float = ESCALATE_AFTER_S,
    signalled: list[int] | None = None,
) -> int:
    """Run ``nproc`` copies of ``cmd`` with torchrun-style variables; stop all when one fails.

    When a rank fails the others get ``settle_s`` seconds to exit on their own (bad input
    fails every rank alike, and each says so), then SIGTERM, then SIGKILL after ``grace_s``
    more. Returns 0 if every rank exited 0, else the first failing rank's code (128+N for a
    signal). SIGINT/SIGTERM are forwarded to the ranks at once; a SIGINT that has not stopped every
    rank after ``grace_s`` is followed by SIGTERM (a rank may ignore SIGINT).
    """
    procs: list[subprocess.Popen] = []
    base = dict(env)
    signalled = [] if signalled is None else signalled  # the signals forwarded (the caller may watch)

    def forward(signum, frame):
        if signal.Signals(signum).name in _STOPPING:  # SIGUSR1/2 ask the ranks something; they go on
            signalled.append(signum)
        for p in procs:
            if p.poll() is None:
                try:
                    p.send_signal(signum)
                except ProcessLookupError:
                    pass

    # before the ranks start: exec gives a caught signal its default handling in the child, while an
    # inherited "ignore" (a background job's SIGINT) would stay and make the forwarded signal a no-op
    # SIGINT, SIGTERM and SIGQUIT always; the others (SIGHUP, SIGUSR1, SIGUSR2) unless launch inherited them
    # ignored (nohup's SIGHUP): the ranks then keep ignoring them too
    sigs = [getattr(signal, name) for name in (*_STOPPING, *_PASSED_ON) if hasattr(signal, name)]
    mine = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGQUIT") if hasattr(signal, n))
    old = {s: signal.signal(s, forward) for s in sigs if s in mine or signal.getsignal(s) != signal.SIG_IGN}
    for rank in range(nproc):
        rank_env = {
            **base,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0",
            "NODE_RANK": "0",
        }
        try:
            procs.append(subprocess.Popen(list(cmd), env=rank_env))
        except OSError as e:
            for p in procs:
                p.kill()
            for s, h in old.items():
                signal.signal(s, h)
            raise UsageError(f"cannot start {cmd[0]!r}: {e.strerror}") from None

    code = 0
    failed_rank: int | None = None
    killed_by: str | None = None  # the signal that ended the first failed rank (it could say nothing itself)
    term_at: float | None = None
    kill_at: float | None = None
    escalate = _Escalation(grace_s)
    try:
        while True:
            running = [p for p in procs if p.poll() is None]
            if running and escalate.due(signalled):
                for q in running:
                    q.send_signal(signal.SIGTERM)
            for rank, p in enumerate(procs):
                rc = p.returncode
                if rc not in (None, 0) and code == 0:
                    code, failed_rank = (128 - rc if rc < 0 else rc), rank
                    killed_by = _signal_name(-rc) if rc < 0 else None
                    term_at = time.monotonic() + (0.0 if signalled else settle_s)
            if not running:
                if killed_by and term_at is not None and not signalled:  # the others ended by themselves
                    print_error(f"rank {failed_rank} was killed by {killed_by} (exit {code})", prog=PROG)
                return code
            now = time.monotonic()
            if term_at is not None and now >= term_at:
                if not signalled:  # after a forwarded signal, exits are expected, not news
                    how = f"was killed by {killed_by} (exit {code})" if killed_by else f"exited with code {code}"
                    print_error(f"rank {failed_rank} {how}; stopping the other {len(running)} rank(s)", prog=PROG)
                for q in running:
                    q.send_signal(signal.SIGTERM)
                term_at, kill_at = None, now + grace_s
            if kill_at is not None and now >= kill_at:
                for q in running:
                    q.kill()
                kill_at = None
            time.sleep(0.05)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
