"""Sets up, prints READY, then sleeps until a signal ends it (SIGTERM/SIGINT forwarding test)."""

import signal
import sys
import time

from mmm import dist


def main(argv=None):
    if "--ignore-sigint" in sys.argv:  # a program that ignores SIGINT: launch must escalate
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    info = dist.setup()
    sys.stdout.write(f"READY {info.rank}\n")  # one write: print() writes the newline apart when unbuffered
    sys.stdout.flush()
    while True:
        time.sleep(0.1)


if __name__ == "__main__":
    dist.run_main(main)
