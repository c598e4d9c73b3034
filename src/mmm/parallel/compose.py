"""One composition path: TP -> activation checkpointing -> compile -> FSDP2 / HSDP / DDP.

Every model mmm trains goes through :func:`parallelize`, and so does every pipeline stage::

    from mmm.parallel import ParallelSpec, init_mesh, parallelize
    mesh = init_mesh(tp=2)                                   # dp_shard inferred
    spec = ParallelSpec(tp_plan={"layers.*.attn.q": "colwise", "layers.*.attn.o": "rowwise"},
                        ac="selective", dtype="bf16", dp="fsdp")
    model = parallelize(model, mesh, spec)                   # a plain nn.Module in, the same module out

What a spec says, and what happens, in this order:

1. ``tp_plan`` (module-name patterns -> ``ParallelStyle`` or its short name, see
   :mod:`mmm.parallel.tensor`) shards the model over ``mesh["tp"]``; ``ep_plan`` (patterns ->
   ``"experts"``, :mod:`mmm.parallel.experts`) splits a mixture of experts' routed experts over
   ``mesh["ep"]``;
2. ``blocks`` (the repeated blocks: an attribute path such as ``"model.layers"``, or ``"auto"``:
   the ``ModuleList``/``ModuleDict`` of same-typed modules holding the most parameters) are each
   wrapped for activation checkpointing (``ac``: full or selective);
3. ... and compiled (``compile``);
4. data parallel (``dp``): ``fsdp`` shards every block, then the root, over the dp (x cp) ranks;
   ``hsdp`` over the 2-D (dp_replicate, dp_shard) mesh; ``ddp`` replicates; ``none`` leaves it. Routed
   experts split by ``ep_plan`` are sharded over ``mesh["efsdp"]`` first, their gradients divided by all
   of dp_shard x cp.
   ``dtype`` bf16/fp16 keeps fp32 master weights: under fsdp/hsdp as FSDP2's mixed-precision policy
   (fp32 gradient reduction), on a mesh of one data-parallel rank too (FSDP2 then shards nothing and
   only makes the bf16 copies); under ddp/none as an autocast around the model's forward (DDP has no
   compute copies of its own).

Nothing is silently dropped: :func:`compose_problems` names every option the mesh or the model
cannot honour, and :func:`parallelize` raises them as one :class:`mmm.errors.UsageError`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mmm.errors import API, Spelling, UsageError
from mmm.log import get_logger
from mmm.parallel.activation_checkpoint import AC_MODES, wrap_block
from mmm.parallel.context import RingAttention
from mmm.parallel.experts import apply_ep, expert_modules
from mmm.parallel.float8 import apply_float8, float8_device_problem, float8_problems
from mmm.parallel.fsdp import DTYPES, apply_ddp, apply_fsdp
from mmm.parallel.mesh import Mesh, ParallelDims
from mmm.parallel.meta import has_meta_params, materialize
from mmm.parallel.tensor import apply_tp_plan, resolve_plan

DP_MODES = ("fsdp", "hsdp", "ddp", "none")
log = get_logger("parallel")


@dataclass
class ParallelSpec:
    """How to parallelise a model (see the module doc for the order they are applied in)."""

    tp_plan: Mapping[str, Any] | None = None
    """Module-name patterns (``*`` = one name) -> ``ParallelStyle`` or colwise/rowwise/...; needed when tp > 1."""
    loss_parallel: bool = False
    """The plan leaves the logits sharded over the vocabulary: the loss runs under ``loss_parallel()``."""
    blocks: str | None = "auto"
    """Path of the repeated blocks ("layers", "model.layers"), "auto" to find them, None for none."""
    ac: str = "none"
    """Activation checkpointing of each block: none, full, selective."""
    compile: bool = False
    """torch.compile each block."""
    dtype: str = "fp32"
    """Compute dtype: fp32, bf16, fp16 (master weights and gradient reduction stay fp32)."""
    float8: bool = False
    """The linear layers' matmuls in float8 (torchao; CUDA 8.9+, bf16 dtype, tp 1), the heads left in bf16
    (:mod:`mmm.parallel.float8`)."""
    dp: str = "fsdp"
    """Data parallel: fsdp, hsdp, ddp, none."""
    reshard_after_forward: bool | None = None
    """FSDP: free gathered parameters after forward; None: every block but the root."""
    allow_missing: bool = False
    """A TP pattern may match nothing (set for pipeline stages, which hold part of the model)."""
    ep_plan: Mapping[str, str] | None = None
    """Module-name patterns -> "experts": the routed experts split over ep (needed when ep > 1)."""

    def replace(self, **changes) -> ParallelSpec:
        return dataclasses.replace(self, **changes)


def compose_problems(spec: ParallelSpec, dims: ParallelDims) -> list[str]:
    """Every option of ``spec`` this mesh cannot honour, each naming the value and a fix."""
    out = dp_problems(spec.dp, dims) + spec_problems(spec, dims)
    if spec.reshard_after_forward is not None and not fsdp_wraps(dims, spec.dp, spec.dtype):
        out.append(
            f"reshard_after_forward={spec.reshard_after_forward} is an FSDP option, but FSDP does not wrap "
            f"here (dp={spec.dp}, dp={dims.dp}, cp={dims.cp}, dtype={spec.dtype}); drop it"
        )
    return out


def spec_problems(spec: ParallelSpec, dims: ParallelDims) -> list[str]:
    """Problems with the options other than the data-parallel mode's fit to the mesh."""
    out = []
    if spec.ac not in AC_MODES:
        out.append(f"unknown activation checkpointing ac={spec.ac!r}; choose one of {', '.join(AC_MODES)}")
    if spec.dtype not in DTYPES:
        out.append(f"unknown dtype {spec.dtype!r}; choose one of {', '.join(DTYPES)}")
    if dims.tp > 1 and not spec.tp_plan:
        out.append(f"tp={dims.tp} but the spec has no tp_plan; give one (module-name patterns -> styles)")
    if dims.ep > 1 and not spec.ep_plan:
        out.append(
            f"ep={dims.ep} but the spec has no ep_plan: give one naming the model's experts modules "
            "(mmm.parallel.experts; a transformers mixture: ep_plan=hf_ep_plan(model)), or ep=1"
        )
    if dims.ep > 1 and spec.dp == "none":  # (ddp: dp_problems; hsdp: the mesh's check)
        out.append(f"ep={dims.ep} needs dp='fsdp' (got dp={spec.dp!r}): the experts are sharded over what remains")
    out += float8_problems(spec.float8, tp=dims.tp, dtype=spec.dtype, strategy=spec.dp)
    out += ac_problems(spec.ac, dims)
    return out + compile_problems(spec.compile, dims)


def compile_problems(compile: bool, dims: ParallelDims, *, spell: Spelling = API) -> list[str]:
    out = []
    if compile and dims.tp > 1:
        out.append(
            f"{spell('compile', True)} with {spell('tp', dims.tp)} is not supported with torch {torch.__version__}: "
            "the compiled blocks' DTensor backward fails (AttributeError in DTensor redistribute); drop "
            f"{spell.name('compile')}, or compile with tp=1 (FSDP/DDP/ZeRO)"
        )
    if compile and dims.ep > 1:
        out.append(
            f"{spell('compile', True)} with {spell('ep', dims.ep)} is not supported with torch {torch.__version__}: "
            "the compiled blocks mix the experts' DTensor weights with plain tensors (aten.mm); drop "
            f"{spell.name('compile')}, or compile with {spell('ep', 1)}"
        )
    return out


def ac_problems(ac: str, dims: ParallelDims, *, schedule: str | None = None, spell: Spelling = API) -> list[str]:
    """Activation checkpointing this mesh (and pipeline ``schedule``, when given) cannot run with."""
    if ac != "selective":
        return []
    out = []
    if dims.ep > 1 and dims.efsdp == 1:  # (with efsdp > 1 it runs: an equivalence row)
        smaller = [d for d in range(dims.ep - 1, 0, -1) if not dims.ep % d][:2]
        out.append(
            f"{spell('ac', ac)} with {spell('ep', dims.ep)} fails in backward with torch {torch.__version__} when ep "
            f"takes every one of the dp_shard x cp = {dims.ep} ranks (the experts' FSDP unit over a mesh of one, "
            f"inside a selective-checkpoint region); use {spell('ac', 'full')}, or "
            + " or ".join(spell("ep", d) for d in smaller)
        )
    if schedule == "interleaved-zb" and dims.pp > 1:
        out.append(
            f"{spell('ac', ac)} with {spell('schedule', schedule)}: the zero-bubble schedule runs each block's "
            "backward twice (input, then weight gradients), which selective checkpointing refuses; use "
            f"{spell('ac', 'full')} or another schedule"
        )
    return out


def dp_problems(dp: str, dims: ParallelDims, *, field: str = "dp", spell: Spelling = API) -> list[str]:
    """How a torch data-parallel mode must fit the mesh ("none": the caller, e.g. DeepSpeed, reduces
    gradients itself). ``field`` is the setting that chose the mode: ``ParallelSpec.dp``, or
    ``strategy`` (:func:`mmm.parallel.strategy.strategy_problems`)."""
    if dp not in DP_MODES:
        return [f"unknown data-parallel mode {spell(field, dp)}; choose one of {', '.join(DP_MODES)}"]
    out = []
    if dp == "hsdp" and dims.cp > 1:
        out.append(f"{spell(field, dp)} with cp={dims.cp} is not supported yet; use {spell(field, 'fsdp')} with cp")
    if dp == "hsdp" and not (dims.dp_replicate > 1 and dims.dp_shard > 1):
        out.append(
            f"{spell(field, dp)} needs dp_replicate > 1 and dp_shard > 1 (got dp_replicate={dims.dp_replicate}, "
            f"dp_shard={dims.dp_shard}); set "
            + " and ".join(spell.name(a) for a in ("dp_replicate", "dp_shard") if getattr(dims, a) == 1)
            + f", or use {spell(field, 'fsdp')}"
        )
    if dp == "fsdp":
        out += flat_dp_problems(dp, dims, field=field, spell=spell)
    bad = {k: v for k, v in {"tp": dims.tp, "cp": dims.cp, "pp": dims.pp}.items() if v > 1}
    if dp == "ddp" and dims.ep > 1:
        out.append(
            f"{spell(field, dp)} with {spell('ep', dims.ep)}: DDP replicates every parameter, and expert parallel "
            f"splits the experts over the data-parallel ranks; use {spell(field, 'fsdp')}, or {spell('ep', 1)} "
            "(DDP with replicated experts)"
        )
    if dp == "ddp" and bad:
        out.append(
            f"{spell(field, dp)} does not compose with tp/cp/pp (got {', '.join(spell(k, v) for k, v in bad.items())})"
            f": DDP cannot hold sharded (DTensor) parameters; use {spell(field, 'fsdp')}"
        )
    return out


def flat_dp_problems(mode: str, dims: ParallelDims, *, field: str = "dp", spell: Spelling = API) -> list[str]:
    """A mode that shards over all data-parallel ranks as one group (fsdp; the ZeRO strategies) has no
    replicate axis: ``dp_replicate > 1`` is hsdp's."""
    if dims.dp_replicate > 1:
        return [
            f"{spell(field, mode)} shards over all data-parallel ranks; "
            f"{spell('dp_replicate', dims.dp_replicate)} needs {spell(field, 'hsdp')}"
        ]
    return []


def shards_parameters(dims: ParallelDims, dp: str) -> bool:
    """FSDP2 wraps the model (and so handles mixed precision) with fsdp/hsdp when dp or cp > 1
    (CP ranks hold the same parameters and average gradients like data-parallel ones)."""
    return dp in ("fsdp", "hsdp") and (dims.dp > 1 or dims.cp > 1)


def fsdp_wraps(dims: ParallelDims, dp: str, dtype: str = "fp32") -> bool:
    """FSDP2 wraps the model: to shard it (:func:`shards_parameters`), or, with a single data-parallel
    rank, for its mixed precision alone (bf16/fp16 compute copies of the fp32 weights, made once per
    forward; the whole forward then runs in bf16, where an autocast would keep fp32 activations)."""
    return shards_parameters(dims, dp) or (dp in ("fsdp", "hsdp") and dtype != "fp32")


def data_parallel_mesh(mesh: Mesh, dp: str):
    """The mesh FSDP shards over: 1-D ``dp`` (``dp_cp`` with context parallel) for fsdp/ddp, 2-D
    (dp_replicate, dp_shard) for hsdp."""
    if not (mesh.dp_enabled or mesh.cp_enabled):  # one data-parallel rank: FSDP for mixed precision only
        return mesh.one_rank_dp()
    if dp == "hsdp":
        return mesh.root["dp_replicate", "dp_shard"]
    return mesh.get("dp_cp") if mesh.cp_enabled else mesh.get("dp")


# --------------------------------------------------------------------------- blocks
def get_submodule(model: nn.Module, path: str) -> nn.Module | None:
    """``model.a.b`` for ``"a.b"`` (None when absent); ``""`` is the model itself."""
    mod: Any = model
    for part in filter(None, path.split(".")):
        mod = getattr(mod, part, None)
        if mod is None:
            return None
    return mod


def find_blocks(model: nn.Module, blocks: str | None = "auto") -> str | None:
    """The path of the model's repeated blocks: ``blocks`` itself when given (checked), or for
    "auto" the ``ModuleList``/``ModuleDict``/``Sequential`` (not the model itself) of modules of one type
    that holds the most parameters (None when the model has none, e.g. a small CNN: FSDP then shards
    the model as one unit)."""
    if blocks is None:
        return None
    if blocks != "auto":
        found = get_submodule(model, blocks)
        if not isinstance(found, BLOCK_CONTAINERS):
            what = "nothing" if found is None else type(found).__name__
            auto = find_blocks(model, "auto")
            raise UsageError(
                f"blocks={blocks!r} names {what} in {type(model).__name__}; it must name the "
                "ModuleList, ModuleDict or Sequential of repeated blocks (or use blocks='auto'"
                + (f", which finds {auto!r})" if auto else ")")
            )
        return blocks
    best, best_params = None, 0
    for name, mod in model.named_modules():
        if isinstance(mod, BLOCK_CONTAINERS) and len(mod) > 0 and name:
            children = [b for _, b in block_items(mod)]
            if len({type(c) for c in children}) != 1:
                continue
            n = sum(p.numel() for p in mod.parameters())
            if n > best_params:
                best, best_params = name, n
    return best


BLOCK_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def block_items(container: nn.Module) -> list[tuple[Any, nn.Module]]:
    """(key, block) pairs of a ModuleDict, Sequential (its names) or ModuleList (its indices)."""
    if isinstance(container, (nn.ModuleDict, nn.Sequential)):
        return list(container.named_children())
    return list(enumerate(container))


# --------------------------------------------------------------------------- the composition
def _no_kv_cache(model: nn.Module) -> None:
    """A transformers model keeps a key/value cache in forward unless its ``config.use_cache`` is off (on by
    default); under activation checkpointing the recomputation in backward then sees longer keys than the
    forward did (torch: "... encountered during backward but not found in storage"). Training reads no
    cache: it is turned off, as transformers' own gradient checkpointing does."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False) is True:
        config.use_cache = False
        log.info(
            "%s: config.use_cache turned off (activation checkpointing recomputes without a cache)",
            type(model).__name__,
        )


def _cp_attention_missing(model: nn.Module) -> bool:
    """Whether ``model`` has attention hooks (``attn_fn``) and :func:`mmm.parallel.context.context_parallel` put
    its attention into none of them (a model without the hook shards its sequence its own way: not judged)."""
    hooks = [m.attn_fn for m in model.modules() if hasattr(m, "attn_fn")]
    return bool(hooks) and not any(isinstance(h, RingAttention) for h in hooks)


def parallelize(
    model: nn.Module,
    mesh: Mesh,
    spec: ParallelSpec | None = None,
    *,
    device: torch.device | None = None,
    seed: int | None = None,
    init: Callable[[nn.Module], None] | None = None,
    **options,
) -> nn.Module:
    """Apply ``spec`` (or ``ParallelSpec(**options)``) to ``model`` in place, in the fixed order
    TP -> AC -> compile -> FSDP/HSDP/DDP; returns the model to train (DDP wraps it; otherwise the
    same module, its parameters now DTensors where sharded).

    A model built under :func:`mmm.parallel.meta_init` is sharded while on ``meta`` and then
    materialised on ``device``: only this rank's shards, each parameter initialised from ``seed``
    and its name (:func:`mmm.parallel.meta.materialize`; ``init`` overrides the model's own
    initialisation)."""
    if not isinstance(model, nn.Module):
        raise UsageError(f"parallelize() takes an nn.Module, not a {type(model).__name__}")
    if not hasattr(mesh, "dims"):
        raise UsageError(
            f"parallelize() takes the mesh init_mesh() returns, not a {type(mesh).__name__} (an axis such as "
            "mesh['dp'] is one): pass the whole mesh"
        )
    if spec is not None and not isinstance(spec, ParallelSpec):
        raise UsageError(
            f"spec is a {type(spec).__name__}; give a ParallelSpec(...), or the options as keywords "
            "(parallelize(model, mesh, tp_plan=...))"
        )
    if getattr(model, "_mmm_parallelized", False):
        raise UsageError(
            f"{type(model).__name__} went through parallelize() already; build a fresh model for another layout"
        )
    spec = (spec or ParallelSpec()).replace(**options) if options else (spec or ParallelSpec())
    problems = compose_problems(spec, mesh.dims)
    on_meta = has_meta_params(model)
    missing = [f"{k}=" for k, v in (("device", device), ("seed", seed)) if v is None] if on_meta else []
    if missing:  # (the weights depend on the seed and each parameter's name)
        problems.append(
            f"{type(model).__name__} is on the meta device: pass {' and '.join(missing)} so parallelize() can "
            "materialise its shards (on the device) and initialise them (from the seed and each parameter's name)"
        )
    if mesh.dims.cp > 1 and _cp_attention_missing(model):  # each cp rank would attend to its own tokens only
        problems.append(
            f"the mesh has cp={mesh.dims.cp} but {type(model).__name__}'s attention is not context parallel: call "
            "mmm.parallel.context_parallel(model, mesh['cp'], seq_len=S) before parallelize()"
        )
    if problems:
        raise UsageError("; ".join(problems))
    if spec.float8:  # before the blocks are wrapped and compiled: their linear layers swapped in place
        problem = float8_device_problem(device or _param_device(model))
        if problem:
            raise UsageError(problem)
        log.info("float8: %d linear layers converted", len(apply_float8(model)))
    if mesh.tp_enabled:
        apply_tp_plan(model, mesh["tp"], spec.tp_plan, allow_missing=spec.allow_missing)
    elif spec.tp_plan:
        resolve_plan(model, spec.tp_plan, allow_missing=spec.allow_missing)  # a bad plan fails at tp=1 too
    experts = []
    if spec.ep_plan and (mesh.ep_enabled or mesh.tp_enabled):  # split over ep, and their width over tp
        experts = apply_ep(model, mesh, spec.ep_plan, allow_missing=spec.allow_missing)
    elif spec.ep_plan:
        expert_modules(model, spec.ep_plan, allow_missing=spec.allow_missing)  # checked at ep=1 too
    path = find_blocks(model, spec.blocks)
    blocks = get_submodule(model, path) if path is not None else None
    if spec.ac != "none":
        _no_kv_cache(model)
    units = []
    if blocks is not None:
        for key, block in block_items(blocks):
            block = wrap_block(block, spec.ac)
            if spec.compile:
                block = torch.compile(block)
            setattr(blocks, str(key), block)  # in place, whatever the container
            units.append(block)
    elif spec.ac != "none" or spec.compile:
        raise UsageError(
            f"{type(model).__name__} has no repeated blocks to checkpoint or compile (ac={spec.ac}, "
            f"compile={spec.compile}); name them with blocks='...'"
        )
    param_dtype = DTYPES[spec.dtype]
    if fsdp_wraps(mesh.dims, spec.dp, spec.dtype):
        reshard = spec.reshard_after_forward
        if reshard is None and not shards_parameters(mesh.dims, spec.dp):
            reshard = False  # one rank: FSDP only casts; backward uses the forward's bf16 copies, as under autocast
        apply_fsdp(
            model,
            data_parallel_mesh(mesh, spec.dp),
            blocks=units,
            param_dtype=param_dtype,
            reshard_after_forward=reshard,
            experts=experts if mesh.get("efsdp") is not None else [],  # without ep: units of their blocks
            experts_mesh=mesh.get("efsdp"),
            experts_divide=mesh.size("dp_shard_cp"),
        )
        return _parallelized(materialize(model, device=device, seed=seed, init=init) if on_meta else model)
    if on_meta:  # before DDP, which broadcasts real parameters when it wraps
        materialize(model, device=device, seed=seed, init=init)
    if param_dtype != torch.float32:
        autocast_forward(model, param_dtype, device_type=(device or _param_device(model)).type)
    if spec.dp == "ddp" and mesh.dp_enabled:
        return _parallelized(apply_ddp(model, mesh["dp"], device=device or _param_device(model)), model)
    return _parallelized(model)


def _parallelized(result: nn.Module, model: nn.Module | None = None) -> nn.Module:
    """Mark a model parallelize() has finished with (and the wrapper it returns): a second call would stack
    its plans on the changed modules. A call that failed on a check leaves the model unmarked."""
    for m in (result, model):
        if m is not None:
            m._mmm_parallelized = True
    return result


def _param_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _tensor_device_type(values) -> str:
    """The device type of the first tensor among ``values`` (cpu if none)."""
    return next((v.device.type for v in values if isinstance(v, torch.Tensor)), "cpu")


def mixed_precision(model: nn.Module) -> str:
    """How ``model`` (after :func:`parallelize`) computes in a lower precision: ``fsdp`` (FSDP2's compute
    copies), ``autocast``, or ``none``."""
    from torch.distributed.fsdp import FSDPModule

    roots = getattr(model, "parts", None) or [model]  # a pipeline's StageSet: its stages
    for module in (m for root in roots for m in root.modules()):
        if getattr(module.forward, "mmm_autocast", False):
            return "autocast"
        if isinstance(module, FSDPModule):
            policy = module._get_fsdp_state()._mp_policy
            if policy.param_dtype not in (None, torch.float32):
                return "fsdp"
    return "none"


def autocast_forward(model: nn.Module, dtype: torch.dtype, *, device_type: str) -> nn.Module:
    """Run ``model.forward`` under ``torch.autocast(dtype)`` (parameters stay fp32); names unchanged."""
    forward = model.forward

    @functools.wraps(forward)
    def run(*args, **kwargs):
        # a model parallelized on meta (the planner's) runs where its inputs are
        where = device_type if device_type != "meta" else _tensor_device_type((*args, *kwargs.values()))
        with torch.autocast(where, dtype=dtype):
            return forward(*args, **kwargs)

    run.mmm_autocast = True
    model.forward = run
    return model
