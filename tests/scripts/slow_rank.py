"""The Llama trainer with one slow rank: rank SLOW_RANK sleeps SLOW_SECONDS at the end of every step
(host work after the step's collectives, as a slow data loader or a busy host would), so that
--rank-timings has a straggler to name.

    SLOW_RANK=1 SLOW_SECONDS=0.3 launch -n 2 python3 tests/scripts/slow_rank.py --rank-timings ...
"""

import os
import time

from mmm.dist import run_main
from mmm.examples.fsdp_tp import main
from mmm.training.recorder import Recorder

SLOW_RANK = int(os.environ["SLOW_RANK"])
SLOW_SECONDS = float(os.environ["SLOW_SECONDS"])
_end_step = Recorder.end_step


def end_step(self, step, *args, **kwargs):
    if self.info.rank == SLOW_RANK:
        time.sleep(SLOW_SECONDS)
    return _end_step(self, step, *args, **kwargs)


Recorder.end_step = end_step

if __name__ == "__main__":
    run_main(main, prog="slow_rank.py")
