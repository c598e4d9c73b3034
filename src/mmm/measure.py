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
* :class:`PeakMemory` follows every storage the local ops make and free: the step's peak memory.
* :class:`DeviceWork` counts the matrix multiplies' FLOPs and the bytes every other op reads and
  writes: the work of an eager step's compute-bound and memory-bound kernels.

Both see every op through a Python dispatch mode or hook, so they slow the step they watch: the
trainers use them on one warmup step (``--measure``) and never in timed steps.
"""

from __future__ import annotations

import functools
import weakref
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from mmm.parallel.context import traffic_axis

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
        ("all_to_all", ("alltoall", "all_to_all")),
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
    ``"other"``. An all-to-all whose sender names its axis (:func:`mmm.parallel.context.traffic_axis`: the
    experts' token exchange, ep's) is counted under that axis, whatever the group's name (ep over all of
    dp_shard: torch gives both one group).
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
            self._count(self._group_of(args), name, _nbytes(args[_C10D_PAYLOAD[name]]))
        elif ns in ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd") and name in _FUNCOL:
            payload = _nbytes(args[0])
            if name in _FUNCOL_GATHER:
                payload *= next((a for a in args[1:] if isinstance(a, int)), 1)
            self._count(self._group_of(list(args) + list(kwargs.values())), name, payload)
        return func(*args, **kwargs)

    def _count(self, group: str, op: str, payload: int) -> None:
        kind = _kind(op)
        if kind == "all_to_all":
            group = traffic_axis() or group
        self.bytes[group] += payload
        self.calls[group] += 1
        self.by_kind[(group, kind)] += payload

    def result(self) -> dict[str, int]:
        return dict(sorted(self.bytes.items()))


_TO_LOCAL = ("_ToTorchTensorBackward", "ToLocalBackward")  # DTensor.to_local's backward, by torch version


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, a view of one, or a view of a DTensor parameter's local tensor (``p.to_local()[e]``, as
    a mixture of experts' weights are used): storage the parameter's owner (FSDP) holds and frees, not the
    step's activations. Such a view's base is the DTensor's inner tensor (a leaf that needs no gradient)
    while the view needs one, through DTensor's ``to_local`` backward."""
    base = t._base if t._base is not None else t
    if base.is_leaf and base.requires_grad:
        return True
    if not (t.requires_grad and base.is_leaf):
        return False
    fn = t.grad_fn
    for _ in range(4):  # through the view ops between the weight and its local tensor
        if fn is None:
            return False
        if type(fn).__name__ in _TO_LOCAL:  # of a parameter (a leaf: AccumulateGrad), not of an activation
            return any(type(f).__name__ == "AccumulateGrad" for f, _ in fn.next_functions if f is not None)
        fn = fn.next_functions[0][0] if fn.next_functions else None
    return False


class SavedActivations:
    """``with SavedActivations() as s: loss = model(x)`` then ``s.bytes``: distinct saved storages; and
    ``s.peak_bytes``: the most of them alive at once (a backward frees what it used: under gradient
    accumulation, or a pipeline's microbatches, the peak is one microbatch's, the sum all of them)."""

    def __init__(self) -> None:
        self._seen: set[int] = set()
        self.bytes = self.peak_bytes = self._live = 0
        self._ctx = None

    def _freed(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self._live -= nbytes

    def _pack(self, t: torch.Tensor):
        if not _is_parameter(t):  # parameters (and views of them) are not activations
            local = t._local_tensor if hasattr(t, "_local_tensor") else t
            try:
                storage = local.untyped_storage()
                key = storage._cdata  # the storage itself (a fake tensor's has no data pointer)
                nbytes = storage.nbytes()
                if key not in self._seen and nbytes:
                    self._seen.add(key)
                    self.bytes += nbytes
                    self._live += nbytes
                    # once freed (a microbatch's backward done), a new storage may take its place and key
                    weakref.finalize(storage, self._freed, key, nbytes)
            except (RuntimeError, NotImplementedError):
                self.bytes += _nbytes(local)
                self._live += _nbytes(local)  # its freeing unseen: alive to the end
            self.peak_bytes = max(self.peak_bytes, self._live)
        return t

    def __enter__(self) -> SavedActivations:
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)


class _LocalOps(TorchDispatchMode):
    """A dispatch mode that sees the local ops a rank runs: a DTensor op is left to DTensor, which turns
    it into local ops and collectives; the ops DTensor runs to derive an op's output shape, on fake
    tensors of the global shape, are passed through unseen (:meth:`seen` is False). Under the
    simulator's fake mode those look like this rank's own tensors (a whole vocabulary's fp32 logits,
    62 GiB for Llama-3-70B at 131k tokens per rank), but a real rank never runs them."""

    def __init__(self) -> None:
        super().__init__()
        from torch.distributed.tensor import DTensor

        self._dtensor = DTensor
        self._shadow = 0  # > 0 while DTensor derives an op's output shape on global-shape fake tensors

    def __enter__(self):
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

    @property
    def seen(self) -> bool:
        return not self._shadow

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, self._dtensor) for t in types):
            return NotImplemented  # count the local ops DTensor turns this one into
        out = func(*args, **(kwargs or {}))
        if self.seen:
            self.local_op(func, args, kwargs or {}, out)
        return out

    def local_op(self, func, inputs, kwargs, out) -> None:
        raise NotImplementedError


class PeakMemory(_LocalOps):
    """``with PeakMemory(existing) as m: step()`` then ``m.peak``: the most bytes of tensor storage alive
    at once while it was active, counting the storages of ``existing`` (parameters, optimizer state,
    inputs: what is alive before) once, and every storage an op makes until it is freed or resized
    (FSDP2 frees a gathered block by resizing its buffer's storage to nothing and grows it again at the
    next all-gather: storage methods no dispatch mode sees, so ``UntypedStorage.resize_`` is watched
    while active). It sees local tensors (a DTensor's shards) and fake tensors alike, so it gives a
    simulated rank's peak memory; it counts no allocator rounding, workspace or fragmentation. With
    ``trace=True``, ``m.trace`` lists ``(op, bytes alive after it)`` from the start: where the peak is."""

    def __init__(self, existing: list[torch.Tensor] = (), trace: bool = False) -> None:
        super().__init__()
        self._alive: dict[int, int] = {}  # storage -> the bytes it holds now
        self.live = self.peak = 0
        for t in existing:
            self._track(t)
        self.start = self.peak = self.live
        self.trace: list[tuple[str, int]] | None = [("start", self.live)] if trace else None

    def _track(self, t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        local = t._local_tensor if isinstance(t, self._dtensor) else t
        self._track_storage(local.untyped_storage())

    def _track_storage(self, storage) -> None:
        key = storage._cdata
        if key in self._alive:
            return
        self._alive[key] = n = storage.nbytes()
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)  # the storage's Python object lives as long as it does

    def _free(self, key: int) -> None:
        self.live -= self._alive.pop(key, 0)

    def _resized(self, storage) -> None:
        key = storage._cdata
        if key not in self._alive:
            self._track_storage(storage)
        else:
            n = storage.nbytes()
            self.live += n - self._alive[key]
            self._alive[key] = n
            self.peak = max(self.peak, self.live)
        if self.trace is not None:
            self.trace.append(("resize_", self.live))

    def __enter__(self):
        self._resize = resize = torch.UntypedStorage.resize_
        mode = self

        def resize_(storage, size):
            out = resize(storage, size)
            mode._resized(storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def local_op(self, func, inputs, kwargs, out) -> None:
        for t in pytree.tree_leaves(out):
            self._track(t)
        if self.trace is not None:
            self.trace.append((func.__name__, self.live))


_ATEN_MATMUL = {"mm", "addmm", "bmm", "baddbmm"}  # (bias,) a, b
# attention kernels: compute-bound where they are fused (flash, memory-efficient, cuDNN): their FLOPs
# are in the model's count, their bytes are not memory traffic of the step's own
_ATTENTION_PREFIX = ("_scaled_dot_product_", "_flash_attention", "_efficient_attention", "_cudnn_attention")
# ops that move no bytes: allocation without a fill, and metadata
_NO_TRAFFIC = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "_unsafe_view", "detach"}
_NO_TRAFFIC |= {"lift_fresh", "set_", "resize_", "_local_scalar_dense"}


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    """The dtype a norm of ``dtype`` computes in (torch's: fp64 stays fp64, every other fp32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@functools.cache
def _fused_norm_ops():
    """``mmm_device::rms_norm`` and its backward: ``F.rms_norm`` as one kernel each way, as CUDA (and
    ROCm) run it (torch's ``_fused_rms_norm``: reads the input and weight, writes the output and the
    per-row ``rstd`` it keeps for backward), where a CPU process decomposes it into a handful of
    elementwise ops. Registered once, when first needed."""

    def dims(x: torch.Tensor, n: int) -> list[int]:
        return list(range(x.dim() - n, x.dim()))

    @torch.library.custom_op(
        "mmm_device::rms_norm",
        mutates_args=(),
        schema="(Tensor x, int n, Tensor? weight, float eps) -> (Tensor, Tensor)",
    )
    def rms_norm(x, n, weight, eps):  # as torch's: computed in the accumulation dtype, the output in x's
        xf = x.to(_accumulation(x.dtype))
        rstd = torch.rsqrt(xf.pow(2).mean(dims(x, n), keepdim=True) + eps)
        y = xf * rstd
        return (y if weight is None else y * weight.to(y.dtype)).to(x.dtype), rstd

    @rms_norm.register_fake
    def _(x, n, weight, eps):
        rstd_shape = [*x.shape[: x.dim() - n], *[1] * n]
        return x.new_empty(x.shape), x.new_empty(rstd_shape, dtype=_accumulation(x.dtype))

    @torch.library.custom_op(
        "mmm_device::rms_norm_backward",
        mutates_args=(),
        schema="(Tensor dy, Tensor x, Tensor rstd, int n, Tensor? weight) -> (Tensor, Tensor)",
    )
    def rms_norm_backward(dy, x, rstd, n, weight):
        acc = rstd.dtype
        xhat = x.to(acc) * rstd
        dxhat = dy.to(acc) * (1 if weight is None else weight.to(acc))
        dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(dims(x, n), keepdim=True))
        lead = list(range(x.dim() - n))
        dw = (dy.to(acc) * xhat).sum(lead) if weight is not None else x.new_empty(0)
        return dx.to(x.dtype), dw.to(weight.dtype) if weight is not None else dw

    @rms_norm_backward.register_fake
    def _(dy, x, rstd, n, weight):
        return x.new_empty(x.shape), (x.new_empty(0) if weight is None else weight.new_empty(weight.shape))

    def setup_context(ctx, inputs, output):
        x, n, weight, _ = inputs
        ctx.n = n
        ctx.save_for_backward(x, weight, output[1])
        ctx.mark_non_differentiable(output[1])  # rstd: no gradient to make (or to count)
        ctx.set_materialize_grads(False)

    def backward(ctx, dy, _drstd):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x, rstd, ctx.n, weight)
        return dx, None, (dw if weight is not None else None), None

    rms_norm.register_autograd(backward, setup_context=setup_context)
    return rms_norm


class FusedNorms:
    """While active (``with FusedNorms():``), ``torch.nn.functional.rms_norm`` on plain tensors runs as
    :func:`_fused_norm_ops`'s two ops, so the modes of :mod:`mmm.measure` see the step's norms as a GPU
    runs them: one kernel forward (its memory traffic, its output and ``rstd``), one backward, and what
    backward keeps (input, weight, ``rstd``). A DTensor sharded over its rows (a sequence-parallel norm)
    runs it on each rank's rows, its weight's gradient partial over them, as torch's DTensor rule for the
    fused norm does; other DTensor layouts keep torch's own path.
    The function itself is swapped (and put back on exit), not watched by a torch function mode: an
    activation checkpoint's recomputation in backward runs without those, and must see the same ops."""

    def __init__(self) -> None:
        self._real = None

    def __enter__(self):
        from torch.distributed.tensor import DTensor, Partial, Replicate

        real = self._real = F.rms_norm

        def rms_norm(input, normalized_shape, weight=None, eps=None):
            n = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
            eps = float(torch.finfo(_accumulation(input.dtype)).eps if eps is None else eps)
            if not any(isinstance(t, DTensor) for t in (input, weight)):
                return _fused_norm_ops()(input, n, weight, eps)[0]
            # a DTensor (a sequence-parallel norm): fused on each rank's rows, as torch's DTensor rule for
            # _fused_rms_norm runs it on a device; the weight's gradient is partial over the sharded rows
            if not isinstance(input, DTensor) or (weight is not None and not isinstance(weight, DTensor)):
                return real(input, normalized_shape, weight, eps)
            placements = input.placements
            whole = [p.is_shard() and p.dim % input.ndim >= input.ndim - n for p in placements]
            if any(whole) or any(p.is_partial() for p in placements):
                return real(input, normalized_shape, weight, eps)
            local_weight = None
            if weight is not None:
                if weight.device_mesh != input.device_mesh or not all(p.is_replicate() for p in weight.placements):
                    return real(input, normalized_shape, weight, eps)
                grads = [Partial() if p.is_shard() else Replicate() for p in placements]
                local_weight = weight.to_local(grad_placements=grads)
            out = _fused_norm_ops()(input.to_local(), n, local_weight, eps)[0]
            return DTensor.from_local(out, input.device_mesh, placements, run_check=False)

        F.rms_norm = rms_norm
        return self

    def __exit__(self, *exc) -> None:
        F.rms_norm = self._real


class DeviceWork(_LocalOps):
    """``with DeviceWork() as w: step()`` then ``w.matmul_flops`` and ``w.memory_bytes``: what the local
    ops of a rank's step ask of its device. Matrix multiplies (and fused attention) count their FLOPs
    (``2 m n k``); every other op that computes (elementwise, norms, softmax, casts, copies, the
    optimizer's updates, embedding lookups) counts the bytes it reads and writes: the traffic an eager
    step's memory-bound kernels move through device memory. Views and allocations move nothing;
    collectives are :class:`CommCounter`'s. Under ``torch.compile`` fused kernels move less.

    ``fused_norms`` (the default): ``F.rms_norm`` counts as the accelerator's one fused kernel each way
    (:class:`FusedNorms`, entered with this mode), not as the elementwise ops a CPU process splits it
    into: this counts the step a GPU runs."""

    def __init__(self, fused_norms: bool = True) -> None:
        super().__init__()
        self.matmul_flops = 0
        self.memory_bytes = 0
        self.bytes_by_op: dict[str, int] = defaultdict(int)
        self._norms = FusedNorms() if fused_norms else None

    def __enter__(self):
        if self._norms is not None:
            self._norms.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            if self._norms is not None:
                self._norms.__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self._norms is not None:
                self._norms.__exit__(*exc)

    def local_op(self, func, inputs, kwargs, out) -> None:
        if isinstance(func, torch._ops.HigherOrderOperator) or func.namespace not in ("aten", "mmm_device"):
            return  # collectives (c10d), and what the ops inside a higher-order op count themselves
        name = func._schema.name.split("::")[-1]
        if name in _ATEN_MATMUL:
            a, b = (inputs[1], inputs[2]) if name.startswith(("add", "badd")) else (inputs[0], inputs[1])
            self.matmul_flops += 2 * a.numel() * b.shape[-1]
            return
        if name.startswith(_ATTENTION_PREFIX) or name in _NO_TRAFFIC or func.is_view:
            return
        read = {id(t): _local_bytes(t) for t in pytree.tree_leaves((inputs, kwargs)) if isinstance(t, torch.Tensor)}
        written = {id(t): _local_bytes(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)}
        for i, arg in enumerate(func._schema.arguments):  # in place: the tensors it writes (foreach ops return None)
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(inputs) else inputs[i]
                written |= {id(t): _local_bytes(t) for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)}
        if name in ("copy_", "fill_", "zero_", "normal_", "uniform_"):  # writes its destination, never reads it
            read.pop(id(inputs[0]), None)
        n = sum(read.values()) + sum(written.values())
        self.memory_bytes += n
        self.bytes_by_op[name] += n


def _local_bytes(t: torch.Tensor) -> int:
    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    return local.numel() * local.element_size()
