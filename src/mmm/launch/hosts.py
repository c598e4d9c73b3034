"""Host lists: a PBS nodefile or an MPI hostfile, and whether a host name is this machine."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from mmm.errors import UsageError


def read_hostfile(path: str | os.PathLike) -> tuple[list[str], list[int]]:
    """Hosts in first-seen order and slots per host, from a PBS nodefile or an MPI hostfile.

    Accepts one host per line (repeats count as slots, as in ``PBS_NODEFILE``),
    ``host slots=N [max_slots=M ...]`` (Open MPI's key=value fields; ``count``/``cpu`` for slots) and
    ``host:N`` (Hydra). ``#`` starts a comment. Anything
    else is refused in one line naming the file, the line and the fix (an IPv6 address among them: the
    ``host:N`` form cannot tell its colons apart).
    """
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"hostfile {str(path)!r} does not exist or is not a file")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise UsageError(f"hostfile {str(path)!r} cannot be read: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"hostfile {str(path)!r} is not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}); "
            "list one host name per line"
        ) from None
    slots: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue

        def bad(why: str) -> UsageError:
            return UsageError(f"hostfile {str(path)!r} line {number} ({line!r}): {why}")

        fields_ = line.split()
        host, n = fields_[0], 1
        if host.count(":") > 1 or host.startswith("["):
            raise bad("an IPv6 address; list host names (or IPv4 addresses) instead")
        if ":" in host:
            host, _, count = host.partition(":")
            if not count.isdigit() or int(count) < 1:
                raise bad(f"{count!r} after ':' is not a number of slots >= 1 (host:N)")
            n = int(count)
        if not host:
            raise bad("no host name")
        # Open MPI's fields: key=value, spaces around "=" allowed; slots (or count, cpu) gives the slots, the
        # others (max_slots, max-slots, slots_max...) are its own business
        for f in " ".join(fields_[1:]).replace(" =", "=").replace("= ", "=").split():
            key, eq, value = f.partition("=")
            if not eq or not key:
                raise bad(f"{f!r} is not a key=value field (e.g. slots=4)")
            if key in ("slots", "count", "cpu", "max_slots", "max-slots", "slots_max", "slots-max"):
                if not value.isdigit() or int(value) < 1:
                    raise bad(f"{f!r}: {key} must be a number >= 1")
                if key in ("slots", "count", "cpu"):
                    n = int(value)
        slots[host] = slots.get(host, 0) + n
    if not slots:
        raise UsageError(f"hostfile {str(path)!r} lists no hosts")
    return list(slots), list(slots.values())


def is_this_host(host: str) -> bool:
    return host in {"localhost", "127.0.0.1", socket.gethostname(), socket.gethostname().split(".")[0]}
