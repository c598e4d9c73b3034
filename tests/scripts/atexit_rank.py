"""A program with its own atexit handler, run through mmm's run_main (which leaves by os._exit)."""

import atexit
import sys
from pathlib import Path

from mmm import dist


def main(argv=None):
    info = dist.setup(seed=0)
    out = Path(sys.argv[1])
    atexit.register(lambda: (out / f"rank{info.rank}.txt").write_text("atexit ran\n"))
    return 0


if __name__ == "__main__":
    dist.run_main(main, argv=[])
