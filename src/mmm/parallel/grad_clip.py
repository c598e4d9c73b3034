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


def clip_grad_norm_(parameters: Iterable[torch.nn.Parameter], max_norm: float, *, pp_group=None,
                    device: torch.device | str | None = None) -> float:
    """The global L2 norm of the gradients; when ``max_norm`` > 0, also scale them in place so that
    it is at most ``max_norm``. ``device``: where a rank without gradients joins the pp reduction."""
    params = [p for p in parameters if p.grad is not None]
    norm = total_norm([p.grad for p in params])
    if pp_group is not None:  # a stage without gradients still joins, on the collective's device
        squared = norm.float().reshape(1) ** 2
        squared = squared.to(params[0].grad.device if params else (device or "cpu"))
        dist.all_reduce(squared, group=pp_group)
        norm = squared.sqrt().reshape(())
    if params and max_norm > 0:
        groups: dict = {}
        for p in params:
            groups.setdefault(_group_key(p.grad), []).append(p)
        for group in groups.values():  # foreach kernels take one mesh at a time
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm.to(group[0].grad.device))
    return float(norm)
