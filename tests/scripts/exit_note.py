"""A rank's exit note: run the command after DIR, write its exit code to DIR/rank<RANK>.exit, exit with it."""

import os
import subprocess
import sys

folder, cmd = sys.argv[1], sys.argv[2:]
code = subprocess.call(cmd)
rank = next(
    (os.environ[v] for v in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID") if v in os.environ), "0"
)
with open(os.path.join(folder, f"rank{rank}.exit"), "w") as f:
    f.write(str(code))
sys.exit(code)
