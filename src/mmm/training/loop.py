"""The training loop every trainer runs: :func:`fit`.

A trainer says what a step is made of (its batch, its loss, its learning rate, an evaluation now and
then) and :func:`fit` runs the steps the same way for every model and layout: fault injection,
the lean step (:func:`mmm.training.step.train_step`: forward and backward by the engine, one packed
all-reduce, the optimizer step), the evaluation left out of the step's ``dt``, the step recorded
(:class:`mmm.training.recorder.Recorder`), a checkpoint when one is due
(:class:`mmm.training.checkpoints.CheckpointPolicy`; with ``--checkpoint-async`` written in the
background, the last step's and a stop's waited for), and a SIGTERM agreed on by every rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from mmm import dist
from mmm.faults import inject
from mmm.training.checkpoints import CheckpointPolicy
from mmm.training.recorder import Recorder
from mmm.training.schedule import set_lr
from mmm.training.step import train_step

Batch = tuple[torch.Tensor, torch.Tensor]


def fit(
    engine,
    run: Recorder,
    checkpoints: CheckpointPolicy,
    *,
    steps: range,
    batch: Callable[[int], Batch],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    rates: dict[str, float],
    lr_at: Callable[[int], float],
    evaluate: Callable[[int, bool], dict[str, float]] | None = None,
    after_update: Callable[[int], dict] | None = None,
    after_step: Callable[[int], None] | None = None,
    skip_nonfinite: bool = False,
    measure_step: int | None = None,
    mesh=None,
) -> None:
    """Train ``engine`` for ``steps`` (e.g. ``range(start, max_iters + 1)``).

    - ``batch(step)``: this rank's (inputs, targets) of the step's global batch;
    - ``loss_fn(outputs, targets)``: the loss (under pipeline parallel, the pipeline's own);
    - ``rates``: name -> work per step, recorded as work / dt (``{"tps": tokens}``);
    - ``lr_at(step)``: the step's learning rate, set on every param group and recorded;
    - ``evaluate(step, last)``: values recorded with the step (``{"val_loss": ...}``), ``{}`` when
      none is due; the time it takes is recorded as ``dt_eval`` and left out of the step's ``dt``;
    - ``after_update(step)``: runs after the optimizer step, part of the step (its ``dt``) and before
      any checkpoint of it (e.g. a mixture of experts' balancing); returns values recorded with the step
      (0-d tensors read with the loss);
    - ``after_step(step)``: runs once the step is recorded and saved (e.g. an epoch's summary);
    - ``skip_nonfinite``: a non-finite loss skips the update instead of stopping the run;
    - ``measure_step``: the step ``--measure`` watches (communication by ``mesh`` axis, activations).

    Leaving on an error (a peer died, a NaN), the step read late is still recorded.
    """
    dist.graceful_sigterm()
    engine.train()
    final = steps[-1] if len(steps) else None
    # the state (gradients and optimizer state included) is measured on the last step, and on the second in
    # case the run stops early (SIGTERM, a stop flag): the first has no optimizer state yet
    probed = {final, steps[1] if len(steps) > 1 else final}
    with run:
        for step in steps:
            run.begin_step(step)
            poison = inject(step, run.info.rank)  # MMM_FAULT (mmm.faults): crash, hang, NaN... at this step
            lr = lr_at(step)
            set_lr(engine, lr)
            inputs, targets = batch(step)
            last = step == final
            with run.measuring(mesh, enabled=measure_step is not None and step == measure_step):
                _, reduced, times = train_step(
                    engine,
                    inputs,
                    targets,
                    loss_fn,
                    sync=run.sync,
                    poison=poison,
                    skip_nonfinite=skip_nonfinite,
                    after_backward=(lambda: run.capture_memory(engine)) if step in probed else None,
                )
            values: dict[str, float] = {}
            updated = after_update(step) if after_update is not None else {}
            if evaluate is not None:
                t_eval = time.perf_counter()
                values = evaluate(step, last)
                if values:
                    values["dt_eval"] = time.perf_counter() - t_eval
                    run.exclude(values["dt_eval"])
            stopping = run.end_step(
                step,
                reduced,
                times,
                last=last,
                force=bool(values) or checkpoints.periodic(step),
                rates=rates,
                grad_norm=engine.grad_norm,
                lr=lr,
                **updated,
                **values,
            )
            if checkpoints.due(step, last=last, stopping=stopping):
                run.hist.sync()  # the history up to a checkpoint is as durable as the checkpoint
                checkpoints.save(step, run.last_loss, final=last or stopping)
            if after_step is not None:
                after_step(step)
            if stopping:
                break
        checkpoints.finish()  # a save still in flight (--checkpoint-async) is complete before the run ends
