"""Simulate context-parallel and pipeline layouts (rank 0) and find their floor (mmm.plan.floor.layout_floor):
print the simulated step, the floor and the ring attention's part alone (a pipeline without CP: its blocks'
memory-bound bytes) as JSON lines."""

import json
import sys
from dataclasses import replace

from mmm.models.llama.recipe import command_line
from mmm.plan import plan
from mmm.plan.fake import simulate_ranks
from mmm.plan.floor import block_step, layout_floor, ring_attention_step
from mmm.plan.hardware import load_hardware

TINY = ["--dim", "64", "--n-heads", "4", "--n-kv-heads", "2", "--seq-len", "64", "--batch-size", "8"]
TINY += ["--vocab-size", "128", "--n-layers", "2", "--dtype", "bf16"]

hw = load_hardware("h100")
for layout in sys.argv[1:]:
    flags = layout.split()
    world = int(flags.pop(0))
    config = command_line().parse([*TINY, *flags])
    how = config.parallel
    (combo,) = [c for c in plan(world, config, strategies=[how.strategy], fixed=how.degrees) if c.valid]
    (report,) = simulate_ranks(config, world=world, ranks=[0], devices_per_node=4, hardware=hw)
    step = report.step
    row = {"layout": layout, "step_s": report.prediction["step_s"], "memory_bytes": step["memory_bytes"]}
    row["cp_p2p_bytes"] = step["comm_by_kind"].get(("cp", "p2p"), 0)
    row["cp_calls"] = step["comm_calls"].get("cp", 0)
    if combo.degrees["cp"] > 1:
        row["ring"] = ring_attention_step(config, world, combo)
    else:
        row["blocks_bytes"] = block_step(config, world, combo)
    row["floor_s"] = layout_floor(config, world, combo, hw, 4)
    # where the memory-bound ops decide (a slow device memory, no latency) and the cp group crosses nodes
    slow = replace(hw, memory_bps=1e9, latency_s=0.0, devices_per_node=2)
    (crossing,) = simulate_ranks(config, world=world, ranks=[0], devices_per_node=2, hardware=slow)
    row["slow_step_s"], row["slow_floor_s"] = crossing.prediction["step_s"], layout_floor(config, world, combo, slow, 2)
    row["slow_memory_s"] = crossing.prediction["memory_s"]
    print(json.dumps(row), flush=True)
