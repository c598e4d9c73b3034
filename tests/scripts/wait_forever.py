"""Sets up, prints READY, then sleeps until a signal ends it (SIGTERM/SIGINT forwarding test)."""

import time

from mmm import dist


def main(argv=None):
    info = dist.setup()
    print(f"READY {info.rank}", flush=True)
    while True:
        time.sleep(0.1)


if __name__ == "__main__":
    dist.run_main(main)
