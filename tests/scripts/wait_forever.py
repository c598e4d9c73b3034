"""Sets up, prints READY, then sleeps until a signal ends it (SIGTERM/SIGINT forwarding test).
``--busy DIR``: first 5 s in an uninterrupted section (a checkpoint write), then ``DIR/rank-N`` written."""

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
    if "--busy" in sys.argv:  # a section that must not be cut (a checkpoint write), 5 s, then a mark of its end
        with dist.uninterrupted():
            time.sleep(5)
            with open(f"{sys.argv[sys.argv.index('--busy') + 1]}/rank-{info.rank}", "w") as f:
                f.write("finished")
    while True:
        time.sleep(0.1)


if __name__ == "__main__":
    dist.run_main(main)
