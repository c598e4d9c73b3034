"""The data plumbing of the language-model recipes (mmm's Llama, transformers' causal LMs): each step's
batch for this rank, the held-out batches and their loss. Every rank reads its data-parallel rows of the
step's global batch (:func:`mmm.data.local_batches`) and, under context parallel, its load-balanced shard
of each sequence."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from mmm.data import local_batches
from mmm.parallel.context import shard_sequence
from mmm.training.evaluation import perplexity
from mmm.training.step import evaluate

Batch = tuple[torch.Tensor, torch.Tensor]


def _stream(dataset, *, seed: int, global_batch: int, mesh, device, start_step: int) -> Iterator[Batch]:
    rows = local_batches(
        dataset,
        seed=seed,
        global_batch=global_batch,
        dp_rank=mesh.coord("dp"),
        dp_size=mesh.dp,
        start_step=start_step,
        device=device,
    )
    if not mesh.cp_enabled:
        yield from rows
        return
    r = mesh.coord("cp")
    for x, y in rows:
        yield shard_sequence(x, r, mesh.cp), shard_sequence(y, r, mesh.cp)


def step_batches(dataset, *, seed: int, global_batch: int, mesh, device) -> Callable[[int], Batch]:
    """``batch(step)``: this rank's part of step ``step``'s global batch. The stream starts at the first step
    asked for (after ``--resume``, where the run stopped) and goes on one step per call."""
    stream: Iterator[Batch] | None = None

    def batch(step: int) -> Batch:
        nonlocal stream
        if stream is None:
            start = step - 1
            stream = _stream(dataset, seed=seed, global_batch=global_batch, mesh=mesh, device=device, start_step=start)
        return next(stream)

    return batch


def held_out_batches(dataset, *, seed: int, global_batch: int, mesh, device, count: int) -> list[Batch]:
    """This rank's part of the first ``count`` global batches of the held-out ``dataset``: the same ones at
    every evaluation."""
    stream = _stream(dataset, seed=seed, global_batch=global_batch, mesh=mesh, device=device, start_step=0)
    return [next(stream) for _ in range(count)]


def held_out_loss(engine, batches: list[Batch], loss_fn, *, sync) -> dict[str, float]:
    """The mean loss over the held-out ``batches`` (every rank), as History's ``val_loss`` and ``val_ppl``."""
    val_loss = evaluate(engine, batches, loss_fn, sync=sync)
    return {"val_loss": val_loss, "val_ppl": perplexity(val_loss)}
