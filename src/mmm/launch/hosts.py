"""Host lists: a PBS nodefile or an MPI hostfile, and whether a host name is this machine."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from mmm.errors import UsageError


def read_hostfile(path: str | os.PathLike) -> tuple[list[str], list[int]]:
    """Hosts in first-seen order and slots per host, from a PBS nodefile or an MPI hostfile.

    Accepts one host per line (repeats count as slots, as in ``PBS_NODEFILE``),
    ``host slots=N`` (Open MPI) and ``host:N`` (Hydra). ``#`` starts a comment.
    """
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"hostfile {str(path)!r} does not exist or is not a file")
    slots: dict[str, int] = {}
    for raw in p.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields_ = line.split()
        host, n = fields_[0], 1
        if ":" in host:
            host, _, count = host.partition(":")
            n = int(count) if count.isdigit() else 1
        for f in fields_[1:]:
            if f.startswith(("slots=", "max_slots=")) and f.split("=", 1)[1].isdigit():
                n = int(f.split("=", 1)[1]) if f.startswith("slots=") else n
        slots[host] = slots.get(host, 0) + n
    if not slots:
        raise UsageError(f"hostfile {str(path)!r} lists no hosts")
    return list(slots), list(slots.values())


def is_this_host(host: str) -> bool:
    return host in {"localhost", "127.0.0.1", socket.gethostname(), socket.gethostname().split(".")[0]}
