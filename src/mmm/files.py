"""Files written whole: a reader (or a rerun after a crash) finds the old file or the new one, never a part.

:func:`write_atomic` writes under a temporary name beside the file and renames it into place; ``durable``
(the default) also makes the data and the rename survive a node crash or a power loss (fsync of the file
before the rename, and of its folder after), which a rename alone does not on every file system: a history,
a summary or a checkpoint's files are written so. Files that a rerun remakes (plots, a rank's pid file) may
skip the fsyncs. Standard library only: every layer uses it.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def fsync_path(path: str | Path) -> None:
    """Make a file's data, or a folder's entries (renames, new files), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(
    path: str | Path, data: str | bytes | Callable[[BinaryIO], object], *, durable: bool = True, tmp: Path | None = None
) -> Path:
    """Write ``data`` to ``path`` whole or not at all: text (UTF-8; the bytes of undecodable characters kept
    as they were read), bytes, or a function given the open binary file (``torch.save``, ``ndarray.tofile``).
    ``tmp``: the temporary name (default ``.<name>.tmp`` beside it), removed if the write fails. Returns
    ``path``."""
    path = Path(path)
    if path.is_dir():  # before a temporary file beside it is made
        raise IsADirectoryError(f"{path} is a directory, not a file to write")
    tmp = tmp or path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8", errors="surrogateescape") if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        try:
            fsync_path(path.parent)
        except OSError as e:  # a mount that takes no fsync of a folder (some FUSE, CIFS): the file is written
            if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.ENOSYS, errno.EBADF, errno.EACCES):
                raise
    return path
