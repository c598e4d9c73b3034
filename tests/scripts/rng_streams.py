"""Each rank draws from torch's RNG after mesh.seed_streams: prints what every rank drew (rank 0)."""

import torch

from mmm import dist
from mmm.parallel import init_mesh


def main(argv=None):
    info = dist.setup(seed=0)
    mesh = init_mesh(tp=2)
    mesh.seed_streams(0)
    draws = dist.gather_objects((mesh.coord("dp"), mesh.coord("tp"), torch.rand(3).tolist()))
    if info.is_main:
        print(repr(draws), flush=True)
    return 0


if __name__ == "__main__":
    dist.run_main(main)
