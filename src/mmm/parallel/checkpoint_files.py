"""A DCP checkpoint's files read without running code from them, and checked for damage before a load.

torch's own reader unpickles ``.metadata`` with plain ``pickle`` and its planner loads non-tensor values
with ``weights_only=False``: a checkpoint folder someone else could write to would run their code on every
rank. :class:`SafeReader` unpickles ``.metadata`` allowing only the classes DCP writes there, and
:class:`SafeLoadPlanner` loads non-tensor values with ``weights_only=True`` (numbers, strings, lists,
dicts: what an optimizer's param groups hold). With the metadata read, :func:`dcp_damage` checks that
every shard file is as long as it says: a shard cut short (a copy interrupted, a node lost while
writing) is damage, found before the load, so ``--resume latest`` takes the checkpoint saved before it.
"""

from __future__ import annotations

import enum
import io
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from mmm.errors import UsageError, first_line

METADATA = ".metadata"
_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}  # fmt: skip


def _enum_member(cls: Any, name: str) -> Any:
    """``getattr(cls, name)`` as Python 3.11.0-3.11.4 pickle an enum member (DCP's ``_MEM_FORMAT_ENCODING``):
    only a member of an enum of the modules DCP writes from, nothing else reached through getattr."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and cls.__module__ in _ALLOWED_MODULES:
        if isinstance(name, str) and name in cls.__members__:
            return cls[name]
    raise pickle.UnpicklingError(f"getattr({getattr(cls, '__name__', cls)!r}, {name!r}) is not something DCP writes")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        allowed = (module, name) in _ALLOWED or module in _ALLOWED_MODULES and not name.startswith("__")
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not something DCP writes in {METADATA}")
        return super().find_class(module, name)


def read_metadata(folder: Path) -> Metadata:
    """A checkpoint's ``.metadata``, unpickled allowing only DCP's own classes (UsageError otherwise)."""
    path = Path(folder) / METADATA
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
        raise UsageError(f"{path} is not a DCP checkpoint's metadata ({e}); it was not loaded") from None
    if not isinstance(metadata, Metadata):
        raise UsageError(f"{path} holds a {type(metadata).__name__}, not a DCP checkpoint's metadata")
    return metadata


def dcp_damage(folder: Path) -> str | None:
    """What is wrong with a DCP checkpoint's files: metadata that does not read, a shard file missing or
    shorter than the data the metadata places in it; None when every file is whole."""
    try:
        metadata = read_metadata(folder)
    except (UsageError, OSError) as e:
        return str(e)
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = str(info.relative_path)
        ends[name] = max(ends.get(name, 0), int(info.offset) + int(info.length))
    for name, end in sorted(ends.items()):
        f = Path(folder) / name
        if not f.is_file():
            return f"{name} is missing"
        size = f.stat().st_size
        if size < end:
            return f"{name} is cut short ({size} of {end} bytes)"
    return None


def torch_file_damage(folder: Path) -> str | None:
    """What is wrong with the files ``torch.save`` wrote under ``folder`` (DeepSpeed's states, RNG states):
    the first that is not a whole zip archive (cut short, overwritten) or holds nothing; None when each
    reads as one. A cheap look at each file's directory, not at its contents."""
    for f in sorted(p for p in Path(folder).rglob("*.pt") if p.is_file()):
        try:
            with open(f, "rb") as handle:
                if handle.read(2) == b"\x80\x02":  # torch's legacy (non-zip) format: nothing cheap to look at
                    continue
            with zipfile.ZipFile(f) as z:
                if not z.namelist():
                    return f"{f.relative_to(folder)} holds nothing"
        except FileNotFoundError:
            continue  # gone since the listing (a prune deleting it): not damage of what is read
        except (zipfile.BadZipFile, OSError) as e:
            return f"{f.relative_to(folder)} is not a whole torch file ({e})"
    return None


class SafeReader(FileSystemReader):
    """torch's file reader, its ``.metadata`` read (once) by :func:`read_metadata`."""

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id:  # another checkpoint: its own metadata (a reset of the same one keeps it)
            self.__dict__.pop("_metadata", None)
        super().reset(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is not None:  # a per-rank metadata file (not what mmm writes): torch's own reader's name for it
            raise UsageError(f"{self.path}: per-rank DCP metadata (__{rank}{METADATA}) is not read by mmm")
        metadata = self.__dict__.get("_metadata")  # read once: the load and the format check share it
        if metadata is None:
            metadata = self._metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """torch's load planner, its non-tensor values loaded with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UsageError(
                f"a value of the checkpoint ({read_item.dest_index.fqn}) is not plain data ({first_line(e)}); "
                "it was not loaded"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
