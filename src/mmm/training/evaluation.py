"""Evaluation flags shared by the trainers: ``--eval-every N`` and ``--eval-iters K``.

Every N steps (and after the last) the trainer runs K batches of the held-out split (the same K
global batches each time, so the numbers compare across steps and meshes) forward only, reduces
the mean loss over ranks (:func:`mmm.training.step.evaluate`: one all-reduce) and records it in
History as ``val_loss`` (and ``val_ppl`` = exp(val_loss) for language models). The time it takes is
recorded as ``dt_eval`` and left out of that step's ``dt``.
"""

from __future__ import annotations

import argparse
import math


def add_eval_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("evaluation")
    g.add_argument(
        "--eval-every",
        type=int,
        default=0,
        metavar="N",
        help="evaluate on the held-out split every N steps and after the last; 0: never [0]",
    )
    g.add_argument(
        "--eval-iters",
        type=int,
        default=4,
        metavar="K",
        help="global batches per evaluation (the same K each time) [4]",
    )


def eval_problems(args: argparse.Namespace) -> list[str]:
    out = []
    if args.eval_every < 0:
        out.append(f"--eval-every {args.eval_every} must be >= 0 (0 turns evaluation off)")
    if args.eval_iters < 1:
        out.append(f"--eval-iters {args.eval_iters} must be >= 1")
    return out


def eval_due(args: argparse.Namespace, step: int, *, last: bool) -> bool:
    every = getattr(args, "eval_every", 0)
    return bool(every) and (step % every == 0 or last)


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf
