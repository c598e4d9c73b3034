"""Global gradient norm (and clipping) that is right under FSDP, TP and PP.

The norm is taken over the full (unsharded) gradients: sharded DTensor gradients reduce their
norms over their mesh (one reduction per mesh and layout, so a model whose plan shards some
parameters over tp x dp and others over dp alone is fine), plain gradients are replicated and
count once, and pipeline stages add their squared norms over the pp group, so every rank sees
the same global norm, the one a single process would compute.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def _group_key(grad: torch.Tensor):
    mesh = getattr(grad, "device_mesh", None)
    if mesh is None:
        return None
    return (id(mesh), tuple(type(p).__name__ + str(getattr(p, "dim", "")) for p in grad.placements))


def _sharded_groups(grad: torch.Tensor) -> list:
    """Process groups of the mesh dimensions a DTensor is sharded over (its norm adds up over them)."""
    mesh = getattr(grad, "device_mesh", None)
    if mesh is None:
        return []
    out = []
    for i, placement in enumerate(grad.placements):
        if placement.is_shard() or type(placement).__name__ == "_StridedShard":
            out.append(mesh.get_group(i))
    return out


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all ``grads`` (DTensor or plain): local squares summed per layout, then one
    all-reduce per process group they are sharded over (replicated dimensions count once)."""
    by_layout: dict = {}
    for g in grads:
        if any(p.is_partial() for p in getattr(g, "placements", ())):
            # not yet reduced (TP's replicated parameters): the norm needs the sum, so reduce a copy
            from torch.distributed.tensor import Replicate

            g = g.redistribute(placements=[Replicate() if p.is_partial() else p for p in g.placements])
        by_layout.setdefault(_group_key(g), []).append(g)
    squares, groups = [], []
    for layout in by_layout.values():
        local = [g.to_local() if hasattr(g, "to_local") else g for g in layout]
        squares.append(torch.nn.utils.get_total_norm(local, norm_type=2.0).float().reshape(()) ** 2)
        groups.append(_sharded_groups(layout[0]))
    if not squares:
        return torch.zeros(())
    squares = torch.stack([s.to(squares[0].device) for s in squares])
    seen: list = []
    for gs in groups:
        for g in gs:
            if all(g is not s for s in seen):
                seen.append(g)
    for g in seen:  # every layout sharded over g is summed over it, in one all-reduce
        mask = torch.tensor([any(g is x for x in gs) for gs in groups], device=squares.device)
        part = squares[mask].clone()
        dist.all_reduce(part, group=g)
        squares = squares.masked_scatter(mask, part)
    return squares.sum().sqrt()


def clip_grad_norm_(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    *,
    pp_group=None,
    device: torch.device | str | None = None,
) -> float:
    """The global L2 norm of the gradients; when ``max_norm`` > 0, also scale them in place so that
    it is at most ``max_norm``. ``device``: where a rank without gradients joins the pp reduction."""
    return float(grad_norm_(parameters, max_norm, pp_group=pp_group, device=device))


def grad_norm_(
    parameters: Iterable[torch.nn.Parameter],
    max_norm: float,
    *,
    pp_group=None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """:func:`clip_grad_norm_` without reading the norm on the host: a 0-d tensor on the device."""
    params = [p for p in parameters if p.grad is not None]
    norm = total_norm([p.grad for p in params])
    if pp_group is not None:  # a stage without gradients still joins, on the collective's device
        squared = norm.float().reshape(1) ** 2
        squared = squared.to(params[0].grad.device if params else (device or "cpu"))
        dist.all_reduce(squared, group=pp_group)
        norm = squared.sqrt().reshape(())
    if params and max_norm > 0:
        clip_with_norm_(params, max_norm, norm)
    return norm


def square_share(grads: list[torch.Tensor], *, stage_ranks: int) -> torch.Tensor:
    """This rank's share of the global squared gradient norm, such that the SUM over every rank of
    the world is the squared norm a single process would compute: each local square is divided by
    the number of ranks holding the same values (``stage_ranks`` = the ranks of this pipeline stage,
    world / pp, hold this stage's parameters; a DTensor's shard is held by the ranks of its
    replicated mesh dimensions and by the stage ranks outside its mesh). Lets a training step fold
    the norm into the one all-reduce it does anyway (:class:`mmm.training.step.StepSync`).
    Gradients still Partial over a mesh dimension (not yet reduced) are reduced first."""
    by_replicas: dict[int, list[torch.Tensor]] = {}
    for g in grads:
        if any(p.is_partial() for p in getattr(g, "placements", ())):
            from torch.distributed.tensor import Replicate

            g = g.redistribute(placements=[Replicate() if p.is_partial() else p for p in g.placements])
        mesh = getattr(g, "device_mesh", None)
        if mesh is None:
            replicas = stage_ranks
        else:
            replicated = 1
            for i, placement in enumerate(g.placements):
                if placement.is_replicate():
                    replicated *= mesh.size(i)
            replicas = max(1, replicated * stage_ranks // mesh.size())
        by_replicas.setdefault(replicas, []).append(g.to_local() if hasattr(g, "to_local") else g)
    parts = [
        torch.nn.utils.get_total_norm(local, norm_type=2.0).float() ** 2 / replicas  # foreach kernels
        for replicas, local in by_replicas.items()
    ]
    if not parts:
        return torch.zeros(())
    return torch.stack([p.reshape(()).to(parts[0].device) for p in parts]).sum()


def clip_with_norm_(parameters: Iterable[torch.nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scale gradients in place so that their global norm ``norm`` (a device tensor) is at most
    ``max_norm``; no host sync."""
    params = [p for p in parameters if p.grad is not None]
    groups: dict = {}
    for p in params:
        groups.setdefault(_group_key(p.grad), []).append(p)
    for group in groups.values():  # foreach kernels take one mesh at a time
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm.to(group[0].grad.device))
