"""RankWatch: which of this host's ranks ended first, for a launcher that kills every rank at once and
names none (MPICH's Hydra)."""

from __future__ import annotations

import errno
import os
import select
import socket
import threading
from pathlib import Path


class RankWatch(threading.Thread):
    """Which of this host's ranks ended first. mmm's ranks note their process in ``folder``
    (``MMM_PID_DIR``) at setup and their exit when they leave by their own hand; this thread waits on
    every such process (pidfds) and records the order in which they end. MPICH's Hydra kills every rank
    the moment one dies and names only some process; this names the rank that died. It stays silent
    rather than guess: ranks on other hosts, a kernel without pidfds, a note it could not read."""

    def __init__(self, folder: str, nproc: int) -> None:
        super().__init__(name="mmm-rank-watch", daemon=True)
        self.folder, self.nproc = Path(folder), nproc
        self.host = socket.gethostname()
        self.rank_of: dict[int, str] = {}  # pid -> rank
        self.ended: list[list[int]] = []  # pids, one list per wake-up, in order
        self.blind = False  # the order cannot be known (then first_silent says nothing)
        self.done = threading.Event()

    def run(self) -> None:
        poller, fds = select.poll(), {}

        def collect(timeout_ms: int) -> None:
            events = poller.poll(timeout_ms)
            if events:
                self.ended.append([fds[fd] for fd, _ in events])
                for fd, _ in events:
                    poller.unregister(fd)
                    del fds[fd]
                    os.close(fd)

        try:
            while not self.done.is_set():
                if len(self.rank_of) < self.nproc:  # ranks still starting: look for their notes
                    collect(0)  # what ended before this look comes first
                    self._look(poller, fds)
                collect(50 if len(self.rank_of) < self.nproc else 250)
            collect(0)
        except Exception:  # never a traceback from a helper thread; never a guess either
            self.blind = True
        finally:
            for fd in fds:
                os.close(fd)

    def _look(self, poller, fds: dict[int, int]) -> None:
        for f in self.folder.iterdir():
            host, _, pid_s = f.name.rpartition(".")
            if host != self.host or not pid_s.isdigit() or int(pid_s) in self.rank_of:
                continue  # an exit note, a note being written, a rank of another host
            pid = int(pid_s)
            self.rank_of[pid] = f.read_text().strip()
            try:
                fd = os.pidfd_open(pid)
            except OSError as e:
                if e.errno != errno.ESRCH:  # no pidfds here (old kernel, seccomp): the order is unknown
                    self.blind = True
                self.ended.append([pid])  # gone already
                continue
            fds[fd] = pid
            poller.register(fd, select.POLLIN)

    def first_silent(self) -> str | None:
        """After a failed job: the rank(s) that ended first without leaving by their own hand (killed
        by a signal, a crash, ``os._exit``), as a message; None when a rank that failed first said so
        itself, or when the order cannot be known here (ranks on other hosts, no pidfds)."""
        if self.blind or len(self.rank_of) < self.nproc:
            return None
        for batch in self.ended:
            how = {pid: self._exit_of(pid) for pid in batch}
            failed = [pid for pid in batch if how[pid] != "0"]
            if not failed:
                continue
            if any(how[pid] is not None for pid in failed):
                return None  # it left with an error of its own, and said so
            ranks = [(self.rank_of.get(pid, "?"), pid) for pid in failed]
            if any(not r.isdigit() for r, _ in ranks):
                return None
            ranks.sort(key=lambda rp: int(rp[0]))
            names = ", ".join(f"{r} (pid {p})" for r, p in ranks)
            return (
                f"rank{'s' if len(ranks) > 1 else ''} {names} died first, without a word: killed by a "
                "signal (e.g. the out-of-memory killer), a crash or os._exit"
            )
        return None

    def _exit_of(self, pid: int) -> str | None:
        try:
            return (self.folder / f"{self.host}.{pid}.exit").read_text().strip()
        except OSError:
            return None
