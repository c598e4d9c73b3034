"""Apply a parallelism recipe to a model, in torchtitan's order: TP -> activation checkpointing
-> compile -> data parallel (FSDP2 / HSDP / DDP).

Each step calls one generic helper; this file holds only the order and the checks of
which strategies compose with which mesh.
"""

from __future__ import annotations

from torch import nn

from mmm.parallel.activation_checkpoint import AC_MODES, wrap_block
from mmm.parallel.fsdp import DTYPES, apply_ddp, apply_fsdp
from mmm.parallel.mesh import Mesh, ParallelDims
from mmm.parallel.tensor import apply_tp_llama

STRATEGIES = ("fsdp", "hsdp", "ddp")


def strategy_problems(strategy: str, dims: ParallelDims) -> list[str]:
    """How a data-parallel strategy must fit the mesh, each problem naming the values and a fix."""
    if strategy not in STRATEGIES:
        return [f"unknown --strategy {strategy!r}; choose one of: {', '.join(STRATEGIES)}"]
    out = []
    if strategy == "hsdp" and not (dims.dp_replicate > 1 and dims.dp_shard > 1):
        out.append(f"--strategy hsdp needs dp_replicate > 1 and dp_shard > 1 (got dp_replicate={dims.dp_replicate}, "
                   f"dp_shard={dims.dp_shard}); set --dp-replicate, or use --strategy fsdp")
    if strategy == "fsdp" and dims.dp_replicate > 1:
        out.append(f"--strategy fsdp shards over all data-parallel ranks; --dp-replicate {dims.dp_replicate} "
                   "needs --strategy hsdp")
    if strategy == "ddp" and (dims.tp > 1 or dims.cp > 1 or dims.pp > 1):
        out.append(f"--strategy ddp does not compose with tp/cp/pp (got tp={dims.tp}, cp={dims.cp}, pp={dims.pp}): "
                   "DDP cannot hold sharded (DTensor) parameters; use --strategy fsdp")
    return out


def data_parallel_mesh(mesh: Mesh, strategy: str):
    """The mesh FSDP shards over: 1-D ``dp`` for fsdp/ddp, 2-D (dp_replicate, dp_shard) for hsdp."""
    if strategy == "hsdp":
        return mesh.root["dp_replicate", "dp_shard"]
    return mesh.get("dp")


def uses_fsdp(mesh: Mesh, strategy: str) -> bool:
    """FSDP2 wraps the model (and so handles mixed precision) only with fsdp/hsdp and dp > 1."""
    return strategy in ("fsdp", "hsdp") and mesh.dp_enabled


def state_shards(mesh: Mesh, strategy: str) -> int:
    """Ways each parameter (and its gradient and optimizer state) is split across ranks."""
    dp = {"fsdp": mesh.dp, "hsdp": mesh.dp_shard}.get(strategy, 1) if uses_fsdp(mesh, strategy) else 1
    return dp * mesh.tp


def parallelize_llama(model: nn.Module, mesh: Mesh, *, strategy: str = "fsdp", dtype: str = "fp32",
                      ac: str = "none", compile: bool = False, device=None) -> nn.Module:
    """TP/SP over ``mesh["tp"]``, activation checkpointing, ``torch.compile`` per block, then
    FSDP2 (fsdp), HSDP (hsdp) or DDP (ddp) over the data-parallel ranks. Returns the model to train."""
    if ac not in AC_MODES:
        raise ValueError(f"unknown --ac {ac!r}; choose one of {AC_MODES}")
    if mesh.tp_enabled:
        apply_tp_llama(model, mesh["tp"], loss_parallel=True)
    for name, block in list(model.layers.items()):
        block = wrap_block(block, ac)
        if compile:
            block = _compile(block)
        model.layers[name] = block
    dp_mesh = data_parallel_mesh(mesh, strategy)
    if uses_fsdp(mesh, strategy):
        apply_fsdp(model, dp_mesh, blocks=list(model.layers.values()), param_dtype=DTYPES[dtype])
    elif strategy == "ddp" and dp_mesh is not None:
        model = apply_ddp(model, dp_mesh, device=device)
    return model


def _compile(block: nn.Module) -> nn.Module:
    import torch

    return torch.compile(block, fullgraph=False)
