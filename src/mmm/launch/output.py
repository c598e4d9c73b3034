"""mpiexec's stderr, passed on as it comes, less one box: Open MPI ends a job whose rank exited non-zero
with a box ("prterun detected that one or more processes exited with non-zero status ...") that no MCA
parameter silences alone (``state_base_error_non_zero_exit=0`` also stops it ending the job and returns
0). After a usage error (exit code 2) or a stop on a non-finite loss (65), which every rank has already
reported in one line, the box only repeats it, so launch drops it; after any other failure it is shown."""

from __future__ import annotations

import os
import re
import threading
from typing import IO

from mmm.errors import DIVERGED_EXIT

USAGE_ERROR = 2
# a program's one-line error (mmm's: ``[rank N] prog: error: ...``, or rank 0's ``prog: error: ...``); without
# one, another program's exit 65 (EX_DATAERR) keeps the box, the only place that names its rank
_RANK_SAID = re.compile(rb"^(\[rank \d+\] )?\S[^:]*: error: ")
# a box that adds nothing: a rank's exit after a Ctrl-C or a SIGTERM it was sent (the rank said it)
_STOPPED = re.compile(rb"Exit code:\s+(130|143)\s*\n")
_RULE = re.compile(rb"-{20,}\r?\n")  # the top and bottom line of a box
_LINE_END = re.compile(rb"[\r\n]")


class ExitBoxFilter:
    """Copies a child's stderr to ``fd`` as it comes; a box that says ``marker`` in its first line is held,
    with everything after it, until :meth:`finish` knows the exit code."""

    def __init__(self, marker: str, fd: int = 2) -> None:
        self.marker, self.fd = marker.encode(), fd
        self.held: list[bytes] = []  # a rule and what follows, until the line after it decides
        self.boxed = False  # held[0] opens the box: keep holding until finish
        self.tail = b""  # the start of a line that may be a rule
        self.mid_line = False  # part of the current line has gone out: the rest goes out too
        self.finished = False
        self.rank_said = False  # a rank's one-line error went by
        self.partial = b""  # the start of a line not yet ended (for rank_said)
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def start(self, source: IO[bytes]) -> None:
        self.thread = threading.Thread(target=self._copy, args=(source,), name="mmm-mpiexec-stderr", daemon=True)
        self.thread.start()

    def finish(self, code: int | None, *, wait_s: float = 5.0) -> None:
        """The child has exited with ``code``: show what is held, less the box after a usage error or a stop on
        a non-finite loss, or after a Ctrl-C or SIGTERM when the box names only a rank that exited for it (130,
        143)."""
        if self.thread is not None:
            self.thread.join(timeout=wait_s)  # the rest of its stderr
        with self.lock:
            held = b"".join(self.held) + self.tail
            stopped = code in (130, 143) and _STOPPED.search(held)
            said = code == USAGE_ERROR or code == DIVERGED_EXIT and self.rank_said
            if self.boxed and (said or stopped):  # drop the box to its bottom rule (all if cut)
                end = next((i for i in range(1, len(self.held)) if _RULE.fullmatch(self.held[i])), None)
                held = b"".join(self.held[end + 1 :]) + self.tail if end is not None else b""
            self._write(held)
            self.held, self.tail, self.boxed, self.finished = [], b"", False, True

    def _copy(self, source: IO[bytes]) -> None:
        fd = source.fileno()
        try:
            while chunk := os.read(fd, 65536):
                with self.lock:
                    self._feed(chunk)
        except OSError:
            pass
        finally:
            source.close()

    def _feed(self, data: bytes) -> None:
        if not self.rank_said:  # whole lines, however the pipe cut them
            lines = (self.partial + data).splitlines(keepends=True)
            self.partial = lines.pop()[-4096:] if lines and not lines[-1].endswith((b"\n", b"\r")) else b""
            self.rank_said = any(_RANK_SAID.match(line) for line in lines)
        if self.finished:
            self._write(data)
            return
        if self.mid_line:
            end = _LINE_END.search(data)
            if end is None:
                self._write(data)
                return
            self._write(data[: end.end()])
            data, self.mid_line = data[end.end() :], False
        lines = (self.tail + data).splitlines(keepends=True)
        self.tail = lines.pop() if lines and not lines[-1].endswith((b"\n", b"\r")) else b""
        for line in lines:
            self._line(line)
        if self.tail and not self.held and self.tail.strip(b"-"):  # not a rule: out with it now
            self._write(self.tail)
            self.tail, self.mid_line = b"", True

    def _line(self, line: bytes) -> None:
        if self.boxed:
            self.held.append(line)
            return
        if self.held:  # a rule came just before: this line says whether it opens the box
            if self.marker in line:
                self.held.append(line)
                self.boxed = True
                return
            self._write(b"".join(self.held))
            self.held = []
        if _RULE.fullmatch(line):
            self.held = [line]
        else:
            self._write(line)

    def _write(self, data: bytes) -> None:
        while data:
            try:
                data = data[os.write(self.fd, data) :]
            except OSError:
                return  # launch's stderr is gone: keep draining the child's, so it never blocks
