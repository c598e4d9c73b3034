"""Simulate layouts whole and by blocks (mmm.plan.fake.simulate_by_blocks); print both as JSON lines."""

import json
import sys

from mmm.models.llama.recipe import command_line
from mmm.plan.fake import simulate_by_blocks, simulate_ranks
from mmm.plan.hardware import load_hardware

TINY = ["--dim", "64", "--n-heads", "4", "--seq-len", "32", "--batch-size", "8", "--vocab-size", "128"]
KEYS = ("num_params", "local_params", "param_bytes", "grad_bytes", "optim_bytes", "total_bytes")

hw = load_hardware("h100")
for layout in sys.argv[1:]:
    flags = layout.split()
    world = int(flags.pop(0))
    config = command_line().parse([*TINY, *flags])  # a layout may set its own sizes
    ranks = [0, world - 1]
    whole = simulate_ranks(config, world=world, ranks=ranks, devices_per_node=4, hardware=hw)
    parts = simulate_by_blocks(config, world=world, ranks=ranks, devices_per_node=4, hardware=hw)
    for w, b in zip(whole, parts, strict=True):
        row = {"layout": layout, "rank": w.rank}
        for name, r in (("whole", w), ("blocks", b)):
            step = {k: r.step[k] for k in ("comm_bytes", "comm_calls", "activation_bytes", "peak")}
            row[name] = {**{k: getattr(r, k) for k in KEYS}, **step, "step_s": r.prediction["step_s"]}
        row["extrapolated"] = "extrapolated_from_blocks" in b.step
        print(json.dumps(row), flush=True)
