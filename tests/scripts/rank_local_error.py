"""Only rank 1 meets a usage error (a file missing on its node), raised with the default flags."""

from mmm import dist
from mmm.errors import UsageError


def main(argv=None):
    info = dist.setup(seed=0)
    if info.rank == 1:
        raise UsageError("--data-dir '/nodes/own/disk': no such directory on this node")
    import torch.distributed

    torch.distributed.barrier()  # rank 0 waits for rank 1, which never comes
    return 0


if __name__ == "__main__":
    dist.run_main(main)
