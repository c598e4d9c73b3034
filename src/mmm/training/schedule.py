"""Learning-rate schedules: linear warmup, then cosine, linear or no decay down to a floor.

The learning rate of a step is a pure function of the step (as in nanoGPT's ``get_lr``), so a
resumed run gets it back from the step alone, on any mesh; the schedule itself is recorded in each
checkpoint and a resume with another schedule is refused. Every trainer takes the same flags::

    --lr 3e-3 --lr-schedule cosine --warmup-steps 100 --min-lr 3e-4 [--lr-decay-steps N]

and logs the step's ``lr`` in History.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from typing import Any

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


def add_schedule_args(parser: argparse.ArgumentParser, *, extra_kinds: tuple[str, ...] = ()) -> None:
    """``--lr-schedule``, ``--warmup-steps``, ``--min-lr``, ``--lr-decay-steps`` (``--lr`` is the trainer's)."""
    g = parser.add_argument_group("learning-rate schedule")
    g.add_argument(
        "--lr-schedule",
        choices=(*SCHEDULES, *extra_kinds),
        default=None,
        help=f"decay after the warmup: {', '.join((*SCHEDULES, *extra_kinds))} "
        f"[{extra_kinds[0] if extra_kinds else 'constant'}]",
    )
    g.add_argument(
        "--warmup-steps",
        type=int,
        default=0,
        metavar="N",
        help="linear learning-rate warmup over the first N steps (not --warmup, the steps left out of "
        "the timing means) [0]",
    )
    g.add_argument(
        "--min-lr", type=float, default=None, metavar="LR", help="floor the decay ends at [lr/10 for cosine and linear]"
    )
    g.add_argument(
        "--lr-decay-steps",
        type=int,
        default=None,
        metavar="N",
        help="step at which the decay reaches --min-lr [--max-iters]",
    )


def schedule_problems(args: argparse.Namespace, *, total_steps: int | None) -> list[str]:
    """Flag problems, each naming the value and the fix."""
    out = []
    kind = args.lr_schedule or "constant"
    if args.warmup_steps < 0:
        out.append(f"--warmup-steps {args.warmup_steps} must be >= 0")
    if args.min_lr is not None:
        if args.min_lr < 0:
            out.append(f"--min-lr {args.min_lr} must be >= 0")
        elif kind == "constant":
            out.append(f"--min-lr {args.min_lr} has no effect with --lr-schedule constant; choose cosine or linear")
        elif args.min_lr > args.lr:
            out.append(f"--min-lr {args.min_lr} is above --lr {args.lr}; the decay goes down to it")
    if args.lr_decay_steps is not None:
        if kind == "constant":
            out.append(
                f"--lr-decay-steps {args.lr_decay_steps} has no effect with --lr-schedule constant; choose "
                "cosine or linear"
            )
        elif args.lr_decay_steps <= args.warmup_steps:
            out.append(f"--lr-decay-steps {args.lr_decay_steps} must be > --warmup-steps {args.warmup_steps}")
    if total_steps is not None and args.warmup_steps > total_steps:
        out.append(f"--warmup-steps {args.warmup_steps} is longer than the run ({total_steps} steps)")
    return out


def schedule_from_args(args: argparse.Namespace, *, total_steps: int) -> LRSchedule:
    kind = args.lr_schedule or "constant"
    if kind not in SCHEDULES:
        raise ValueError(f"{kind!r} is not a per-step schedule")
    min_lr = args.min_lr if args.min_lr is not None else (args.lr / 10 if kind != "constant" else args.lr)
    decay = args.lr_decay_steps if args.lr_decay_steps is not None else total_steps
    return LRSchedule(
        lr=args.lr,
        kind=kind,
        warmup_steps=args.warmup_steps,
        min_lr=min_lr,
        decay_steps=decay if kind != "constant" else 0,
    )


def set_lr(optimizer_or_engine: Any, lr: float) -> None:
    """Set every parameter group's learning rate (a torch optimizer, or an engine exposing param_groups)."""
    for group in optimizer_or_engine.param_groups:
        group["lr"] = lr
