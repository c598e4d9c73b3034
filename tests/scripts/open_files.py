"""Sets up the process group and prints this rank's soft open-file limit (the limit test)."""

import resource
import sys

from mmm import dist


def main(argv=None):
    info = dist.setup()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    sys.stdout.write(f"rank {info.rank} soft {soft} hard {hard}\n")
    return 0


if __name__ == "__main__":
    dist.run_main(main)
