"""RankWatch: which rank ended first, on any host of the job, for a launcher that kills every rank at once and
names none (MPICH's and Intel MPI's Hydra)."""

from __future__ import annotations

import hmac
import json
import secrets
import socket
import threading
import time
from collections.abc import Sequence

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

    def __init__(self, folder: str, nproc: int, *, listen: bool = False, hosts: Sequence[str] = ()) -> None:
        super().__init__(folder, nproc)
        self.nproc = nproc
        self.remote: dict[str, dict] = {}  # host -> {"batches": [...], "seen": n, "blind": bool, "offset": s}
        self._lock = threading.Lock()
        self._server: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._token = secrets.token_hex(16)
        self.address = ""
        if listen:  # on the interface the job's other hosts reach this one by, not on every interface
            self._server = socket.create_server((job_interface(hosts), 0), backlog=128)
            host, port = self._server.getsockname()[:2]
            # the address it listens on (other hosts may resolve launch's host name to another network)
            self.address = f"{host if host not in ('', '0.0.0.0') else socket.gethostname()}:{port}:{self._token}"
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
                token = hello.get("token") if isinstance(hello, dict) else None
                if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self._token.encode()):
                    return
                host, offset = str(hello["host"]), time.time() - float(hello["t"])  # skew + one-way latency
                conn.settimeout(None)
                for signum in sorted(self.pending):  # a stop launch passed on before this host's watcher came
                    conn.sendall((json.dumps({"signal": signum}) + "\n").encode())
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
            with self._lock:  # a closed connection leaves room for another (MAX_CONNECTIONS)
                if conn in self._conns:
                    self._conns.remove(conn)
            conn.close()

    def signal_ranks(self, signum: int, *, later: bool = False) -> int:
        """Send ``signum`` to every rank of the job that has not ended: this host's by their noted process
        ids, every other host's through its watcher (which passes on SIGUSR1, SIGUSR2, SIGINT and SIGTERM).
        For a launcher that does not pass a signal on itself (Hydra's mpiexec dies of SIGUSR2), or would kill
        the ranks for it (Open MPI's prterun, SIGTERM). ``later``: the ranks noted from now on, and the
        watchers of hosts that connect from now on, get it too. Returns how many ranks and other hosts'
        watchers it reached now (0: no rank has noted itself yet)."""
        with self._lock:
            if later:  # before the connections are read: a watcher that comes after gets it from _read
                self.pending.add(signum)
            conns = list(self._conns)
        reached = self.deliver(signum, later=later)
        line = (json.dumps({"signal": int(signum)}) + "\n").encode()
        for conn in conns:
            try:
                conn.sendall(line)
                reached += 1
            except OSError:
                pass
        return reached

    def stuck(self) -> tuple[str, int] | None:
        """Why the launcher waits for nothing, once it has, and the exit code to report: every rank of
        this host has ended, one of them killed or with a non-zero exit code, ``STUCK_AFTER_S`` ago. A
        launcher that kills every rank once one fails (Hydra) ends within a second then, unless it waits
        on a host that is gone (no TCP reset comes from a host that lost power or its link), which it
        would do forever. The code is the ranks' own when they share one (2: bad input, 143: stopped...),
        else 1."""
        for host, notes, last in self._ended_hosts():
            codes = {int(n) for n in notes if n is not None and n.lstrip("-").isdigit()}
            if None not in notes and not codes - {0}:
                continue  # every rank left by its own hand, none with an error ("atexit": unknown, not stuck)
            if time.time() - last < STUCK_AFTER_S:
                continue
            where = "this host" if host == self.host else "host"
            why = (
                f"every rank of {where} ({host}) ended, one with a failure, {STUCK_AFTER_S:.0f} s ago, and the "
                "launcher still waits (on a host that is gone?)"
            )
            return why, (codes.pop() if None not in notes and len(codes) == 1 else 1)
        return None

    def _ended_hosts(self) -> list[tuple[str, list[str | None], float]]:
        """(host, its ranks' exit notes, when its last rank ended) for every host whose ranks have all ended:
        this one from its own watch, the others from their watchers' reports (launch's host may run none)."""
        out = []
        with self._lock:
            if not self.blind and self.rank_of and len(self.rank_of) >= self.expected:
                ended = {pid: t for pids, t in zip(list(self.ended), list(self.times)) for pid in pids}
                if len(ended) >= len(self.rank_of):
                    notes = [exit_of(self.folder, self.host, p) for p in ended]
                    out.append((self.host, notes, max(ended.values())))
            for host, r in self.remote.items():
                entries = [(t, how) for t, batch in r["batches"] for _, _, how in batch]
                if not r["blind"] and r["seen"] and len(entries) >= r["seen"]:
                    out.append((host, [how for _, how in entries], max(t for t, _ in entries)))
        return out

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


def job_interface(hosts: Sequence[str]) -> str:
    """The address of this machine's interface toward the job's other hosts (where launch's rank watch
    listens): the one the kernel routes to the first host that is not this one; every interface ("")
    when no such host resolves."""
    me = {socket.gethostname(), socket.gethostname().split(".")[0], "localhost"}
    for host in hosts:
        if host in me:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((socket.gethostbyname(host), 9))  # UDP: no packet is sent; the route is chosen
                return s.getsockname()[0]
        except OSError:
            continue
    return ""
