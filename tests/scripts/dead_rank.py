"""Rank 1 dies abruptly while the others wait in a collective; they must not wait forever.

dead_rank.py [exit|raise]   rank 1 exits (or raises) at 0.5 s; the others wait in an all-reduce
dead_rank.py busy           as ``exit``, but ranks 2 and 3 are busy elsewhere when it happens:
                            rank 3 sleeps 6 s, rank 2 waits for it in an all-reduce of their own
"""

import os
import sys
import time

import torch
import torch.distributed as tdist

from mmm import dist


def in_the_pair(t):
    tdist.all_reduce(t, group=PAIR)  # rank 2 waits here for rank 3 when rank 1 dies


def main(argv=None):
    global PAIR
    info = dist.setup()
    mode = sys.argv[1] if len(sys.argv) > 1 else "exit"
    PAIR = tdist.new_group([2, 3]) if mode == "busy" else None
    if info.rank == 1:
        time.sleep(0.5)
        if mode == "raise":
            raise RuntimeError("rank 1 failed on purpose")
        os._exit(3)
    t = torch.ones(1)
    if mode == "busy" and info.rank == 3:
        time.sleep(6)
    if mode == "busy" and info.rank in (2, 3):
        in_the_pair(t)
    tdist.all_reduce(t)  # never completes: rank 1 is gone
    return 0


if __name__ == "__main__":
    dist.run_main(main)
