"""Train a Vision Transformer on synthetic images with DDP, FSDP2, HSDP, ZeRO-1/2/3, or TP x FSDP2.

    launch -n 4 python3 -m mmm.examples.vit                        # FSDP2 over 4 ranks
    launch -n 4 python3 -m mmm.examples.vit --tp 2                 # TP 2 x FSDP2 2 on a 2-D mesh
    launch -n 4 python3 -m mmm.examples.vit --strategy zero2       # DeepSpeed ZeRO-2

Images are a fixed random template per class plus noise (learnable, no download). --batch-size
is the GLOBAL batch; the same --seed and global batch give the same losses on any mesh.
"""

# What this example teaches: the same trainer as the Llama's (mmm/training/trainer.py) over another
# recipe (mmm/models/vit/recipe.py): a ViT whose TP plan (data, mmm/models/vit/tp.py) shards attention
# and MLP, its blocks the units of AC, compile and FSDP; or the whole model handed to DeepSpeed ZeRO.

from __future__ import annotations

from collections.abc import Sequence

from mmm.models.vit.recipe import VIT
from mmm.training import trainer

EXAMPLE = VIT.name


def build_parser():
    return VIT.command_line(__doc__).parser()


def main(argv: Sequence[str] | None = None) -> int:
    return trainer.main(VIT, argv, doc=__doc__)


if __name__ == "__main__":
    from mmm.dist import run_main

    run_main(main, prog=f"python -m mmm.examples.{EXAMPLE}")
