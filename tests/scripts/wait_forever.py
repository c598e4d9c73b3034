"""Sets up, prints READY, then sleeps until a signal ends it (SIGTERM/SIGINT forwarding test)."""

import sys
import time

from mmm import dist


def main(argv=None):
    info = dist.setup()
    sys.stdout.write(f"READY {info.rank}\n")  # one write: print() writes the newline apart when unbuffered
    sys.stdout.flush()
    while True:
        time.sleep(0.1)


if __name__ == "__main__":
    dist.run_main(main)
