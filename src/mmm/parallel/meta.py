"""Models larger than one device: build on ``meta``, shard, then materialise only this rank's shards.

    from mmm.parallel import init_mesh, meta_init, parallelize
    with meta_init():                       # parameters on `meta` (no memory), buffers real
        model = Llama(cfg)
    model = parallelize(model, mesh, spec, seed=0)   # shards, then materialises + initialises here

Initialisation is **mesh-invariant**: every parameter's values depend only on the seed and the
parameter's name (``layers.3.attention.wq.weight``), never on the mesh, the rank count or the
order parameters are created in. :func:`materialize` makes one parameter at a time: it builds the
full tensor on the device, seeds the RNG from (seed, name), runs the model's own initialisation
on it while every other parameter is a ``meta`` placeholder (so nothing else is touched and no
random numbers are drawn for them), keeps this rank's shard and drops the rest. No rank ever holds
more than one full parameter.

How a model says how it is initialised, first match wins:

1. ``init(module)`` passed by the caller: called for the module that owns each parameter;
2. a Hugging Face ``PreTrainedModel``: its ``_init_weights(module)``, per owning module;
3. ``model.init_weights()`` (torchtitan's convention): called once per parameter (every other
   parameter is on ``meta`` then, so the call is cheap); it must also work on a pipeline stage,
   where the modules outside the stage are ``nn.Identity``;
4. otherwise each owning module's ``reset_parameters()`` (``nn.Linear``, ``nn.Conv2d``, norms...);
   a parameter whose owner has none is an error naming it.

Buffers (rotary tables, running statistics) keep the values the constructor computed
(``meta_init`` leaves them real) and move to the device; the initialisation never sees them.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from mmm.dist.device import return_freed_host_memory
from mmm.errors import UsageError

# wrapper modules that insert a name component: activation checkpointing, torch.compile
WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod")


# the in-place initialisers a constructor calls: on a meta tensor they have nothing to fill
_INITIALISERS = frozenset(
    [getattr(nn.init, n) for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")]
    + [getattr(torch.Tensor, n) for n in ("normal_", "uniform_", "random_", "bernoulli_", "fill_", "zero_")]
    + [getattr(torch.Tensor, n) for n in ("exponential_", "log_normal_", "cauchy_", "geometric_", "copy_")]
)


class _SkipMetaInit(torch.overrides.TorchFunctionMode):
    """Initialisers on meta tensors return at once. On meta, torch runs their random ones through its
    Python reference kernels, whose first call imports torch._dynamo (~0.5 s of CPU a process)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INITIALISERS:  # nn.init's pass the tensor by keyword
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_init() -> Iterator[None]:
    """Build a model with every parameter on ``meta`` (no memory, no initialisation work) and
    every buffer real, as its constructor computes it. Use :func:`materialize` (or pass ``seed``
    to :func:`mmm.parallel.parallelize`) to give the parameters values after sharding."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        with _SkipMetaInit():  # the constructor's initialisation of the parameters it registered: nothing to do
            yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def count_params(build: Callable[[], nn.Module]) -> int:
    """Parameters of the model ``build()`` makes, built wholly on the meta device: no memory at all (under
    :func:`meta_init` each parameter passes through host memory first), buffers left uncomputed and
    initialisers skipped."""
    with torch.device("meta"), _SkipMetaInit():
        return sum(p.numel() for p in build().parameters())


def has_meta_params(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def param_seed(seed: int, name: str) -> int:
    """The RNG seed of parameter ``name``: a hash of (seed, name), the same on every rank and mesh."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def canonical_name(name: str) -> str:
    """A parameter's name in the plain model: wrapper components (checkpoint, compile) dropped."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)


def initializer(model: nn.Module, init: Callable[[nn.Module], None] | None = None) -> Callable[[nn.Module], None]:
    """``fn(owner)`` that initialises the parameters of ``owner`` (see the module doc for the order)."""
    if init is not None:
        return init
    hf_init = getattr(model, "_init_weights", None)
    if callable(hf_init) and hasattr(model, "config"):
        return hf_init
    whole = getattr(model, "init_weights", None)
    if callable(whole):
        return lambda _owner: whole()

    def reset(owner: nn.Module) -> None:
        owner.reset_parameters()

    return reset


def _owned(model: nn.Module) -> dict[int, tuple[str, nn.Module, list[tuple[nn.Module, str]]]]:
    """id(parameter) -> (canonical name, owning module, every (module, attribute) slot holding it)."""
    out: dict[int, tuple[str, nn.Module, list[tuple[nn.Module, str]]]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for key, p in mod._parameters.items():
            if p is None:
                continue
            if id(p) not in out:
                out[id(p)] = (canonical_name(f"{mod_name}.{key}" if mod_name else key), mod, [])
            out[id(p)][2].append((mod, key))
    return out


def _buffer_slots(model: nn.Module) -> list[tuple[nn.Module, str]]:
    return [(mod, key) for mod in model.modules() for key, b in mod._buffers.items() if b is not None]


def _placeholder(t: torch.Tensor) -> torch.Tensor:
    """A ``meta`` tensor of ``t``'s global shape (what the model's own code sees when it initialises)."""
    shape = t.shape  # a DTensor's shape is the global one
    meta = torch.empty(shape, dtype=t.dtype, device="meta")
    return nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta


def local_shard(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` laid out as ``like`` (a DTensor's local shard; a plain tensor: all)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


@torch.no_grad()
def materialize(
    model: nn.Module, *, device: torch.device | str, seed: int, init: Callable[[nn.Module], None] | None = None
) -> nn.Module:
    """Give a model built under :func:`meta_init` (and sharded, or not) real parameters on
    ``device``: this rank's shards only, each initialised from ``seed`` and its name. Returns it.
    ``device="meta"`` leaves the sharded model on meta, shapes and placements exact but no memory
    (a simulated rank, :mod:`mmm.plan.simulate`)."""
    from torch.distributed.tensor import DTensor

    device = torch.device(device)
    params = list(model.parameters())
    if not any(p.is_meta for p in params) or device.type == "meta":
        return model
    real = [n for n, p in model.named_parameters() if not p.is_meta]
    if real:
        raise UsageError(
            f"materialize() needs every parameter on meta, but {', '.join(real[:3])} "
            f"{'is' if len(real) == 1 else 'are'} already real; build the whole model under meta_init()"
        )
    meta_buffers = [n for n, b in model.named_buffers() if b.is_meta]
    if meta_buffers:
        raise UsageError(
            f"buffer {meta_buffers[0]} is on meta, so its value is lost; build the model under "
            "mmm.parallel.meta_init() (parameters on meta, buffers computed as usual)"
        )
    init_fn = initializer(model, init)
    if device.type == "cpu":  # a large model on host memory: have freed tensors returned at once
        return_freed_host_memory(sum(p.numel() * p.element_size() for p in params))
    saved = {(id(m), k): m._buffers[k] for m, k in _buffer_slots(model)}
    ties = [slots for _, _, slots in _owned(model).values() if len(slots) > 1]
    model.to_empty(device=device)
    for slots in ties:  # to_empty gives every holder of a shared plain parameter its own copy: re-tie
        first = slots[0][0]._parameters[slots[0][1]]
        for mod, key in slots[1:]:
            mod._parameters[key] = first
    owned = _owned(model)
    buffers = _buffer_slots(model)
    holders = {i: _placeholder(slots[0][0]._parameters[slots[0][1]]) for i, (_, _, slots) in owned.items()}
    actual = {i: slots[0][0]._parameters[slots[0][1]] for i, (_, _, slots) in owned.items()}
    real_buffers = {(id(m), k): m._buffers[k] for m, k in buffers}

    def put(i: int, value: torch.Tensor) -> None:
        for mod, key in owned[i][2]:
            mod._parameters[key] = value

    try:
        for i in owned:
            put(i, holders[i])
        for mod, key in buffers:
            mod._buffers[key] = _placeholder(mod._buffers[key])
        devices = [device] if device.type != "cpu" else []
        with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
            for i, (name, owner, _) in owned.items():
                target = actual[i]
                full = nn.Parameter(
                    torch.full(target.shape, math.nan, dtype=target.dtype, device=device)
                    if target.is_floating_point()
                    else torch.zeros(target.shape, dtype=target.dtype, device=device),
                    requires_grad=target.requires_grad,
                )
                put(i, full)
                torch.manual_seed(param_seed(seed, name))
                try:
                    with _SkipMetaInit():  # the other parameters are placeholders: nothing to fill
                        init_fn(owner)
                except AttributeError as err:
                    if "reset_parameters" in str(err):
                        raise UsageError(
                            f"{name} has no initialiser: {own_class(owner)} has no reset_parameters(); "
                            "give the model an init_weights() method, or parallelize(..., init=fn)"
                        ) from None
                    raise
                put(i, holders[i])
                if full.is_floating_point() and bool(full.isnan().any()):
                    raise UsageError(
                        f"{name} was not initialised by {describe_init(model, init)}; make it "
                        "initialise every parameter (or pass init=)"
                    )
                local = target.to_local() if isinstance(target, DTensor) else target
                local.copy_(local_shard(full.data, target))
                del full
            for mod, key in buffers:  # buffers: the values computed at construction
                real_buffers[(id(mod), key)].copy_(saved[(id(mod), key)])
    finally:
        for i in owned:
            put(i, actual[i])
        for mod, key in buffers:
            mod._buffers[key] = real_buffers[(id(mod), key)]
    return model


def describe_init(model: nn.Module, init: Any = None) -> str:
    """Which initialisation :func:`materialize` will run for ``model`` (for logs)."""
    if init is not None:
        return f"{getattr(init, '__qualname__', init)!s}(module)"
    if callable(getattr(model, "_init_weights", None)) and hasattr(model, "config"):
        return f"{type(model).__name__}._init_weights(module)"
    if callable(getattr(model, "init_weights", None)):
        return f"{type(model).__name__}.init_weights()"
    return "reset_parameters() of each module"


def own_class(module: nn.Module) -> str:
    """The name of ``module``'s own class, not the ``FSDP<name>`` class FSDP2 swaps in (made in its module)."""
    return next(c for c in type(module).__mro__ if not c.__module__.startswith("torch.distributed.fsdp")).__name__
