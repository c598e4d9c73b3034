"""How a program ends: SIGTERM handling, run_main's one-line errors and exit codes, failed peers named."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from mmm.dist import liveness
from mmm.dist.device import timeout_seconds
from mmm.dist.ranks import discover_ranks
from mmm.dist.state import current, teardown
from mmm.errors import UsageError, first_line, print_error

if TYPE_CHECKING:  # pragma: no cover
    pass


USAGE_ERROR_GRACE_S = 3.0  # other ranks wait this long before exiting so rank 0 can print a shared error


class Terminated(SystemExit):
    """Raised in the main thread when SIGTERM arrives (preemption, launcher shutting down)."""


def _on_sigterm(signum, frame):  # pragma: no cover - exercised through subprocess tests
    raise Terminated(128 + signum)


_STOP_SIGNAL: int | None = None
_STOP_AT = 0.0
_UNINTERRUPTED = 0  # depth of uninterrupted() sections (a checkpoint being written)
_DEFERRED: int | None = None  # a stop-now signal that arrived inside one
REPEAT_WINDOW_S = 2.0  # a second SIGTERM this soon is the same request, sent twice (srun + scheduler)


def _on_sigterm_graceful(signum, frame):  # pragma: no cover - exercised through subprocess tests
    global _STOP_SIGNAL, _STOP_AT, _DEFERRED
    now = time.monotonic()
    if _STOP_SIGNAL is None:
        _STOP_SIGNAL, _STOP_AT = signum, now
        return
    if now - _STOP_AT < REPEAT_WINDOW_S:
        return
    if _UNINTERRUPTED:  # never stop in the middle of a checkpoint write: right after it
        _DEFERRED = signum
        return
    raise Terminated(128 + signum)  # a second SIGTERM, later: stop now


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """A section a stop-now SIGTERM must not cut (a checkpoint write): such a signal takes effect
    when the section ends. The first, graceful SIGTERM is unaffected (it only sets the stop flag)."""
    global _UNINTERRUPTED, _DEFERRED
    _UNINTERRUPTED += 1
    try:
        yield
    finally:
        _UNINTERRUPTED -= 1
        if not _UNINTERRUPTED and _DEFERRED is not None:
            signum, _DEFERRED = _DEFERRED, None
            raise Terminated(128 + signum)


def graceful_sigterm() -> None:
    """From now on the first SIGTERM only asks the training loop to stop after the current step
    (:func:`stop_flag`, shared by the step's one all-reduce). A repeat within ``REPEAT_WINDOW_S``
    is the same request (srun and the scheduler both signal); a later one stops at once, except
    inside :func:`uninterrupted` (a checkpoint write), which it ends first."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm_graceful)


liveness.set_busy_check(lambda: bool(_UNINTERRUPTED) or _STOP_SIGNAL is not None)


def stop_flag() -> int:
    """This rank's stop request: the signal number of a SIGTERM caught by :func:`graceful_sigterm`, else 0
    (the training loop shares it in its one per-step all-reduce, :class:`mmm.training.step.StepSync`)."""
    return _STOP_SIGNAL or 0


def run_main(
    main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None, *, prog: str | None = None
) -> NoReturn:
    """Run a distributed program's ``main`` and exit the way a cluster job should.

    - bad input (:class:`~mmm.errors.UsageError`, argparse errors): one line on stderr
      (rank 0 only when every rank hits it alike), exit 2, no traceback;
    - an unexpected exception: its traceback, prefixed by the rank, exit 1;
    - SIGTERM: exit 143 after teardown; Ctrl-C: exit 130;
    - always: barrier (on success) + destroy the process group + ``MPI.Finalize`` if
      MPI was started, flush, then leave without the interpreter's shutdown (where gloo's threads can
      abort): ``os._exit``, or libc's ``exit()`` after ``MPI.Finalize`` (MPICH's Hydra needs it).
    """
    prog = prog or os.path.basename(sys.argv[0])
    if prog == "__main__.py":
        prog = "mmm"
    signal.signal(signal.SIGTERM, _on_sigterm)
    code, together = 0, None
    try:
        code = int(main(argv) or 0)
    except UsageError as e:
        liveness.release_watcher()  # before rank 0, the store's host, may leave
        code = e.exit_code
        together = e.same_on_all_ranks
        rank = _rank_for_messages()
        if rank is None:  # what is wrong is who this process is (a bad WORLD_SIZE): each process says it
            print_error(str(e), prog=prog)
        elif rank == 0 or not e.same_on_all_ranks:
            print_error(str(e), prog=prog, rank=rank if not e.same_on_all_ranks and rank else None)
            if rank == 0 and e.same_on_all_ranks:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)  # printed: a launcher's SIGTERM may end it now
                _share_usage_error(str(e))
        elif rank is not None:
            # rank 0 reports it; give it time to, since mpiexec/srun kill the job at the first exit.
            # If rank 0 did not hit the same error (a file missing on this node only), say it here.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if not _rank0_said(str(e), USAGE_ERROR_GRACE_S):
                together = False
                print_error(str(e), prog=prog, rank=rank)
    except Terminated as e:
        code = int(e.code)
        print_error("terminated by SIGTERM; shutting down", prog=prog, rank=_rank_for_messages())
    except KeyboardInterrupt:
        code = 130
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print_error(e.code, prog=prog)
    except BaseException as e:
        code = 1
        rank = _rank_for_messages()
        peer = peer_failure_message(e)
        if peer is not None:  # one line per rank, not a wall of tracebacks
            liveness.note(traceback.format_exc())
            lost = liveness.silent_ranks()
            if lost:
                peer = f"{liveness.describe_ranks(lost)} stopped answering; " + peer
            if liveness.stack_dir() is not None:
                peer += f"; where each live rank was: {liveness.stack_dir()}/rank-*.txt"
            print_error(peer, prog=prog, rank=rank)
            finish(code)
        tb = traceback.format_exc()
        prefix = f"[rank {rank}] " if rank is not None else ""
        sys.stderr.write("".join(f"{prefix}{line}\n" for line in tb.rstrip().splitlines()))
    finish(code, together=together)


_PEER_LOST = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "econnreset",
    "connection refused",
    "read error",
    "recv error",
    "socket closed",
    "no route to host",
)
_PEER_TIMEOUT = ("timed out", "timeout", "deadline exceeded")
_BACKENDS = ("gloo", "nccl", "processgroup", "c10d", "xccl", "oneccl", "mpi_")


def peer_failure_message(e: BaseException) -> str | None:
    """A one-line explanation when ``e`` is a collective failing because another rank died or
    stalled (gloo/NCCL/MPI errors), else None."""
    text = " ".join(str(e).split())
    low = text.lower()
    try:
        import torch.distributed as dist

        is_dist = isinstance(e, dist.DistError)
        lost_link = isinstance(e, (dist.DistNetworkError, dist.DistStoreError))
    except (ImportError, AttributeError):
        is_dist = lost_link = False
    first = text[:200] + ("..." if len(text) > 200 else "")
    from_backend = is_dist or any(k in low for k in _BACKENDS)
    if not from_backend:
        return None  # not a collective's error (a user's own socket or timeout): keep its traceback
    if any(k in low for k in _PEER_TIMEOUT):
        try:
            t = f"{current().timeout_s if current() is not None else timeout_seconds(None):g} s"
        except UsageError:
            t = "see MMM_TIMEOUT"
        return (
            f"no answer from another rank within the collective timeout ({t}; set it with --timeout or "
            f"MMM_TIMEOUT): a rank stalled or died; the launcher's message names it ({first})"
        )
    if any(k in low for k in _PEER_LOST) or lost_link:
        return (
            f"lost contact with another rank during a collective: a rank died or was killed; the launcher's "
            f"message names it ({first})"
        )
    return None  # a backend error of its own (invalid usage, out of memory): keep its traceback


_USAGE_KEY = "mmm/usage_error/0"
_READ_KEY = "mmm/usage_error/read"  # how many other ranks have read it


def _store():
    import torch.distributed as tdist

    return tdist.distributed_c10d._get_default_store() if tdist.is_initialized() else None


def _share_usage_error(message: str) -> None:
    """Rank 0 posts its usage error where the other ranks can compare theirs, and stays (the store
    lives in this process) until they have read it or the grace time is over (best effort)."""
    try:
        store = _store()
        if store is None:
            return
        import torch.distributed as tdist

        store.set(_USAGE_KEY, message)
        deadline = time.monotonic() + USAGE_ERROR_GRACE_S
        while store.add(_READ_KEY, 0) < tdist.get_world_size() - 1 and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:
        pass


def _rank0_said(message: str, wait_s: float) -> bool:
    """Whether rank 0 reported this same usage error within ``wait_s``. Without a process group
    (flag parsing fails before it) the error is the same on every rank by construction: wait, True."""
    try:
        store = _store()
    except Exception:
        store = None
    if store is None:
        time.sleep(wait_s)
        return True
    deadline = time.monotonic() + wait_s
    try:
        while time.monotonic() < deadline:
            if store.check([_USAGE_KEY]):
                said = store.get(_USAGE_KEY).decode()
                store.add(_READ_KEY, 1)
                return said == message
            time.sleep(0.05)
    except Exception:
        return False
    return False


def _rank_for_messages() -> int | None:
    if current() is not None:
        return current().rank
    try:
        return discover_ranks(use_mpi4py=False).rank
    except Exception:
        return None


TEARDOWN_AFTER_FAILURE_S = 30.0
EXIT_HANDLERS_S = 330.0  # the atexit handlers' bound: a background checkpoint delete waits up to 300 s


def _collective_timeout() -> float:
    info = current()
    try:
        return info.timeout_s if info is not None else timeout_seconds(None)
    except UsageError:
        return 600.0


def _leave_now(code: int, grace: float, what: str = "teardown did not finish") -> None:
    print_error(f"{what} within {grace:.0f} s (a peer's host gone?); leaving with code {code}")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def finish(code: int = 0, *, together: bool | None = None) -> NoReturn:
    """Tear down, run the atexit handlers, flush, and leave the process with ``code`` (skipping
    interpreter shutdown, where gloo's worker threads can abort a finished run).
    ``together``: every rank is leaving the same way (success, or a usage error all ranks saw).

    Teardown is bounded: after a failure a peer's host may be gone without a word (its link cut, no TCP
    reset), and destroying the group can then wait on it forever, leaving a rank behind that holds its
    device. A watchdog leaves after :data:`TEARDOWN_AFTER_FAILURE_S` (a failed run), or the collective
    timeout plus that (a finished run, whose teardown barrier may wait for slower peers)."""
    grace = TEARDOWN_AFTER_FAILURE_S if code else _collective_timeout() + TEARDOWN_AFTER_FAILURE_S
    watchdog = threading.Timer(grace, _leave_now, args=(code or 1, grace))
    watchdog.daemon = True
    watchdog.start()
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        teardown(ok=code == 0, finalize_mpi=code == 0 if together is None else together)
    except BaseException as e:  # never let teardown turn a result into a hang or abort
        print_error(f"teardown: {first_line(e)}")
        code = code or 1
    finally:
        # teardown is over: the atexit handlers (a pruned checkpoint's background delete waits up to
        # EXIT_WAIT_S) get their own bound, and a finished run that outlasts it still leaves with its code
        watchdog.cancel()
        bound = EXIT_HANDLERS_S if code == 0 else TEARDOWN_AFTER_FAILURE_S  # a failed rank frees its device soon
        late = threading.Timer(bound, _leave_now, args=(code, bound, "exit handlers did not finish"))
        late.daemon = True
        late.start()
        try:  # the program's own atexit handlers still run (os._exit would skip them)
            atexit._run_exitfuncs()
        except BaseException:  # pragma: no cover - _run_exitfuncs prints a handler's error itself
            pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        liveness.record_exit(code)
        if _mpi_finalized():
            # MPICH's Hydra counts a rank as finished only on a normal process exit (C exit handlers
            # run): after a bare _exit its proxy may SIGKILL the other ranks (rc 9). libc's exit()
            # runs them and still skips Python's shutdown; called through PyDLL, i.e. holding the GIL,
            # which torch's thread-local destructors need there (through CDLL they abort: rc 134).
            import ctypes

            ctypes.PyDLL(None).exit(code)
        os._exit(code)


def _mpi_finalized() -> bool:
    MPI = sys.modules.get("mpi4py.MPI")
    try:
        return MPI is not None and MPI.Is_finalized()
    except Exception:
        return False


class RankZeroFailed(RuntimeError):
    """Work rank 0 did for every rank failed there (:func:`on_rank0`); raised on every rank at once."""


def on_rank0(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 and tell every rank how it went (a collective every rank enters): its
    value, or its error raised on every rank at once, so that a failure of rank 0's filesystem work
    (a folder it cannot make, a full disk) never leaves the others at a barrier until the timeout.
    A :class:`mmm.errors.UsageError` keeps its type (a one-line error on every rank)."""
    import torch.distributed as tdist

    distributed = tdist.is_initialized() and tdist.get_world_size() > 1
    rank = tdist.get_rank() if distributed else 0
    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = ("ok", fn())
        except UsageError as e:
            if not distributed:
                raise
            box[0] = ("usage", (type(e), str(e)))
        except Exception as e:
            if not distributed:
                raise
            box[0] = ("error", f"{type(e).__name__}: {e}")
    if distributed:
        tdist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "usage":  # the same error, and the same one line (rank 0 prints it), on every rank
        cls, message = value
        raise cls(message)
    if kind == "error":
        raise RankZeroFailed(value)
    return value


def all_ok(error: BaseException | None) -> None:
    """After work every rank did for itself (its own file): raise on every rank when any rank failed,
    naming the first, instead of leaving the others at the next barrier."""
    failures = [f for f in gather_objects(None if error is None else f"{type(error).__name__}: {error}") if f]
    if error is not None and len(failures) <= 1:
        raise error
    if failures:
        raise RankZeroFailed(f"{len(failures)} rank(s) failed, the first: {failures[0]}")


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` on every rank (an explicit collective, for end-of-run reports)."""
    import torch.distributed as tdist

    if not tdist.is_initialized() or tdist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, obj)
    return out
