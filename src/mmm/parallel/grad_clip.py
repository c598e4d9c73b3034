"""Gradient-norm clipping that is right under FSDP, TP and PP.

The norm is taken over the full (unsharded) gradients: sharded DTensor gradients reduce their
norms over their mesh, and pipeline stages add their squared norms over the pp group, so every
rank clips by the same global norm, the one a single process would compute.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def clip_grad_norm_(parameters: Iterable[torch.nn.Parameter], max_norm: float, *, pp_group=None) -> float:
    """Scale gradients in place so their global L2 norm is at most ``max_norm``; returns the norm."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        norm = torch.zeros(())
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
    if pp_group is not None:
        squared = norm.float().reshape(1) ** 2
        dist.all_reduce(squared, group=pp_group)
        norm = squared.sqrt().reshape(())
    if params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm.to(params[0].grad.device))
    return float(norm)
