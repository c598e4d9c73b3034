"""launch's own folders in the temporary folder (the MPI launcher's session files, the ranks' process ids,
the probes' and the relaunches' hostfiles), named for the launch that made them: its host, its process id
and when that process started. A launch removes its folders when it ends; one killed (SIGKILL, the
out-of-memory killer, a scheduler's hard stop) cannot, and the next launch on the host removes them."""

from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import tempfile
import zlib
from pathlib import Path

KINDS = ("mpi", "pids", "probe", "hosts")
# mmm-<kind>-<host's crc32>-<pid>-<the process's start in clock ticks since boot, 0 where unknown>-<mkdtemp's>
_NAME = re.compile(r"mmm-(?:%s)-([0-9a-f]{8})-(\d+)-(\d+)-\w+" % "|".join(KINDS))


def _started(pid: int) -> str | None:
    """When process ``pid`` started (Linux: clock ticks since boot), "0" where this system does not say;
    None: there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[19]
    except FileNotFoundError:
        return None
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return "0"


def _host() -> str:
    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


def prefix(kind: str) -> str:
    """The start of the name of a folder of ``kind`` that this process makes (``tempfile``'s ``prefix``)."""
    assert kind in KINDS, kind
    return f"mmm-{kind}-{_host()}-{os.getpid()}-{_started(os.getpid()) or 0}-"


def make(kind: str, parent: str | None = None) -> str:
    """A new folder of ``kind`` for this launch (in ``parent``, else the temporary folder)."""
    return tempfile.mkdtemp(prefix=prefix(kind), dir=parent)


def remove_left_behind(parent: str | None = None) -> list[Path]:
    """Remove the folders (of this user, in ``parent``, else the temporary folder) that launches on this
    host made and did not remove because they were killed: their process is gone, or its id now belongs
    to a process started at another time. The folders of another host (a temporary folder shared by
    several) and of running launches are kept. Returns what was removed."""
    host, uid, removed = _host(), os.getuid(), []
    try:
        entries = list(os.scandir(parent or tempfile.gettempdir()))
    except OSError:
        return removed
    for entry in entries:
        m = _NAME.fullmatch(entry.name)
        if not m or m.group(1) != host:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
            continue
        started = _started(int(m.group(2)))
        if started is None or (m.group(3) != "0" and started not in ("0", m.group(3))):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
    return removed
