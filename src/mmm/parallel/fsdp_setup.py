"""``fully_shard``'s setup without the per-rank work: what keeps FSDP's setup flat as the job grows.

PyTorch's ``fully_shard`` (2.10 to 2.13 at least) does, for every parameter, work that grows with
the number of ranks it shards over:

* it splits the parameter into one chunk per shard rank and makes an empty tensor for each rank
  past the last row (``_chunk_with_empty``), then keeps only its own chunk and chunk 0's size;
* under TP it joins the data-parallel mesh with the parameter's TP mesh (``DeviceMesh._concatenate``)
  anew for each parameter, and under HSDP slices the shard dimension out of the 2-D mesh anew for
  each parameter (``mesh[name]``): each a new ``DeviceMesh`` built from the whole world's layout.

At 2,048 FSDP ranks (tp 8 x FSDP over 16,384 ranks) that is 377,000 tensors made and dropped for
Llama-3-8B's 291 parameters: seconds of setup on every rank, where 64 ranks take a quarter of one.
``lean_fully_shard()`` is a context manager that, while mmm calls ``fully_shard``, hands torch
(a) chunks made on demand (a sequence whose item ``i`` is exactly what ``torch.chunk`` and the
padding would have put there: the same view of the same storage, or an empty tensor) and (b) one
joined or sliced mesh per distinct mesh and names (the same ``DeviceMesh`` torch would build, built
once).
Both are put back on exit. Where this torch does not have the functions in the expected form, the
context does nothing and ``fully_shard`` runs as it always does (it yields False).
``MMM_LEAN_FSDP_SETUP=0`` turns it off (benchmarks/setup_at_scale.py measures both).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator, Sequence

import torch

from mmm import env

__all__ = ["LazyChunks", "lean_fully_shard"]


class LazyChunks(Sequence):
    """``torch.chunk(tensor, num_chunks, dim)`` padded with empty tensors to ``num_chunks`` items,
    each made when asked for (``_chunk_with_empty``'s result, without making every rank's)."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int) -> None:
        size = tensor.size(dim)
        self._tensor, self._n, self._dim = tensor, num_chunks, dim
        self._step = -(-size // num_chunks)  # torch.chunk's chunk length: ceil(size / chunks)
        self._size = size
        self._filled = -(-size // self._step)  # chunks that hold rows; the rest are empty

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"chunk {i} of {self._n}")
        if i < self._filled:
            start = i * self._step
            return self._tensor.narrow(self._dim, start, min(self._step, self._size - start))
        return self[0].new_empty(0)


def _targets():
    """torch's module and class whose attributes the context swaps, or None where they differ from
    what it was written for (then ``fully_shard`` runs unchanged)."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp._fully_shard import _fsdp_param
    except ImportError:
        return None
    chunk = getattr(_fsdp_param, "_chunk_with_empty", None)
    concat, getitem = DeviceMesh.__dict__.get("_concatenate"), DeviceMesh.__dict__.get("__getitem__")
    if chunk is None or not isinstance(concat, staticmethod) or getitem is None:
        return None
    expected = {chunk: ["tensor", "num_chunks", "dim"], concat.__func__: ["device_mesh_list"]}
    expected[getitem] = ["self", "mesh_dim_names"]
    if any(list(inspect.signature(f).parameters) != names for f, names in expected.items()):
        return None
    return _fsdp_param, DeviceMesh


def _wanted() -> bool:
    return env.get("MMM_LEAN_FSDP_SETUP", True)


_LOCK = threading.RLock()  # one swap at a time: a thread must not take another's wrappers for torch's


@contextlib.contextmanager
def lean_fully_shard() -> Iterator[bool]:
    """While inside, ``fully_shard``'s per-parameter setup costs no work per shard rank (see the
    module doc). Yields whether it applies here. Threads entering it take turns."""
    with _LOCK:
        with _lean() as applied:
            yield applied


@contextlib.contextmanager
def _lean() -> Iterator[bool]:
    targets = _targets() if _wanted() else None
    if targets is None:
        yield False
        return
    fsdp_param, mesh_cls = targets
    chunk = fsdp_param._chunk_with_empty
    if getattr(chunk, "mmm_lean", False):  # already inside one
        yield True
        return
    concat, getitem = mesh_cls.__dict__["_concatenate"], mesh_cls.__dict__["__getitem__"]
    made: dict[tuple, tuple] = {}  # (what, ids of the meshes) -> (the meshes, the result)

    def _chunk_with_empty(tensor: torch.Tensor, num_chunks: int, dim: int) -> Sequence[torch.Tensor]:
        if tensor.size(dim) == 0 or num_chunks <= 1:  # torch's own answer: no per-rank cost here
            return chunk(tensor, num_chunks, dim)
        return LazyChunks(tensor, num_chunks, dim)

    _chunk_with_empty.mmm_lean = True  # type: ignore[attr-defined]

    def _concatenate(device_mesh_list):
        key = ("join", *(id(m) for m in device_mesh_list))
        hit = made.get(key)
        if hit is None:  # the meshes are kept with the result: their ids stay theirs while cached
            hit = made[key] = (list(device_mesh_list), concat.__func__(device_mesh_list))
        return hit[1]

    def _getitem(self, mesh_dim_names):  # torch's names: a nested context finds the form it expects
        key = ("slice", id(self), mesh_dim_names if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names))
        hit = made.get(key)
        if hit is None:
            hit = made[key] = ([self], getitem(self, mesh_dim_names))
        return hit[1]

    fsdp_param._chunk_with_empty = _chunk_with_empty
    mesh_cls._concatenate = staticmethod(_concatenate)
    mesh_cls.__getitem__ = _getitem
    try:
        yield True
    finally:
        fsdp_param._chunk_with_empty = chunk
        mesh_cls._concatenate = concat
        mesh_cls.__getitem__ = getitem
