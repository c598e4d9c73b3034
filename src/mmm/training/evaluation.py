"""Held-out evaluation, shared by the trainers (:class:`EvalConfig`: ``--eval-every N``, ``--eval-iters K``).

Every N steps (and after the last) the trainer runs K batches of the held-out split (the same K
global batches each time, so the numbers compare across steps and meshes) forward only, reduces
the mean loss over ranks (:func:`mmm.training.step.evaluate`: one all-reduce) and records it in
History as ``val_loss`` (and ``val_ppl`` = exp(val_loss) for language models). The time it takes is
recorded as ``dt_eval`` and left out of that step's ``dt``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mmm.cli import nonnegative_int, option, positive_int
from mmm.errors import only_with


@dataclass
class EvalConfig:
    """Held-out evaluation: part of the train config of trainers that evaluate."""

    eval_every: int = option(
        0,
        "--eval-every",
        parse=nonnegative_int,
        metavar="N",
        group="eval",
        help="evaluate on the held-out split every N steps and after the last; 0: never",
    )
    eval_iters: int | None = option(
        None,
        "--eval-iters",
        parse=positive_int,
        metavar="K",
        shown="4",
        group="eval",
        help="global batches per evaluation (the same K each time; with --eval-every)",
    )

    @property
    def eval_batches(self) -> int:
        """Global batches per evaluation: ``--eval-iters``, 4 when not given."""
        return 4 if self.eval_iters is None else self.eval_iters

    def eval_due(self, step: int, *, last: bool) -> bool:
        return bool(self.eval_every) and (step % self.eval_every == 0 or last)

    def eval_problems(self) -> list[str]:
        out = []
        if self.eval_every < 0:
            out.append(f"--eval-every {self.eval_every} must be >= 0 (0 turns evaluation off)")
        if self.eval_iters is not None and self.eval_iters < 1:
            out.append(f"--eval-iters {self.eval_iters} must be >= 1")
        if self.eval_iters is not None and not self.eval_every:
            out.append(only_with([f"--eval-iters {self.eval_iters}"], "with --eval-every N", "add --eval-every N"))
        return out


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf
