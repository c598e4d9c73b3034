"""Train a Llama-style model with tensor/sequence parallel + FSDP2 (or HSDP, or DDP) on a (dp, tp) mesh.

    launch -n 4 python3 -m mmm.examples.fsdp_tp --tpsize 2          # dp=2 x tp=2 on CPU ranks
    launch python3 -m mmm.examples.fsdp_tp --tp 4 --dim 2048 ...     # a GPU allocation, same flags

--batch-size is the GLOBAL batch (sequences per optimizer step), split evenly over dp ranks;
with the same --seed and global batch the per-step losses are the same on any mesh.
Writes history.jsonl (live), history.nc, summary.json and plots/ to --outdir.
"""

# What this example teaches: a model's recipe (mmm/models/llama/recipe.py) says what differs between
# models: its flags and checks, how it is built on meta, its TP plan and blocks (the ParallelSpec), its
# loss and FLOPs, and how a run goes through its data. The one trainer (mmm/training/trainer.py) does
# the rest for every recipe: mesh -> model on meta -> parallelize (TP -> AC -> compile -> FSDP, or a
# pipeline) -> checkpoints -> the steps -> summary. With --pick-layout, the planner picks the layout.

from __future__ import annotations

from collections.abc import Sequence

from mmm.models.llama.recipe import LLAMA
from mmm.plan.pick import take_pick
from mmm.training import trainer

EXAMPLE = LLAMA.name


def build_parser():
    return LLAMA.command_line(__doc__).parser()


def main(argv: Sequence[str] | None = None) -> int:
    return trainer.main(LLAMA, argv, doc=__doc__, pick=take_pick)


if __name__ == "__main__":
    from mmm.dist import run_main

    run_main(main, prog=f"python -m mmm.examples.{EXAMPLE}")
