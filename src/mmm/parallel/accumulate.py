"""Gradient accumulation: one optimizer step over several forward/backward passes of a rank's batch.

A rank's batch is split into ``microbatches`` equal parts along its first dimension; each part's forward
and backward runs in turn, so activations are held for one part at a time (1/N of the batch), while the
step, its loss and its gradients are those of the whole batch::

    from mmm.parallel.accumulate import deferred_gradient_sync, scale_gradients_, split_batch

    for i, (x, y) in enumerate(split_batch(inputs, targets, microbatches)):
        with deferred_gradient_sync(model, last=i == microbatches - 1):
            loss_fn(model(x), y).backward()
    scale_gradients_(model.parameters(), 1 / microbatches)  # the mean over the parts, as one pass gives
    optimizer.step()

The gradients are scaled once after the last backward, not each loss before its own: a gradient a model
adds in backward outside the loss (a mixture of experts' balancing loss, :mod:`mmm.models.llama.moe`)
is then scaled too, as torch's pipeline schedules do with their microbatches.

What waits for the last part, by data-parallel mode (:func:`deferred_gradient_sync`):

- DDP: the all-reduce (``no_sync``); each rank's whole gradients are held anyway.
- HSDP: the all-reduce across replicas; each part still reduce-scatters within the shard group, so the
  gradients stay sharded.
- FSDP: nothing; each part reduce-scatters. Deferring would hold whole, unsharded gradients on every
  rank, which is the memory FSDP exists to save.
- DeepSpeed ZeRO: its own accumulation (``gradient_accumulation_steps``; :class:`mmm.parallel.strategy.
  DeepSpeedEngine`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mmm.errors import API, Spelling


def accumulation_problems(microbatches: int | None, local_batch: int | None, *, spell: Spelling = API) -> list[str]:
    """``microbatches`` (None: 1) must be >= 1 and divide ``local_batch``, the per-dp-rank batch (when known)."""
    if microbatches is None:
        return []
    if microbatches < 1:
        return [f"{spell('microbatches', microbatches)} must be >= 1"]
    if local_batch is not None and local_batch % microbatches:
        divisors = [d for d in range(1, local_batch + 1) if local_batch % d == 0]
        near = [max(d for d in divisors if d < microbatches)] + [d for d in divisors if d > microbatches][:1]
        return [
            f"{spell('microbatches', microbatches)} does not divide the per-dp-rank batch {local_batch} "
            f"(the global batch over the data-parallel ranks); use a divisor of {local_batch}, e.g. "
            f"{' or '.join(map(str, near))}"
        ]
    return []


def split_batch(inputs: torch.Tensor, targets: torch.Tensor, microbatches: int) -> list[tuple[torch.Tensor, ...]]:
    """``microbatches`` equal parts of a batch along its first dimension (views, no copies)."""
    n = inputs.shape[0]
    problems = accumulation_problems(microbatches, n)
    if problems or targets.shape[0] != n:
        why = problems[0] if problems else f"targets have {targets.shape[0]} rows and inputs {n}"
        raise ValueError(f"cannot split a batch of {n} into {microbatches} microbatches: {why}")
    size = n // microbatches
    return list(zip(inputs.split(size), targets.split(size), strict=True))


@contextlib.contextmanager
def deferred_gradient_sync(model: nn.Module, *, last: bool) -> Iterator[None]:
    """A backward inside adds to the gradients with the data-parallel reduction that can wait without
    holding more memory deferred to the ``last`` part (the module doc): DDP's all-reduce, HSDP's
    all-reduce across replicas. With ``last`` (or a model with neither) it changes nothing."""
    if last:
        yield
        return
    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
        return
    from torch.distributed.fsdp import FSDPModule  # loaded with FSDP itself, which the model then uses

    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in sharded:
        module.set_requires_all_reduce(False, recurse=False)
    try:
        yield
    finally:
        for module in sharded:
            module.set_requires_all_reduce(True, recurse=False)


@torch.no_grad()
def scale_gradients_(parameters: Iterable[torch.Tensor], factor: float) -> None:
    """Multiply every gradient by ``factor`` in place (a DTensor's local shard, one fused op per dtype)."""
    if factor == 1:
        return
    grads = [p.grad for p in parameters if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    if local:
        torch._foreach_mul_(local, factor)
