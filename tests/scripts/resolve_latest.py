"""Each rank resolves ``--resume latest`` in its OWN folder (argv[1 + rank]), as ranks on a shared file
system with stale listings might see: every rank must get rank 0's answer."""

import sys

from mmm import dist
from mmm.parallel.checkpoint import Checkpointer

# every line is one write (print writes the text and the newline apart): the ranks share one pipe


def main(argv=None):
    info = dist.setup()
    step = Checkpointer(sys.argv[1 + info.rank]).resolve("latest")
    sys.stdout.write(f"rank {info.rank} resolves latest to {step}" + "\n")
    return 0


if __name__ == "__main__":
    dist.run_main(main)
