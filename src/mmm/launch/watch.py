"""RankWatch: which rank ended first, on any host of the job, for a launcher that kills every rank at once and
names none (MPICH's and Intel MPI's Hydra)."""

from __future__ import annotations

import json
import secrets
import socket
import threading
import time

from mmm.dist.rankwatch import Batch, HostWatch, exit_of, first_silent

SETTLE_S = 2.0  # after the job: how long the other hosts' watchers have to send their last reports
STUCK_AFTER_S = 15.0  # this host's ranks all gone, one failed, and the launcher still runs this long after
LEAD_S = 0.010  # a rank of another host is named only when its end leads every other host's by this much
MAX_LINE = 1 << 16  # a report line longer than this is not a watcher's
MAX_CONNECTIONS = 4096


class RankWatch(HostWatch):
    """Which rank ended first. mmm's ranks note their process in ``folder`` (``MMM_PID_DIR``) at setup and
    their exit when they leave by their own hand; this thread waits on the ranks of launch's host
    (pidfds) and records the order in which they end. With ``listen=True`` (a job on several hosts) it
    also takes the reports of each other host's watcher (:mod:`mmm.dist.rankwatch`), which connect to
    :attr:`address` (``MMM_WATCH``: host, port and a token only the job's processes know). MPICH's Hydra
    kills every rank the moment one dies and names only some process; this names the rank that died, and
    its host. It stays silent rather than guess: a host whose watcher did not report every rank, a kernel
    without pidfds, a note it could not read, ends on different hosts too close in time to order."""

    def __init__(self, folder: str, nproc: int, *, listen: bool = False) -> None:
        super().__init__(folder, nproc)
        self.nproc = nproc
        self.remote: dict[str, dict] = {}  # host -> {"batches": [...], "seen": n, "blind": bool, "offset": s}
        self._lock = threading.Lock()
        self._server: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._token = secrets.token_hex(16)
        self.address = ""
        if listen:
            self._server = socket.create_server(("", 0), backlog=128)
            self.address = f"{socket.gethostname()}:{self._server.getsockname()[1]}:{self._token}"
            threading.Thread(target=self._accept, name="mmm-rank-watch-listen", daemon=True).start()

    def run(self) -> None:
        self.expected = self.nproc - self._seen_remote()  # this host's notes: what others have not seen
        super().run()

    def close(self) -> None:
        """Stop listening and drop every connection (a lost host's stays open otherwise); after
        :meth:`first_silent`, which may still wait for the other hosts' last reports."""
        with self._lock:
            server, self._server = self._server, None
            conns, self._conns = self._conns, []
        for s in [server, *conns] if server is not None else conns:
            try:
                s.close()
            except OSError:
                pass

    def _seen_remote(self) -> int:
        with self._lock:
            return sum(r["seen"] for r in self.remote.values())

    def _accept(self) -> None:
        server = self._server
        while server is not None:
            try:
                conn, _ = server.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._server is None or len(self._conns) >= MAX_CONNECTIONS:
                    conn.close()
                    continue
                self._conns.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        """One watcher's reports. A connection that does not start with the job's token, or sends what a
        watcher does not, is dropped without a trace: it is not one of the job's processes."""
        host = None
        try:
            conn.settimeout(30.0)  # the hello comes at once
            with conn.makefile("r", encoding="utf-8", errors="replace") as f:
                hello = json.loads(f.readline(MAX_LINE))
                if not isinstance(hello, dict) or hello.get("token") != self._token:
                    return
                host, offset = str(hello["host"]), time.time() - float(hello["t"])  # skew + one-way latency
                conn.settimeout(None)
                while line := f.readline(MAX_LINE):
                    m = json.loads(line)
                    with self._lock:
                        r = self.remote.setdefault(host, {"batches": [], "seen": 0, "blind": False, "offset": offset})
                        if "batch" in m:
                            t, entries = m["batch"]
                            r["batches"].append((float(t) + offset, [(int(p), str(k), h) for p, k, h in entries]))
                        r["seen"] = max(0, min(self.nproc, int(m.get("seen", r["seen"]))))
                        r["blind"] = r["blind"] or bool(m.get("blind"))
                    self.expected = max(0, self.nproc - self._seen_remote())  # fewer notes left to find here
        except Exception:  # noqa: BLE001  (a stranger's bytes, or a watcher cut off: never a traceback)
            if host is not None:
                with self._lock:  # one of the job's watchers whose report broke off: its order is not known
                    self.remote.setdefault(host, {"batches": [], "seen": 0, "blind": False})["blind"] = True
        finally:
            conn.close()

    def stuck(self) -> tuple[str, int] | None:
        """Why the launcher waits for nothing, once it has, and the exit code to report: every rank of
        this host has ended, one of them killed or with a non-zero exit code, ``STUCK_AFTER_S`` ago. A
        launcher that kills every rank once one fails (Hydra) ends within a second then, unless it waits
        on a host that is gone (no TCP reset comes from a host that lost power or its link), which it
        would do forever. The code is the ranks' own when they share one (2: bad input, 143: stopped...),
        else 1."""
        with self._lock:
            if self.blind or not self.rank_of or len(self.rank_of) < self.expected:
                return None
            ended = {pid: t for pids, t in zip(list(self.ended), list(self.times)) for pid in pids}
            if len(ended) < len(self.rank_of):
                return None
            notes = {exit_of(self.folder, self.host, p) for p in ended}
            codes = {int(n) for n in notes if n is not None and n.lstrip("-").isdigit()}
            if None not in notes and not codes - {0}:
                return None  # every rank left by its own hand, none with an error ("atexit": unknown, not stuck)
            last = max(ended.values())
        if time.time() - last < STUCK_AFTER_S:
            return None
        why = (
            f"every rank of this host ({self.host}) ended, one with a failure, {STUCK_AFTER_S:.0f} s ago, and the "
            "launcher still waits (on a host that is gone?)"
        )
        return why, (codes.pop() if None not in notes and len(codes) == 1 else 1)

    def _settled(self) -> bool:
        with self._lock:
            return all(sum(len(e) for _, e in r["batches"]) >= r["seen"] for r in self.remote.values())

    def first_silent(self) -> str | None:
        """After a failed job: the rank(s) that ended first without leaving by their own hand (killed
        by a signal, a crash, ``os._exit``), as a message; None when a rank that failed first said so
        itself, or when the order cannot be known (a rank nobody watched, no pidfds, ends on two hosts
        within ``LEAD_S`` of each other once each host's clock offset is taken out)."""
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
        if self.remote:  # ends on different hosts: the first must lead every other host's first failure
            failing = sorted((t, host) for host, (t, entries) in batches if any(how != "0" for _, _, how in entries))
            if failing:
                t0, host0 = failing[0]
                others = [t for t, h in failing if h != host0]
                if others and min(others) - t0 < LEAD_S:
                    return None
        return first_silent(batches, name_hosts=bool(self.remote))
