"""Which ranks of a host ended first: what lets ``launch`` say "rank N on host H died first" under a launcher
that kills every rank the moment one dies and names none (MPICH's and Intel MPI's Hydra).

Each rank notes its process in ``MMM_PID_DIR`` at setup (``<host>.<pid>``, holding its rank) and its exit
when it leaves by its own hand (``<host>.<pid>.exit``: :func:`mmm.dist.liveness.record_exit`). A
:class:`HostWatch` waits on the noted processes of one host (pidfds) and records, at each wake-up, which
ended and when. ``launch`` runs one for its own host. On every other host of the job (``MMM_WATCH`` names
launch's host and port) the first rank to note itself there starts one as a small process of its own
(``python -m mmm.dist.rankwatch``, in a session of its own so that the launcher's kill does not reach it),
which sends each wake-up to launch over TCP and leaves once its host's ranks are gone, taking their notes
with it. Times from different hosts are compared as wall-clock times: a launcher's kill travels from the
dead rank's host to mpiexec and back out to every other host, far longer than a cluster's clock skew.

This module imports neither torch nor anything heavy: the watcher process starts in tens of milliseconds.
"""

from __future__ import annotations

import errno
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from mmm import env as mmm_env

# (time, [(pid, rank, exit note or None)]) for each wake-up of a watch
Batch = tuple[float, list[tuple[int, str, str | None]]]

IDLE_EXIT_S = 60.0  # a remote watcher whose ranks are all gone waits this long for a late note, then leaves


def exit_of(folder: Path, host: str, pid: int) -> str | None:
    """The exit note a rank left (its exit code, or "atexit"); None when it left none (killed, crashed)."""
    try:
        return (folder / f"{host}.{pid}.exit").read_text().strip()
    except OSError:
        return None


class HostWatch(threading.Thread):
    """Waits on the processes of ``host`` noted in ``folder`` and records the order in which they end:
    ``ended`` (pids, one list per wake-up), ``times`` (the wall-clock time of each wake-up). It stays
    silent rather than guess: ``blind`` is set when the order cannot be known (no pidfds here, an error).

    ``expected``: how many ranks to look for (the watch keeps reading the folder until it has found
    them). ``on_batch(batch)`` is called at each wake-up, ``on_found(n)`` when new notes were found.
    ``until_gone``: stop by itself once every rank it found has ended and all ``expected`` were found
    (or no new note came for ``IDLE_EXIT_S``)."""

    def __init__(
        self,
        folder: str | Path,
        expected: int,
        *,
        host: str | None = None,
        on_batch: Callable[[Batch], None] | None = None,
        on_found: Callable[[int], None] | None = None,
        until_gone: bool = False,
    ) -> None:
        super().__init__(name="mmm-rank-watch", daemon=True)
        self.folder, self.expected = Path(folder), expected
        self.host = host or socket.gethostname()
        self.on_batch, self.on_found, self.until_gone = on_batch, on_found, until_gone
        self.rank_of: dict[int, str] = {}  # pid -> rank
        self.ended: list[list[int]] = []  # pids, one list per wake-up, in order
        self.times: list[float] = []  # the time of each wake-up
        self.blind = False
        self.done = threading.Event()
        self.pending: set[int] = set()  # stopping signals the ranks noted from now on get too
        self._sent: set[tuple[int, int]] = set()  # (pid, signal) sent: a pending stop goes to a rank once
        self._deliver_lock = threading.Lock()

    def run(self) -> None:
        poller, fds = select.poll(), {}
        last_news = time.monotonic()

        def collect(timeout_ms: int) -> None:
            events = poller.poll(timeout_ms)
            if events:
                pids = [fds[fd] for fd, _ in events]
                for fd, _ in events:
                    poller.unregister(fd)
                    del fds[fd]
                    os.close(fd)
                self._ended(pids)

        try:
            while not self.done.is_set():
                if len(self.rank_of) < self.expected:  # ranks still starting: look for their notes
                    collect(0)  # what ended before this look comes first
                    if self._look(poller, fds):
                        last_news = time.monotonic()
                        if self.on_found is not None:
                            self.on_found(len(self.rank_of))
                collect(50 if len(self.rank_of) < self.expected else 250)
                if self.until_gone and not fds and self.rank_of:
                    if len(self.rank_of) >= self.expected or time.monotonic() - last_news > IDLE_EXIT_S:
                        break
            collect(0)
        except Exception:  # never a traceback from a helper; never a guess either
            self.blind = True
        finally:
            for fd in fds:
                os.close(fd)

    def deliver(self, signum: int, *, later: bool = False) -> int:
        """Send ``signum`` to each noted rank of this host that has not ended (every time launch asks: a repeat
        means something, a second SIGTERM "stop now"); ``later``: also to each rank noted from now on, once (a
        stop request must reach the ranks still starting). Returns how many live ranks it was sent to (0:
        none has noted itself here, or all have ended)."""
        with self._deliver_lock:
            if later:
                self.pending.add(signum)
            ended = {pid for pids in list(self.ended) for pid in pids}
            pids = [pid for pid in list(self.rank_of) if pid not in ended]
            for pid in pids:
                self._kill(pid, signum)
            return len(pids)

    def _deliver_pending(self) -> None:
        """The stopping signals sent before a rank noted itself, to each rank that has not had them."""
        with self._deliver_lock:
            for signum in tuple(self.pending):
                for pid in [pid for pid in list(self.rank_of) if (pid, signum) not in self._sent]:
                    self._kill(pid, signum)

    def _kill(self, pid: int, signum: int) -> None:
        self._sent.add((pid, signum))
        try:
            os.kill(pid, signum)
        except OSError:
            pass

    def _ended(self, pids: list[int]) -> None:
        self.ended.append(pids)
        self.times.append(time.time())
        if self.on_batch is not None:
            self.on_batch(self.batch(len(self.ended) - 1))

    def batch(self, k: int) -> Batch:
        pids = self.ended[k]
        return self.times[k], [(p, self.rank_of.get(p, "?"), exit_of(self.folder, self.host, p)) for p in pids]

    def _look(self, poller, fds: dict[int, int]) -> bool:
        found = False
        for f in self.folder.iterdir():
            host, _, pid_s = f.name.rpartition(".")
            if host != self.host or not pid_s.isdigit() or int(pid_s) in self.rank_of:
                continue  # an exit note, a note being written, a rank of another host
            pid, found = int(pid_s), True
            self.rank_of[pid] = f.read_text().strip()
            try:
                fd = os.pidfd_open(pid)
            except OSError as e:
                if e.errno != errno.ESRCH:  # no pidfds here (old kernel, seccomp): the order is unknown
                    self.blind = True
                self._ended([pid])  # gone already
                continue
            fds[fd] = pid
            poller.register(fd, select.POLLIN)
        if found and self.pending:
            self._deliver_pending()
        return found


def first_silent(batches: list[tuple[str, Batch]], *, name_hosts: bool) -> str | None:
    """From every host's wake-ups (``(host, batch)``): the rank(s) that ended first without leaving by
    their own hand, as a message; None when the first rank to fail said so itself."""
    for host, (_t, entries) in sorted(batches, key=lambda hb: hb[1][0]):
        failed = [(pid, rank, how) for pid, rank, how in entries if how != "0"]
        if not failed:
            continue
        if any(how is not None for _, _, how in failed):
            return None  # it left with an error of its own, and said so
        if any(not rank.isdigit() for _, rank, _ in failed):
            return None
        failed.sort(key=lambda e: int(e[1]))
        where = f" on {host}" if name_hosts else ""
        names = ", ".join(f"{rank}{where} (pid {pid})" for pid, rank, _ in failed)
        return (
            f"rank{'s' if len(failed) > 1 else ''} {names} died first, without a word: killed by a "
            "signal (e.g. the out-of-memory killer), a crash or os._exit"
        )
    return None


# ------------------------------------------------------------------ a host other than launch's
def start_host_watcher(folder: Path, local_size: int) -> None:
    """Called by a rank that has just noted itself on a host other than launch's: the first rank of
    this host to get here starts this host's watcher process."""
    try:
        fd = os.open(folder / f"{socket.gethostname()}.watcher", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError:
        return  # another rank of this host has started it (or the folder is not writable)
    os.close(fd)
    here = str(Path(__file__).resolve().parents[2])  # the folder mmm itself was imported from
    path = os.environ.get("PYTHONPATH", "")
    try:
        subprocess.Popen(
            [sys.executable, "-m", "mmm.dist.rankwatch", str(folder), str(local_size)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": f"{here}{os.pathsep}{path}" if path else here},
            start_new_session=True,  # out of the launcher's reach: it reports the kill, then leaves
        )
    except OSError:
        (folder / f"{socket.gethostname()}.watcher").unlink(missing_ok=True)


def _serve_launch(folder: Path, expected: int, address: tuple[str, int, str]) -> None:
    host, port, token = address
    me = socket.gethostname()
    try:
        sock = socket.create_connection((host, port), timeout=10)
    except OSError:
        return
    sock.settimeout(None)  # launch's signal lines come at any time

    def send(message: dict) -> None:
        try:
            sock.sendall((json.dumps(message) + "\n").encode())
        except OSError:
            watch.done.set()  # launch is gone: nobody to tell

    watch = HostWatch(folder, expected, host=me, until_gone=True)
    send({"host": me, "token": token, "t": time.time()})  # the hello: who, and the clock launch takes out
    threading.Thread(target=_relay_signals, args=(sock, watch), name="mmm-rank-watch-signals", daemon=True).start()
    watch.on_batch = lambda b: send({"batch": b, "seen": len(watch.rank_of), "blind": watch.blind})
    watch.on_found = lambda n: send({"seen": n})
    watch.run()  # in this thread
    send({"seen": len(watch.rank_of), "blind": watch.blind})
    sock.close()


ASKING = {getattr(signal, name) for name in ("SIGUSR1", "SIGUSR2") if hasattr(signal, name)}
STOPPING = {getattr(signal, name) for name in ("SIGINT", "SIGTERM") if hasattr(signal, name)}
RELAYED = ASKING | STOPPING


def _relay_signals(sock: socket.socket, watch: HostWatch) -> None:
    """Signals launch asks this host's ranks to get (``{"signal": N}`` lines; its launcher does not pass
    them on, or would kill the ranks at once for it): sent to each rank of this host that has not ended,
    a stopping one (SIGINT, SIGTERM) also to the ranks noted later. Only these four signals."""
    try:
        with sock.makefile("r", encoding="utf-8", errors="replace") as f:
            while line := f.readline(1024):
                signum = json.loads(line).get("signal")
                if signum in RELAYED:
                    watch.deliver(signum, later=signum in STOPPING)
    except (OSError, ValueError, AttributeError):
        return  # launch gone, or not a line of launch's


def _host_of(name: str) -> str:
    """The host a note is of: ``host.pid``, ``host.pid.exit``, ``host.watcher``, ``.host.pid.tmp``..."""
    name = name.lstrip(".").removesuffix(".tmp")
    if name.endswith(".watcher"):
        return name.removesuffix(".watcher")
    host, _, pid = name.removesuffix(".exit").rpartition(".")
    return host if pid.isdigit() else ""


def _main(argv: list[str]) -> int:
    folder, expected = Path(argv[0]), int(argv[1])
    me = socket.gethostname()
    try:
        address = mmm_env.get("MMM_WATCH")  # (host, port, token): launch's own value
        if address is not None and hasattr(os, "pidfd_open"):
            _serve_launch(folder, expected, address)
    finally:  # this host's notes go with its watcher; the folder too when nothing else is in it
        try:
            for f in folder.iterdir():
                if _host_of(f.name) == me:
                    f.unlink(missing_ok=True)
            folder.rmdir()
        except OSError:
            pass  # launch removed it first, or another host's notes are still in it
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
