"""One training step, lean: forward, backward, one small packed all-reduce, optimizer step.

Per step mmm adds exactly one collective of its own, :class:`StepSync`'s all-reduce of four numbers
over every rank: this rank's share of the mean loss, whether its loss is non-finite, whether it got
SIGTERM, and its share of the squared global gradient norm (which clipping needs before the
optimizer step, so the reduction comes between backward and the step). Nothing is read back to the
host on a step that does not log: the packed result is copied to the host without blocking and read
one step later (or at once on steps that log, save, stop or skip non-finite losses), and on cuda/xpu
the forward and backward are timed with device events, read with it. The gradient norm stays on the
device until then too.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist

from mmm.dist import stop_flag
from mmm.errors import UsageError


def _local_scalar(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a plain fp32 0-d tensor (a replicated DTensor's local value: no communication)."""
    value = loss.detach()
    if hasattr(value, "placements"):
        from torch.distributed.tensor import Replicate

        value = value.to_local() if all(isinstance(p, Replicate) for p in value.placements) else value.full_tensor()
    return value.float().reshape(())


class Reduced:
    """A step's packed all-reduce result, on its way to the host."""

    def __init__(self, packed: torch.Tensor, *, has_grad_norm: bool = False) -> None:
        self.grad_square = packed[3]  # stays on the device: the optimizer step clips with it
        self.has_grad_norm = has_grad_norm
        self._grad_norm: float | None = None
        self._event = None
        if packed.device.type in ("cuda", "xpu", "mps"):
            backend = getattr(torch, packed.device.type)
            self._host = packed.to("cpu", non_blocking=True)
            self._event = backend.Event()
            self._event.record()
        else:
            self._host = packed
        self._values: tuple[float, bool, bool] | None = None

    def values(self) -> tuple[float, bool, bool]:
        """(mean loss over the data-parallel ranks, a non-finite loss or gradient on any rank, SIGTERM on any rank);
        waits for this step's reduction only, not for work queued after it."""
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            loss, nonfinite, stop, grad_square = self._host.tolist()
            # every rank's share finite, their sum not (an overflow): non-finite too, alike on every rank
            nonfinite = nonfinite > 0 or (self.has_grad_norm and not math.isfinite(grad_square))
            self._values = (loss, nonfinite, stop > 0)
            self._grad_norm = math.sqrt(grad_square) if self.has_grad_norm else None
        return self._values

    @property
    def grad_norm(self) -> float | None:
        """The global gradient norm, when the step reduced it (None: the engine measured its own)."""
        self.values()
        return self._grad_norm

    def ready(self) -> bool:
        """Whether the values can be read without waiting (the reduction has finished)."""
        return self._event is None or self._event.query()

    @property
    def read(self) -> bool:
        return self._values is not None


class StepSync:
    """The one collective mmm adds to a step. ``loss_holders`` ranks hold the loss (every rank; under
    pipeline parallel those of the last stage), each adding loss / loss_holders, so the sum over
    every rank is the mean over data-parallel (and context-parallel) ranks: tensor- and
    pipeline-parallel peers hold the same loss."""

    def __init__(self, *, device: torch.device, holds_loss: bool = True, loss_holders: int | None = None) -> None:
        self.device = device
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.weight = 1.0 / (loss_holders or self.world) if holds_loss else 0.0

    @classmethod
    def for_engine(cls, engine, *, device: torch.device) -> StepSync:
        pipe = getattr(engine, "pipeline", None)
        if pipe is None:
            return cls(device=device)
        world = dist.get_world_size() if dist.is_initialized() else 1
        return cls(device=device, holds_loss=pipe.has_last, loss_holders=world // dist.get_world_size(pipe.pp_group))

    def reduce(self, loss: torch.Tensor, grad_square: torch.Tensor | None = None) -> Reduced:
        """All-reduce (sum) [loss share, non-finite, stop, ``grad_square`` share] over every rank."""
        value = _local_scalar(loss).to(self.device)
        share = value * self.weight if self.weight else torch.zeros((), device=self.device)
        stop = torch.full((), float(stop_flag()), device=self.device)  # a fill: no copy from the host
        grad = (
            grad_square.float().reshape(()).to(self.device)
            if grad_square is not None
            else torch.zeros((), device=self.device)
        )
        # non-finite: this rank's loss, or its share of the gradient norm (a finite loss can still give NaN
        # gradients; the update would write them into the weights and the next checkpoint)
        nonfinite = (~torch.isfinite(value) | ~torch.isfinite(grad)).float()
        packed = torch.stack([share, nonfinite, stop, grad])
        if self.world > 1:
            dist.all_reduce(packed)
        return Reduced(packed, has_grad_norm=grad_square is not None)


class _Timer:
    """Marks on the host clock (CPU: its work is done when the call returns) or device events."""

    def __init__(self, device: torch.device) -> None:
        self.kind = device.type if device.type in ("cuda", "xpu", "mps") else None
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.kind is None:
            self.marks.append(time.perf_counter())
        else:
            event = getattr(torch, self.kind).Event(enable_timing=True)
            event.record()
            self.marks.append(event)

    def seconds(self, phase: int) -> float | None:
        """The summed time of ``phase`` (0: forward + loss, 1: backward) over the step's parts: its marks
        come in threes (before the forward, after the loss, after the backward), one three a microbatch."""
        if len(self.marks) < 3:  # not marked: a pipeline schedule interleaves forward and backward
            return None
        pairs = [(self.marks[k + phase], self.marks[k + phase + 1]) for k in range(0, len(self.marks) - 2, 3)]
        if self.kind is None:
            return sum(b - a for a, b in pairs)
        self.marks[-1].synchronize()
        return sum(a.elapsed_time(b) for a, b in pairs) / 1e3


class StepTimes:
    """``dtf`` (forward + loss) and ``dtb`` (backward) of a step, read when the step is recorded;
    None under pipeline parallel, whose schedule interleaves them."""

    def __init__(self, timer: _Timer, skipped: bool | None) -> None:
        self._timer, self.skipped = timer, skipped

    def as_dict(self) -> dict[str, float | None]:
        t = self._timer
        out = {"dtf": t.seconds(0), "dtb": t.seconds(1)}
        if self.skipped is not None:
            out["skipped"] = int(self.skipped)
        return out


def train_step(
    engine,
    inputs,
    targets,
    loss_fn,
    *,
    sync: StepSync,
    after_backward=None,
    poison: str | None = None,
    skip_nonfinite: bool = False,
) -> tuple[torch.Tensor, Reduced, StepTimes]:
    """Forward, loss, backward (the engine's :meth:`~mmm.parallel.strategy.Engine.forward_backward`:
    under pipeline parallel its schedule, over the microbatches), the packed all-reduce
    (:class:`StepSync`), optimizer step; no host sync.

    Returns the loss (this rank's), the step's :class:`Reduced` values and its :class:`StepTimes`.
    ``after_backward()`` runs before the optimizer step (gradients exist: the moment to measure
    memory); ``poison`` (fault injection, :func:`mmm.faults.inject`): ``"nan"`` makes the loss NaN,
    ``"nangrad"`` a gradient of this rank after backward; ``skip_nonfinite`` skips the optimizer
    step when the loss or the gradient norm is non-finite on any rank (that reads the reduction at once:
    a host sync on every step).
    """
    timer = _Timer(inputs.device)
    loss = engine.forward_backward(
        inputs, targets, loss_fn, mark=timer.mark, poison=poison == "nan", probe_memory=after_backward is not None
    )
    if poison == "nangrad":
        _poison_a_gradient(engine)
    if after_backward is not None:
        after_backward()
    share = engine.grad_square_share()
    reduced = sync.reduce(loss, share)
    skipped = skip_nonfinite and reduced.values()[1]
    if skipped:
        engine.skip_step()
    else:
        engine.step(reduced.grad_square if share is not None else None)
    return loss, reduced, StepTimes(timer, skipped if skip_nonfinite else None)


def _poison_a_gradient(engine) -> None:
    """MMM_FAULT=nangrad: the first gradient this rank holds a part of becomes NaN."""
    for p in engine.module.parameters():
        grad = p.grad
        local = grad.to_local() if grad is not None and hasattr(grad, "to_local") else grad
        if local is not None and local.numel():
            local.fill_(float("nan"))
            return
    raise UsageError(  # DeepSpeed keeps the gradients in its own buffers: same on every rank
        "MMM_FAULT=nangrad poisons a gradient of the model, and this engine holds none on it (DeepSpeed ZeRO keeps "
        "its own); use nan@STEP, or a torch strategy"
    )


@torch.no_grad()
def evaluate(engine, batches, loss_fn, *, sync: StepSync) -> float:
    """The mean loss over ``batches`` (an iterable of this rank's (inputs, targets), the same number on
    every rank) with the model in eval mode and no gradients, reduced over ranks like a training step's
    loss (one all-reduce): the validation loss of the whole global batch, on every rank."""
    total, n = None, 0
    engine.eval()
    try:
        for inputs, targets in batches:
            value = _local_scalar(engine.evaluate_loss(inputs, targets, loss_fn))
            total = value if total is None else total + value
            n += 1
    finally:
        engine.train()
    if not n:
        raise ValueError("evaluate() got no batches")
    loss, _, _ = sync.reduce(total / n).values()
    return loss
