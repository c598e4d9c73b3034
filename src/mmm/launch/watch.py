"""RankWatch: which rank ended first, on any host of the job, for a launcher that kills every rank at once and
names none (MPICH's and Intel MPI's Hydra)."""

from __future__ import annotations

import json
import socket
import threading
import time

from mmm.dist.rankwatch import Batch, HostWatch, exit_of, first_silent

SETTLE_S = 2.0  # after the job: how long the other hosts' watchers have to send their last reports
STUCK_AFTER_S = 15.0  # this host's ranks all gone, one failed, and the launcher still runs this long after


class RankWatch(HostWatch):
    """Which rank ended first. mmm's ranks note their process in ``folder`` (``MMM_PID_DIR``) at setup and
    their exit when they leave by their own hand; this thread waits on the ranks of launch's host
    (pidfds) and records the order in which they end. With ``listen=True`` (a job on several hosts) it
    also takes the reports of each other host's watcher (:mod:`mmm.dist.rankwatch`), which connect to
    :attr:`address` (``MMM_WATCH``). MPICH's Hydra kills every rank the moment one dies and names only
    some process; this names the rank that died, and its host. It stays silent rather than guess: a
    host whose watcher did not report every rank, a kernel without pidfds, a note it could not read."""

    def __init__(self, folder: str, nproc: int, *, listen: bool = False) -> None:
        super().__init__(folder, nproc)
        self.nproc = nproc
        self.remote: dict[str, dict] = {}  # host -> {"batches": [...], "seen": n, "blind": bool}
        self._lock = threading.Lock()
        self._server: socket.socket | None = None
        self.address = ""
        if listen:
            self._server = socket.create_server(("", 0), backlog=128)
            self.address = f"{socket.gethostname()}:{self._server.getsockname()[1]}"
            threading.Thread(target=self._accept, name="mmm-rank-watch-listen", daemon=True).start()

    def run(self) -> None:
        self.expected = self.nproc - self._seen_remote()  # this host's notes: what others have not seen
        super().run()
        if self._server is not None:
            self._server.close()

    def _seen_remote(self) -> int:
        with self._lock:
            return sum(r["seen"] for r in self.remote.values())

    def _accept(self) -> None:
        assert self._server is not None
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        try:
            with conn, conn.makefile("r") as f:
                for line in f:
                    m = json.loads(line)
                    with self._lock:
                        r = self.remote.setdefault(m["host"], {"batches": [], "seen": 0, "blind": False})
                        if "batch" in m:
                            t, entries = m["batch"]
                            r["batches"].append((float(t), [(int(p), str(k), h) for p, k, h in entries]))
                        r["seen"] = int(m.get("seen", r["seen"]))
                        r["blind"] = r["blind"] or bool(m.get("blind"))
                    self.expected = self.nproc - self._seen_remote()  # fewer notes left to find here
        except (OSError, ValueError, KeyError, TypeError):
            with self._lock:  # a report that cannot be read: the order is not known
                self.blind = True

    def stuck(self) -> str | None:
        """Why the launcher waits for nothing, once it has: every rank of this host has ended, one of
        them with a failure, ``STUCK_AFTER_S`` ago. A launcher that kills every rank once one fails
        (Hydra) ends within a second then, unless it waits on a host that is gone (no TCP reset comes
        from a host that lost power or its link), which it would do forever."""
        with self._lock:
            if self.blind or not self.rank_of or len(self.rank_of) < self.expected:
                return None
            ended = {pid: t for pids, t in zip(list(self.ended), list(self.times)) for pid in pids}
            if len(ended) < len(self.rank_of) or all(exit_of(self.folder, self.host, p) == "0" for p in ended):
                return None
            last = max(ended.values())
        if time.time() - last < STUCK_AFTER_S:
            return None
        return (
            f"every rank of this host ({self.host}) ended, one with a failure, {STUCK_AFTER_S:.0f} s ago, and the "
            "launcher still waits (on a host that is gone?)"
        )

    def _settled(self) -> bool:
        with self._lock:
            return all(sum(len(e) for _, e in r["batches"]) >= r["seen"] for r in self.remote.values())

    def first_silent(self) -> str | None:
        """After a failed job: the rank(s) that ended first without leaving by their own hand (killed
        by a signal, a crash, ``os._exit``), as a message; None when a rank that failed first said so
        itself, or when the order cannot be known (a rank nobody watched, no pidfds)."""
        deadline = time.monotonic() + SETTLE_S  # the other hosts' last reports may still be on their way
        while time.monotonic() < deadline and not self._settled():
            time.sleep(0.02)
        if not self._settled():
            return None  # a host whose ranks' ends never came (the host itself lost): the first is not known
        with self._lock:
            if self.blind or any(r["blind"] for r in self.remote.values()):
                return None
            if len(self.rank_of) + sum(r["seen"] for r in self.remote.values()) < self.nproc:
                return None
            batches: list[tuple[str, Batch]] = [(self.host, self.batch(k)) for k in range(len(self.ended))]
            batches += [(host, b) for host, r in self.remote.items() for b in r["batches"]]
            return first_silent(batches, name_hosts=bool(self.remote))
