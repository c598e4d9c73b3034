"""A simulated rank's peak memory against the same rank run for real on one device.

    python benchmarks/fsdp_peak.py                       # on a machine with one CUDA device
    python benchmarks/fsdp_peak.py --out fsdp_peak.json
    python benchmarks/fsdp_peak.py --device cpu          # the same runs, nothing measured: a check

``python -m mmm.plan.simulate`` predicts a rank's peak memory from fake tensors. One device can check
that for a rank of a many-rank job: rank 0 of each layout below runs here twice, in this process. For
real: joined to a fake process group of the layout's ranks (its collectives return at once: the values
are wrong, every buffer and its lifetime are the real ones: FSDP's gathered blocks, TP's activations,
the optimizer state), the trainer's engine on the device takes two steps (the first makes the AdamW
state), the second watched by ``torch.cuda.max_memory_allocated``. Simulated: ``simulate_ranks`` on
fake tensors, as ``--pick`` does. Prints both peaks and their ratio. Pipelines are left out: a stage's
real first step waits for its neighbours' shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from mmm import dist as mdist
from mmm.measure import PeakMemory
from mmm.models.llama import Llama, recipe
from mmm.models.llama.recipe import command_line
from mmm.parallel import init_mesh, meta_init
from mmm.plan.fake import forget_meshes, held_before_step, simulate_ranks
from mmm.training.step import StepSync, train_step

MODEL = ["--dim", "2048", "--n-layers", "8", "--n-heads", "16", "--vocab-size", "32000", "--seq-len", "1024"]
LAYOUTS = [  # world, then the trainer's flags
    "8 --dp-shard 8",
    "8 --dp-shard 8 --ac full",
    "8 --tp 2 --dp-shard 4",
    "8 --tp 2 --dp-shard 4 --ac full",
    "8 --dp-replicate 2 --dp-shard 4 --strategy hsdp",
    "64 --tp 8 --dp-shard 8 --ac selective",
]


def measured_peak(config, world: int, device: torch.device) -> tuple[int | None, int]:
    """Rank 0 of ``world`` on ``device`` for real, over a fake process group: its second step's peak
    allocated bytes (None on a CPU: no allocator to ask), and the most bytes of tensor storage alive at
    once in it, as the simulator counts them (``mmm.measure.PeakMemory``, in a third step): what the
    allocator holds beyond the tensors alive (buffers freed on one stream, kept for another) is the
    difference."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # torch's test helper: load it only here

    what, how = config.train, config.parallel
    os.environ.update(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(min(8, world)))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mdist.setup(seed=config.run.seed)
        mesh = init_mesh(**how.degrees, device_type=device.type, log_coordinates=False)
        cfg = what.model_config()
        with meta_init():
            model = Llama(cfg)
        engine = recipe.make_engine(model, mesh, config, device=device)
        del model
        tokens = torch.randint(0, cfg.vocab_size, (what.batch_size // mesh.dp, cfg.seq_len // mesh.cp), device=device)
        sync = StepSync.for_engine(engine, device=device)
        train_step(engine, tokens, tokens, recipe.loss_fn, sync=sync)  # the AdamW state, as every later step
        allocated = None
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            train_step(engine, tokens, tokens, recipe.loss_fn, sync=sync)
            torch.cuda.synchronize()
            allocated = torch.cuda.max_memory_allocated()
        with PeakMemory(held_before_step(engine, tokens)) as alive:
            train_step(engine, tokens, tokens, recipe.loss_fn, sync=sync)
        return allocated, alive.peak
    finally:
        mdist.teardown()
        forget_meshes()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", nargs="+", default=LAYOUTS, help="each: world, then the trainer's flags")
    ap.add_argument("--model", default=" ".join(MODEL), help="the trainer's model flags [%(default)s]")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="also write the rows as JSON")
    ns = ap.parse_args()
    device = torch.device(ns.device)
    rows = []
    head = f"{'layout':<48}{'allocated GiB':>14}{'alive GiB':>11}{'simulated GiB':>15}"
    head += f"{'sim / alloc':>12}{'sim / alive':>12}"
    print(head, flush=True)
    for layout in ns.layouts:
        flags = layout.split()
        world = int(flags.pop(0))
        batch = ["--batch-size", str(2 * world)]
        config = command_line().parse([*ns.model.split(), *batch, "--dtype", "bf16", *flags])
        measured, alive = measured_peak(config, world, device)
        # the norms as the measured device runs them (fused on CUDA, as --pick simulates them on a GPU preset)
        (sim,) = simulate_ranks(config, world=world, ranks=[0], fused_norms=device.type == "cuda")
        simulated = sim.step["peak"]["total"]
        ratio = simulated / measured if measured else None
        row = {"layout": layout, "allocated_bytes": measured, "alive_bytes": alive, "simulated_bytes": simulated}
        rows.append(row | {"ratio": ratio, "ratio_alive": simulated / alive})
        shown = f"{measured / 2**30:>14.2f}" if measured else f"{'-':>14}"
        shown_ratio = f"{ratio:>12.3f}" if ratio else f"{'-':>12}"
        line = f"{layout:<48}{shown}{alive / 2**30:>11.2f}{simulated / 2**30:>15.2f}{shown_ratio}"
        print(f"{line}{simulated / alive:>12.3f}", flush=True)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "rows": rows}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
