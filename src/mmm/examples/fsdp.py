"""Train a small CNN on real handwritten digits with DDP, FSDP2, HSDP or DeepSpeed ZeRO-1/2/3.

    launch -n 2 python3 -m mmm.examples.fsdp                        # FSDP2, bundled 8x8 digits
    launch -n 4 python3 -m mmm.examples.fsdp --strategy zero3       # DeepSpeed ZeRO-3
    launch -n 4 python3 -m mmm.examples.fsdp --data-dir ~/data/mnist  # MNIST IDX files

Data: MNIST when --data-dir holds its IDX files (plain or .gz), else scikit-learn's bundled
8x8 digits (no download). --batch-size is the GLOBAL batch, split over data-parallel ranks;
the same --seed and global batch give the same losses on any number of ranks.
"""

# What this example teaches: data parallel alone, five ways over one flag (--strategy ddp, fsdp, hsdp,
# zero1/2/3), with the same trainer (mmm/training/trainer.py) and a recipe whose run goes by epochs, with
# a test set and its accuracy after each (mmm/models/cnn/recipe.py).

from __future__ import annotations

from collections.abc import Sequence

from mmm.models.cnn.recipe import DIGITS
from mmm.training import trainer

EXAMPLE = DIGITS.name


def build_parser():
    return DIGITS.command_line(__doc__).parser()


def main(argv: Sequence[str] | None = None) -> int:
    return trainer.main(DIGITS, argv, doc=__doc__)


if __name__ == "__main__":
    from mmm.dist import run_main

    run_main(main, prog=f"python -m mmm.examples.{EXAMPLE}")
