"""Who is still alive after a failed collective, and where every rank was: a roll call and stack files.

A rank whose collective fails (a peer died, or the collective timeout fired) calls the roll
(:func:`silent_ranks`). Every rank runs a small watcher thread, started by ``setup``, that waits
on the rendezvous store with a client of its own: it answers the roll call even while its main
thread is blocked inside another collective, so only ranks whose process is gone (or frozen) stay
silent. Before answering, the watcher writes its rank's Python stacks (every thread, through
:mod:`faulthandler`) to ``<dir>/rank-<r>.txt`` when a stack folder is set (:func:`set_stack_dir`;
the trainers use ``<outdir>/stacks``): what each live rank was doing when the job stalled.

``SIGUSR1`` writes the same stacks at any time (``kill -USR1 <pid>`` on a job that looks hung):
to the rank's stack file when a folder is set, else to stderr. This works for gloo, NCCL and
oneCCL alike; NCCL's flight recorder only sees NCCL.

A rank whose launcher is gone (``launch``, mpiexec's daemon, torchrun's agent, srun's step daemon
killed: SIGKILL, the OOM killer) would live on as an orphan, its collectives waiting for the timeout and
its output going nowhere. :func:`leave_when_orphaned` (started by ``setup`` in a job of several ranks)
notices within ``ORPHAN_CHECK_S`` that its parent changed, writes its stacks, says so in one line and
exits 1.

While nothing fails a watcher costs one idle store request per rank (renewed every 20 days: a wait
that times out makes the store client print warnings); it is released through its own key before its
rank leaves.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from mmm import env
from mmm.dist.rankwatch import start_host_watcher
from mmm.files import write_atomic

# The watcher's idle store request: a wait that times out makes the store client print two C++ warnings
# (measured: 4 lines per rank every 30 s with a 30 s wait), so it waits 20 days (below the 2**31 ms a
# poll() timeout holds) and is woken through its key; an error sooner than that means the store is gone.
_WAIT_S = 20 * 86400.0

_stack_file: IO[str] | None = None
_stack_path: Path | None = None
_watcher: _Watcher | None = None


def _wake_key(rank: int) -> str:
    return f"mmm/roll_call/{rank}"


def _alive_key(rank: int) -> str:
    return f"mmm/alive/{rank}"


class _Watcher(threading.Thread):
    """Waits (one idle store request at a time) on its rank's roll-call key; answers unless leaving."""

    def __init__(self, store: Any, rank: int) -> None:
        super().__init__(name="mmm-roll-call", daemon=True)
        self.store, self.rank = store, rank
        self.leaving = False

    def run(self) -> None:
        timeout = datetime.timedelta(seconds=_WAIT_S)
        while not self.leaving:
            t0 = time.monotonic()
            try:
                self.store.wait([_wake_key(self.rank)], timeout)
            except Exception:
                if time.monotonic() - t0 < _WAIT_S / 2:  # the store is gone (the job is ending)
                    return
                continue  # only the wait's own timeout: keep waiting
            if self.leaving:  # woken by its own rank's teardown
                return
            try:
                dump_stacks("roll call after a failed collective")
                self.store.set(_alive_key(self.rank), "1")
            except Exception:
                pass
            return


def start_watcher(rank: int) -> None:
    """Answer roll calls from now on (``setup`` calls it once the process group exists)."""
    global _watcher
    if _watcher is not None:
        return
    try:
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store().clone()
    except Exception:  # a store that cannot be cloned: roll calls will say "unknown"
        return
    try:  # where this rank runs, so that a roll call can name the host of a silent rank
        store.set(_host_key(rank), socket.gethostname())
    except Exception:
        pass
    _watcher = _Watcher(store, rank)
    _watcher.start()
    if hasattr(signal, "SIGUSR1") and threading.current_thread() is threading.main_thread():
        faulthandler.register(signal.SIGUSR1, file=_stack_file or sys.stderr, all_threads=True, chain=False)


ORPHAN_CHECK_S = 2.0
ORPHANED_EXIT = 1
_orphan_watch = 0  # the current orphan watch (0: none); a watch whose number is not this one ends
_busy: Any = None  # () -> bool: a checkpoint write, or a graceful stop, under way (mmm.dist.exits sets it)


def set_busy_check(check) -> None:
    """``check()`` says whether this rank is finishing something an orphaned rank lets end first."""
    global _busy
    _busy = check


def leave_when_orphaned(rank: int, *, grace_s: float) -> None:
    """End this rank once the process that started it (its launcher) is gone: the job cannot go on without
    it (no signal, no output, no exit code reaches anyone), so nothing should stay running. Noticed within
    ``ORPHAN_CHECK_S``; a checkpoint write or a graceful stop under way (a scheduler's SIGTERM reaches the
    ranks as it ends a wrapper) gets up to ``grace_s`` to finish first. A checkpoint is never complete
    before its commit, so even one cut short harms no complete one."""
    global _orphan_watch
    parent = os.getppid()
    if parent <= 1:  # started by init (already orphaned, or a daemon): nothing to watch
        return
    _orphan_watch += 1
    mine = _orphan_watch

    def watch() -> None:
        while os.getppid() == parent and _orphan_watch == mine:
            time.sleep(ORPHAN_CHECK_S)
        if _orphan_watch != mine:  # released at teardown (or watched anew by a later setup)
            return
        until = time.monotonic() + grace_s
        while _busy is not None and _busy() and time.monotonic() < until:
            time.sleep(0.5)
        dump_stacks(f"the launcher (pid {parent}) is gone")
        line = f"[rank {rank}] error: its launcher (pid {parent}) is gone (killed?); the rank leaves too\n"
        try:
            os.write(2, line.encode())
        except OSError:  # stderr went with the launcher
            pass
        os._exit(ORPHANED_EXIT)

    threading.Thread(target=watch, name="mmm-orphan-watch", daemon=True).start()


def release_watcher() -> None:
    """End this rank's watcher before the rank leaves (teardown, or an error every rank shares): it is
    woken through its own key, so no request is left waiting when the store's host exits (that would
    print the store client's warnings). Best effort; a later ``setup`` starts a new watcher."""
    global _watcher, _orphan_watch
    _orphan_watch += 1  # a rank past its teardown may outlive its launcher: its program's own business
    w, _watcher = _watcher, None
    if w is None or not w.is_alive():
        return
    w.leaving = True
    try:
        import torch.distributed as dist

        dist.distributed_c10d._get_default_store().set(_wake_key(w.rank), "leaving")
        w.join(timeout=2.0)
    except Exception:
        pass


def set_stack_dir(path: str | os.PathLike, rank: int) -> Path:
    """Write this rank's stacks to ``<path>/rank-<rank>.txt`` on a roll call and on ``SIGUSR1``."""
    global _stack_file, _stack_path
    target = Path(path) / f"rank-{rank}.txt"
    target.parent.mkdir(parents=True, exist_ok=True)
    if _stack_file is not None:
        _stack_file.close()
    _stack_file, _stack_path = open(target, "a", buffering=1), Path(path)
    if hasattr(signal, "SIGUSR1") and threading.current_thread() is threading.main_thread():
        faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True, chain=False)
    return target


def stack_dir() -> Path | None:
    """The folder of the stack files (None when not set)."""
    return _stack_path


def dump_stacks(why: str, extra: str | None = None) -> None:
    """Append every thread's Python stack to this rank's stack file (nothing without one)."""
    f = _stack_file
    if f is None:
        return
    f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: {why}\n")
    if extra:
        f.write(extra.rstrip() + "\n")
    f.flush()
    faulthandler.dump_traceback(file=f, all_threads=True)
    f.flush()


def note(text: str) -> None:
    """Append ``text`` (e.g. this rank's own error) to its stack file, if any."""
    if _stack_file is not None:
        _stack_file.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}\n{text.rstrip()}\n")
        _stack_file.flush()


def close_stack_file() -> None:
    """Close this rank's stack file, and remove it (and the folder) when nothing was written."""
    global _stack_file, _stack_path
    f, folder = _stack_file, _stack_path
    _stack_file = _stack_path = None
    if f is None:
        return
    if hasattr(signal, "SIGUSR1") and threading.current_thread() is threading.main_thread():
        faulthandler.unregister(signal.SIGUSR1)
    try:
        f.close()
        path = Path(f.name)
        if path.stat().st_size == 0:
            path.unlink()
            folder.rmdir()  # only when empty (other ranks' files keep it)
    except OSError:
        pass


def silent_ranks(wait_s: float = 3.0, linger_s: float = 5.0) -> list[int] | None:
    """After a failed collective: call the roll and return the ranks that do not answer within
    ``wait_s`` (their process is gone or frozen), or None when that cannot be known (the store
    lived on a lost rank, rank 0, or there is no process group). Every live rank's watcher answers at once,
    whatever its main thread is doing, so a rank stuck in another collective is not named. Rank 0, the
    store's host, then waits up to ``linger_s`` for the live ranks to finish their own roll calls, so that
    none of them loses the store in the middle of one."""
    dist = sys.modules.get("torch.distributed")
    try:  # rank 0 hosts the store: its requests cannot lose it, and its stderr is not held
        client = dist is not None and dist.is_initialized() and dist.get_rank() != 0
    except Exception:
        client = False
    with _stderr_without_store_warnings() if client else contextlib.nullcontext():
        return _roll_call(wait_s, linger_s)


def _roll_call(wait_s: float, linger_s: float) -> list[int] | None:
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
        store = dist.distributed_c10d._get_default_store()
        if _store_host_gone(store):  # a request on the old client would only print the client's warnings
            return None
        store.set_timeout(datetime.timedelta(seconds=wait_s))
        world, me = dist.get_world_size(), dist.get_rank()
        wake = [_wake_key(r) for r in range(world)]
        if hasattr(store, "multi_set"):
            store.multi_set(wake, ["roll call"] * world)
        else:  # pragma: no cover - older stores
            for key in wake:
                store.set(key, "roll call")
        if _watcher is None:  # this rank's own watcher was never started: answer for it here
            store.set(_alive_key(dist.get_rank()), "1")
        deadline = time.monotonic() + wait_s
        while True:
            missing = [r for r in range(world) if not store.check([_alive_key(r)])]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        store.set(_done_key(me), "1")
        if me == 0:  # the store's host: stay while the live ranks still call their own roll (~seconds)
            others = [_done_key(r) for r in range(1, world) if r not in missing]
            deadline = time.monotonic() + linger_s
            while others and time.monotonic() < deadline and not store.check(others):
                time.sleep(0.05)
        return missing
    except Exception:
        return None


# c10d's store client, when the store's host (rank 0) goes away in the middle of a request, prints a warning and
# the C++ frames of the error it raises (~25 lines); the caller gets that error as well, and handles it
_STORE_WARNING = re.compile(rb"^(\[rank\d+\]:)?\[W[^\]]*(TCPStore|Store)[^\]]*\]")
_ITS_FRAMES = (b"Exception raised from ", b"frame #")


def drop_store_warnings(text: bytes) -> bytes:
    """``text`` (what went to stderr) without the store client's warnings and their C++ frames."""
    kept, dropping = [], False
    for line in text.splitlines(keepends=True):
        if _STORE_WARNING.match(line):
            dropping = True
        elif dropping and (line.startswith(_ITS_FRAMES) or not line.strip()):
            dropping = bool(line.strip())  # a blank line ends the warning's block
        else:
            dropping = False
            kept.append(line)
    return b"".join(kept)


@contextlib.contextmanager
def _stderr_without_store_warnings():
    """Hold what goes to stderr (file descriptor 2: C++ writes there too) while the block asks the store
    after a failure, and pass on all of it but the store client's warnings (:func:`drop_store_warnings`).
    The held text waits in an anonymous in-memory file (Linux's memfd; elsewhere nothing is held)."""
    try:
        sys.stderr.flush()
        held = os.memfd_create("mmm-stderr")
    except (AttributeError, OSError, ValueError):  # no memfd here, no stderr: as it is
        yield
        return
    try:
        saved = os.dup(2)
    except OSError:  # no descriptor 2 to hold
        os.close(held)
        yield
        return
    os.dup2(held, 2)
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        with os.fdopen(held, "rb") as f:
            f.seek(0)
            text = drop_store_warnings(f.read())
        with contextlib.suppress(OSError):  # stderr closed, or its reader gone: nothing to tell
            while text:  # (a pipe may take part of it at a time)
                text = text[os.write(2, text) :]


def _host_key(rank: int) -> str:
    return f"mmm/host/{rank}"


def describe_ranks(ranks: list[int]) -> str:
    """``rank 2`` / ``ranks 2, 3``; on a job of several hosts with the host of each (``ranks 2, 3 on
    node2``: a whole host lost reads as such)."""
    plain = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    try:
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        with _stderr_without_store_warnings():
            hosts = [h.decode() for h in store.multi_get([_host_key(r) for r in range(dist.get_world_size())])]
    except Exception:
        return plain
    if len(set(hosts)) <= 1:  # every rank on one host: the host says nothing
        return plain
    by_host: dict[str, list[int]] = {}
    for r in ranks:
        by_host.setdefault(hosts[r], []).append(r)
    return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} on {h}" for h, rs in by_host.items())


def _done_key(rank: int) -> str:
    return f"mmm/roll_done/{rank}"


def _store_host_gone(store: Any) -> bool:
    """True when the store's server refuses a fresh connection: its host (rank 0) has left."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    if not host or not port:
        return False
    try:
        socket.create_connection((host, port), timeout=1.0).close()
    except OSError:
        return True
    return False


def record_pid(rank: int, local_size: int = 1) -> None:
    """Note this process for ``launch`` (``MMM_PID_DIR``, a folder it made on its host): under a launcher
    that kills every rank the moment one dies without saying which (MPICH's Hydra), launch watches
    these processes and names the rank that ended first. On a host other than launch's (``MMM_WATCH``
    names launch's host and port) the folder is made here when missing, and the first rank of the host
    starts the host's watcher (:mod:`mmm.dist.rankwatch`). Nothing without ``MMM_PID_DIR``."""
    global _pid_file
    folder = env.get("MMM_PID_DIR")
    if not folder:
        return
    me, watch = socket.gethostname(), env.get("MMM_WATCH")
    remote = watch is not None and not _is_this_host(watch[0], me)
    try:
        if remote:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            if os.lstat(folder).st_uid != os.getuid():
                return  # not a folder of this job's user: write nothing into it
        elif not os.path.isdir(folder):
            return
        path = Path(folder, f"{me}.{os.getpid()}")
        write_atomic(path, str(rank), durable=False)
        _pid_file = path
    except OSError:
        return
    if remote:
        start_host_watcher(Path(folder), local_size)


def record_exit(how: int | str) -> None:
    """Note that this rank is leaving by its own hand (an exit code, or "atexit"), so launch does not
    take it for one that was killed or crashed."""
    if _pid_file is not None:
        try:
            write_atomic(_pid_file.with_name(_pid_file.name + ".exit"), str(how), durable=False)
        except OSError:
            pass


_pid_file: Path | None = None


def _is_this_host(address: str, me: str) -> bool:
    """``address`` (a host name or an IP address, launch's in ``MMM_WATCH``) is this machine: its name, or an
    address a socket here can bind to."""
    if address in (me, me.split(".")[0], "localhost"):
        return True
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((socket.gethostbyname(address), 0))
        return True
    except OSError:
        return False
