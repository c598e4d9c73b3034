"""launch's own folders in the temporary folder (the MPI launcher's session files, the ranks' process ids,
the probes' and the relaunches' hostfiles), named for the launch that made them: its host, its process id,
when that process started, and its process group. A launch removes its folders when it ends; one killed
(SIGKILL, the out-of-memory killer, a scheduler's hard stop) cannot, and the next launch on the host
removes them once nothing of that launch runs."""

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
# mmm-<kind>-<host>-<pid>-<the process's start in clock ticks since boot, 0 where unknown>-<its process
# group>-<mkdtemp's>; <host>: the crc32 of the host's name and of its process-id namespace (a container with
# the host's name and its /tmp shared counts process ids of its own)
_NAME = re.compile(r"mmm-(?:%s)-([0-9a-f]{8})-(\d+)-(\d+)-(\d+)-\w+" % "|".join(KINDS))
_PROC = Path("/proc/self/stat").exists()


def _started(pid: int) -> str | None:
    """When process ``pid`` started (Linux: clock ticks since boot; "0" where the system does not say);
    None: there is no such process."""
    if _PROC:
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


def _group_lives(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (a killed launch's launcher and ranks, where they
    shared its group: a terminal's foreground job)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _host() -> str:
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return f"{zlib.crc32(f'{socket.gethostname()}/{namespace}'.encode()):08x}"


def prefix(kind: str) -> str:
    """The start of the name of a folder of ``kind`` that this process makes (``tempfile``'s ``prefix``)."""
    assert kind in KINDS, kind
    pid = os.getpid()
    return f"mmm-{kind}-{_host()}-{pid}-{_started(pid) or 0}-{os.getpgid(0)}-"


def make(kind: str, parent: str | None = None) -> str:
    """A new folder of ``kind`` for this launch (in ``parent``, else the temporary folder)."""
    return tempfile.mkdtemp(prefix=prefix(kind), dir=parent)


def remove_left_behind(parent: str | None = None) -> list[Path]:
    """Remove the folders (of this user, in ``parent``, else the temporary folder) that launches on this
    host made and did not remove because they were killed: their process is gone (or its id now belongs to
    a process started at another time) and no process of its group runs. The folders of another host (a
    temporary folder shared by several) and of running launches are kept. Returns what was removed."""
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
        gone = started is None or (m.group(3) != "0" and started not in ("0", m.group(3)))
        if gone and not _group_lives(int(m.group(4))):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
    return removed
