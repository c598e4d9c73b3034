"""A rank for launch's signal promise: writes its stacks on SIGUSR1 (mmm's own handler, MMM_STACK_DIR), notes
a SIGUSR2 in OUT/usr2-rank<r>, prints READY and waits; SIGHUP and SIGQUIT keep their default (they end it)."""

import os
import signal
import sys
import time

from mmm import dist


def main(argv=None):
    info = dist.setup()
    out = sys.argv[1]
    signal.signal(signal.SIGUSR2, lambda s, f: open(os.path.join(out, f"usr2-rank{info.rank}"), "w").close())
    sys.stdout.write(f"READY {info.rank}\n")  # one write: two ranks share the pipe
    sys.stdout.flush()
    while True:
        time.sleep(0.1)


if __name__ == "__main__":
    dist.run_main(main)
