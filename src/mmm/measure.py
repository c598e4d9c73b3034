"""Measure what one training step communicates and keeps for backward, per rank.

* :class:`CommCounter` counts the payload bytes of every collective and point-to-point op issued
  while it is active, grouped by the mesh dimension whose process group carried it. Payload is the
  size of the whole buffer a collective works on: the gathered output of an all-gather, the input of
  a reduce-scatter, the tensor of an all-reduce / broadcast / send / recv. (A ring moves (n-1)/n of
  that payload per rank for all-gather and reduce-scatter, 2(n-1)/n for all-reduce.)
* :class:`SavedActivations` sums the bytes of the distinct tensors autograd saves for backward
  (parameters excluded): the activation memory of a step without activation checkpointing.
  Checkpointed regions save through their own hooks and are not seen, so under ``--ac`` this counts
  only what lies outside the checkpointed blocks.

Both see every op through a Python dispatch mode or hook, so they slow the step they watch: the
trainers use them on one warmup step (``--measure``) and never in timed steps.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

# c10d ops: (payload argument index, "out" when the payload is the output buffer)
_C10D_PAYLOAD = {
    "_allgather_base_": 0,
    "allgather_into_tensor_coalesced_": 0,
    "allgather_": 0,
    "_reduce_scatter_base_": 1,
    "reduce_scatter_tensor_coalesced_": 1,
    "reduce_scatter_": 1,
    "allreduce_": 0,
    "allreduce_coalesced_": 0,
    "broadcast_": 0,
    "reduce_": 0,
    "alltoall_base_": 1,
    "alltoall_": 1,
    "send": 0,
    "recv_": 0,
    "recv_any_source_": 0,
    "gather_": 1,
    "scatter_": 0,
}
# functional collectives: the payload is the input, times the group size for all-gather
_FUNCOL_GATHER = {"all_gather_into_tensor", "all_gather_into_tensor_coalesced", "all_gather_into_tensor_out"}
_FUNCOL = _FUNCOL_GATHER | {
    "all_reduce",
    "all_reduce_",
    "all_reduce_coalesced",
    "all_reduce_coalesced_",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
    "all_to_all_single",
    "broadcast",
    "broadcast_",
}


def _kind(op: str) -> str:
    for kind, words in (
        ("all_gather", ("allgather", "all_gather")),
        ("reduce_scatter", ("reduce_scatter",)),
        ("all_reduce", ("allreduce", "all_reduce")),
        ("p2p", ("send", "recv")),
    ):
        if any(w in op for w in words):
            return kind
    return "other"


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        local = obj._local_tensor if hasattr(obj, "_local_tensor") else obj
        return local.numel() * local.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(x) for x in obj)
    return 0


class CommCounter(TorchDispatchMode):
    """``with CommCounter(groups) as c: ...`` then ``c.bytes`` = ``{dim name: payload bytes}``.

    ``groups`` maps names to process groups (e.g. :meth:`mmm.parallel.Mesh.named_groups`); traffic
    on the default (world) group is counted under ``"world"``, on any other group not in the map under
    ``"other"``.
    """

    def __init__(self, groups: dict[str, Any]) -> None:
        super().__init__()
        from torch.distributed.tensor import DTensor

        self._dtensor = DTensor

        self._names: dict[str, str] = {}  # group name -> our name
        self._by_ranks: dict[tuple[int, ...], str] = {}  # a group we were not given is named by its ranks
        for name, group in groups.items():
            if group is not None:
                self._names.setdefault(group.group_name, name)
                self._by_ranks.setdefault(tuple(dist.get_process_group_ranks(group)), name)
        if dist.is_initialized():  # the default group: the training step's own packed all-reduce
            self._names.setdefault(dist.group.WORLD.group_name, "world")
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.by_kind: dict[tuple[str, str], int] = defaultdict(int)
        """Payload bytes by (group, kind): all_gather, reduce_scatter, all_reduce, p2p or other."""

    def _group_of(self, args) -> str:
        for a in args:
            if isinstance(a, torch.ScriptObject):
                try:
                    pg = dist.ProcessGroup.unbox(a)
                except (RuntimeError, TypeError):
                    continue
                if pg.group_name not in self._names:  # e.g. DeepSpeed's own data-parallel group
                    ranks = tuple(dist.get_process_group_ranks(pg))
                    self._names[pg.group_name] = self._by_ranks.get(ranks, "other")
                return self._names[pg.group_name]
            if isinstance(a, str) and a in self._names:
                return self._names[a]
        return "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, self._dtensor) for t in types):
            return NotImplemented  # let DTensor turn the op into local ops and collectives first
        ns, name = func.namespace, func._schema.name.split("::")[-1]
        if ns == "c10d" and name in _C10D_PAYLOAD:
            group = self._group_of(args)
            payload = _nbytes(args[_C10D_PAYLOAD[name]])
            self.bytes[group] += payload
            self.calls[group] += 1
            self.by_kind[(group, _kind(name))] += payload
        elif ns in ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd") and name in _FUNCOL:
            group = self._group_of(list(args) + list(kwargs.values()))
            payload = _nbytes(args[0])
            if name in _FUNCOL_GATHER:
                payload *= next((a for a in args[1:] if isinstance(a, int)), 1)
            self.bytes[group] += payload
            self.calls[group] += 1
            self.by_kind[(group, _kind(name))] += payload
        return func(*args, **kwargs)

    def result(self) -> dict[str, int]:
        return dict(sorted(self.bytes.items()))


class SavedActivations:
    """``with SavedActivations() as s: loss = model(x)`` then ``s.bytes``: distinct saved storages."""

    def __init__(self) -> None:
        self._seen: set[int] = set()
        self.bytes = 0
        self._ctx = None

    def _pack(self, t: torch.Tensor):
        base = t._base if t._base is not None else t
        if not (base.is_leaf and base.requires_grad):  # parameters (and views of them) are not activations
            local = t._local_tensor if hasattr(t, "_local_tensor") else t
            try:
                storage = local.untyped_storage()
                key = storage._cdata  # the storage itself (a fake tensor's has no data pointer)
                if key not in self._seen and storage.nbytes():
                    self._seen.add(key)
                    self.bytes += storage.nbytes()
                    # once freed (a microbatch's backward done), a new storage may take its place and key
                    weakref.finalize(storage, self._seen.discard, key)
            except (RuntimeError, NotImplementedError):
                self.bytes += _nbytes(local)
        return t

    def __enter__(self) -> SavedActivations:
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)


class PeakMemory(TorchDispatchMode):
    """``with PeakMemory(existing) as m: step()`` then ``m.peak``: the most bytes of tensor storage alive
    at once while it was active, counting the storages of ``existing`` (parameters, optimizer state,
    inputs: what is alive before) once, and every storage an op makes until it is freed. It sees local
    tensors (a DTensor's shards) and fake tensors alike, so it gives a simulated rank's peak memory; it
    counts no allocator rounding, workspace or fragmentation."""

    def __init__(self, existing: list[torch.Tensor] = ()) -> None:
        super().__init__()
        from torch.distributed.tensor import DTensor

        self._dtensor = DTensor
        self._alive: set[int] = set()
        self._shadow = 0  # > 0 while DTensor derives an op's output shape on global-shape fake tensors
        self.live = self.peak = 0
        for t in existing:
            self._track(t, new=False)
        self.start = self.peak = self.live

    def __enter__(self):
        # DTensor (loss_parallel's handlers among others) finds an op's output shape by running it on
        # fake tensors of the global shape, in the fake mode active here: under the simulator's those
        # look like this rank's own tensors (a whole vocabulary's fp32 logits, 62 GiB for Llama-3-70B
        # at 131k tokens per rank). They hold no memory on a real rank: not counted.
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        self._propagator = ShardingPropagator
        self._derive = ShardingPropagator.__dict__.get("_propagate_tensor_meta_non_cached")
        if self._derive is not None:
            derive, mode = self._derive, self

            def shadowed(*args, **kwargs):
                mode._shadow += 1
                try:
                    return derive(*args, **kwargs)
                finally:
                    mode._shadow -= 1

            ShardingPropagator._propagate_tensor_meta_non_cached = shadowed
        return super().__enter__()

    def __exit__(self, *exc):
        if self._derive is not None:
            self._propagator._propagate_tensor_meta_non_cached = self._derive
        return super().__exit__(*exc)

    def _track(self, t, new: bool = True) -> None:
        if not isinstance(t, torch.Tensor):
            return
        local = t._local_tensor if isinstance(t, self._dtensor) else t
        storage = local.untyped_storage()
        key = storage._cdata
        if key in self._alive:
            return
        self._alive.add(key)
        n = storage.nbytes()
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, n)  # the storage's Python object lives as long as it does

    def _free(self, key: int, n: int) -> None:
        if key in self._alive:
            self._alive.discard(key)
            self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, self._dtensor) for t in types):
            return NotImplemented  # count the local ops DTensor turns this one into
        out = func(*args, **(kwargs or {}))
        if not self._shadow:
            for t in pytree.tree_leaves(out):
                self._track(t)
        return out
