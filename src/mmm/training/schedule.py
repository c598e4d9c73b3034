"""Learning-rate schedules: linear warmup, then cosine, linear or no decay down to a floor.

The learning rate of a step is a pure function of the step (as in nanoGPT's ``get_lr``), so a
resumed run gets it back from the step alone, on any mesh; the schedule itself is recorded in each
checkpoint and a resume with another schedule is refused. Every trainer's train config has the
fields of :class:`ScheduleConfig`, so every trainer takes the same flags::

    --lr 3e-3 --lr-schedule cosine --warmup-steps 100 --min-lr 3e-4 [--lr-decay-steps N]

and logs the step's ``lr`` in History.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from mmm.cli import nonnegative_float, nonnegative_int, option, positive_int

SCHEDULES = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class LRSchedule:
    """``lr`` after ``warmup_steps`` of linear warmup (step 1 gets lr/warmup_steps); then ``kind``
    decay from ``lr`` to ``min_lr`` at step ``decay_steps`` (and ``min_lr`` after it)."""

    lr: float
    kind: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0
    decay_steps: int = 0

    def __call__(self, step: int) -> float:
        if self.warmup_steps and step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.kind == "constant":
            return self.lr
        span = self.decay_steps - self.warmup_steps
        if span <= 0 or step >= self.decay_steps:
            return self.min_lr
        progress = (step - self.warmup_steps) / span
        if self.kind == "cosine":
            return self.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (self.lr - self.min_lr)
        return self.lr + progress * (self.min_lr - self.lr)  # linear

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ScheduleConfig:
    """The learning rate and its schedule: part of every trainer's train config."""

    lr: float = option(3e-3, "--lr", parse=nonnegative_float, group="training", help="AdamW learning rate")
    lr_schedule: str | None = option(
        None, "--lr-schedule", choices=SCHEDULES, shown="constant", group="schedule", help="decay after the warmup"
    )
    warmup_steps: int = option(
        0,
        "--warmup-steps",
        parse=nonnegative_int,
        metavar="N",
        group="schedule",
        help="linear learning-rate warmup over the first N steps (not --warmup, the steps left out of the timing "
        "means)",
    )
    min_lr: float | None = option(
        None,
        "--min-lr",
        parse=nonnegative_float,
        metavar="LR",
        shown="lr/10 for cosine and linear",
        group="schedule",
        help="floor the decay ends at",
    )
    lr_decay_steps: int | None = option(
        None,
        "--lr-decay-steps",
        parse=positive_int,
        metavar="N",
        shown="the run's length: --max-iters, or --epochs x steps per epoch",
        group="schedule",
        help="step at which the decay reaches --min-lr",
    )

    def schedule(self, *, total_steps: int) -> LRSchedule:
        """The per-step schedule (``lr_decay_steps`` defaults to ``total_steps``)."""
        kind = self.lr_schedule or "constant"
        if kind not in SCHEDULES:
            raise ValueError(f"{kind!r} is not a per-step schedule")
        min_lr = self.min_lr if self.min_lr is not None else (self.lr / 10 if kind != "constant" else self.lr)
        decay = self.lr_decay_steps if self.lr_decay_steps is not None else total_steps
        return LRSchedule(
            lr=self.lr,
            kind=kind,
            warmup_steps=self.warmup_steps,
            min_lr=min_lr,
            decay_steps=decay if kind != "constant" else 0,
        )

    def schedule_problems(self, *, total_steps: int | None) -> list[str]:
        """Problems with the schedule over a run of ``total_steps``, each naming the value and the fix."""
        out = []
        kind = self.lr_schedule or "constant"
        if self.warmup_steps < 0:
            out.append(f"--warmup-steps {self.warmup_steps} must be >= 0")
        if self.min_lr is not None:
            if self.min_lr < 0:
                out.append(f"--min-lr {self.min_lr} must be >= 0")
            elif kind == "constant":
                out.append(f"--min-lr {self.min_lr} has no effect with --lr-schedule constant; choose cosine or linear")
            elif self.min_lr > self.lr:
                out.append(f"--min-lr {self.min_lr} is above --lr {self.lr}; the decay goes down to it")
        if self.lr_decay_steps is not None:
            if kind == "constant":
                out.append(
                    f"--lr-decay-steps {self.lr_decay_steps} has no effect with --lr-schedule constant; choose "
                    "cosine or linear"
                )
            elif self.lr_decay_steps <= self.warmup_steps:
                out.append(f"--lr-decay-steps {self.lr_decay_steps} must be > --warmup-steps {self.warmup_steps}")
        if total_steps is not None and self.warmup_steps > total_steps:
            out.append(f"--warmup-steps {self.warmup_steps} is longer than the run ({total_steps} steps)")
        return out


def set_lr(optimizer_or_engine: Any, lr: float) -> None:
    """Set every parameter group's learning rate (a torch optimizer, or an engine exposing param_groups)."""
    for group in optimizer_or_engine.param_groups:
        group["lr"] = lr
