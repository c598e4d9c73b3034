"""Rank 1 dies abruptly while the others wait in a collective; they must not wait forever."""

import os
import sys
import time

import torch

from mmm import dist


def main(argv=None):
    info = dist.setup()
    mode = sys.argv[1] if len(sys.argv) > 1 else "exit"
    if info.rank == 1:
        time.sleep(0.5)
        if mode == "raise":
            raise RuntimeError("rank 1 failed on purpose")
        os._exit(3)
    t = torch.ones(1)
    torch.distributed.all_reduce(t)  # never completes: rank 1 is gone
    return 0


if __name__ == "__main__":
    dist.run_main(main)
