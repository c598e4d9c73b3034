"""Measure this machine as a hardware file for ``python -m mmm.plan.simulate --hardware``.

    python -m mmm.plan.calibrate --ranks 4 --out cpu.json [fsdp_tp model flags]
    python -m mmm.plan.calibrate --ranks 4 --out cpu.json --recipe vit [its model flags]
    python -m mmm.plan.simulate --world 4 --hardware cpu.json --tp 2 ...

Starts ``--ranks`` ranks here with ``launch`` (gloo), all at once so that they share the cores as a
job of that many ranks does, and measures on every rank:

- peak FLOP/s: repeated fp32 matmuls (``mmm.flops.calibrate_cpu``, as the trainer's MFU uses);
- the step's efficiency: forward, backward and AdamW of the model the flags describe, one per rank
  with no collectives, on ``--batch-size / --ranks`` sequences: its model FLOPs over (its time x the
  peak), the ``matmul_efficiency`` of the file;
- bandwidth: a ring all-gather of a 16 MiB result, bytes each rank moves per second;
- latency: the time of a one-number all-reduce.

The slowest rank's figures are written (``devices_per_node`` = ``--ranks``: one node).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path

import torch
import torch.distributed as dist

from mmm import dist as mdist
from mmm.cli import ArgumentParser, nonempty_text, positive_int, without_flags
from mmm.errors import UsageError, print_error
from mmm.files import write_atomic
from mmm.flops import calibrate_cpu
from mmm.plan import run_only_flags
from mmm.training.recipe import Recipe, add_recipe_flag, recipe_from_argv


def build_parser(recipe: Recipe | None = None) -> ArgumentParser:
    recipe = recipe or recipe_from_argv([])[0]
    p = recipe.command_line().parser()
    add_recipe_flag(p)
    p.prog = "python -m mmm.plan.calibrate"
    p.description = __doc__.split("\n\n")[0]
    p.epilog = __doc__.split("\n\n", 2)[2]
    g = p.add_argument_group("calibration")
    g.add_argument("--ranks", type=positive_int, default=4, help="ranks to start here, as the job will [4]")
    g.add_argument("--out", required=True, type=nonempty_text, metavar="PATH", help="the hardware file to write (JSON)")
    g.add_argument("--probe", action="store_true", help="(internal) the measuring rank")
    return p


def _timed(fn, repeat: int) -> float:
    fn()  # warm up
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def probe(config, out: Path) -> None:
    """One rank's measurements (under ``launch``); rank 0 writes the file."""
    info = mdist.setup(seed=0)
    world = info.world_size
    dist.barrier()
    peak = calibrate_cpu("fp32", seconds=1.0)
    recipe = config.recipe
    cfg = recipe.model_config(config.train)
    torch.manual_seed(0)
    model = recipe.build(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = max(1, config.train.batch_size // world)
    inputs, targets = recipe.example_batch(cfg, rows=rows)

    def train_step() -> None:
        loss = recipe.loss(model(inputs), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    dist.barrier()
    step_s = _timed(train_step, 5)
    dist.barrier()
    # the peak again, after the step: a busy machine slows one measurement, and a peak measured low makes
    # the step's efficiency more than 1 (a file --hardware refuses)
    peak = max(peak, calibrate_cpu("fp32", seconds=1.0))
    per_rank = recipe.per_step(replace(config.train, batch_size=rows), cfg)  # tokens or samples
    efficiency = (recipe.flops_per_unit(cfg) or 0.0) * per_rank / (step_s * peak)
    part = torch.zeros(4 * 2**20 // world)  # 16 MiB gathered
    whole = torch.empty(part.numel() * world)
    dist.barrier()
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # its PyTorch 2.13 name
    gather_s = _timed(lambda: gather(whole, part), 5)
    moved = whole.numel() * 4 * (world - 1) / world  # what a ring moves per rank
    one = torch.zeros(1)
    dist.barrier()
    latency_s = _timed(lambda: dist.all_reduce(one), 50)
    found = mdist.gather_objects((peak, efficiency, moved / gather_s, latency_s))
    if min(f[1] for f in found) > 1:  # every rank's step beat its measured peak: the machine was busy
        raise UsageError(
            f"the step reached {min(f[1] for f in found):.2f}x of the matmul peak measured beside it "
            f"({min(f[0] for f in found) / 1e9:.1f} GFLOP/s): other work on this machine disturbed the "
            "measurement; run python -m mmm.plan.calibrate again with the machine idle (nothing was written)"
        )
    if info.rank == 0:
        peak_min = min(f[0] for f in found)
        hw = {
            "name": f"this machine ({os.cpu_count()} cores, {world} ranks)",
            "devices_per_node": world,
            "memory_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world / 1e9,
            "peak_tflops": {"fp32": peak_min / 1e12},
            "intra_node_gbps": min(f[2] for f in found) / 1e9,
            "inter_node_gbps": min(f[2] for f in found) / 1e9,
            "latency_us": max(f[3] for f in found) * 1e6,
            "matmul_efficiency": min(f[1] for f in found),
            "cores_per_node": len(os.sched_getaffinity(0)),
            "source": f"python -m mmm.plan.calibrate --ranks {world}, {time.strftime('%Y-%m-%d %H:%M')}",
            "model": {"recipe": recipe.name, **recipe.summary(cfg), "rows_per_rank": rows},
        }
        write_atomic(out, json.dumps(hw, indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    recipe, own = recipe_from_argv(argv)
    ns = build_parser(recipe).parse_args(own)
    out = Path(ns.out).expanduser()
    trainer_argv = without_flags(argv, {"--ranks", "--out"}, {"--probe"})  # --recipe goes on to the ranks
    config = recipe.command_line().parse(without_flags(own, {"--ranks", "--out"}, {"--probe"}))
    _refuse_layout_flags(config)
    problems = recipe.layout_free_problems(config, 1)  # each rank measures one whole model
    if problems:
        raise UsageError("; ".join(problems))
    if not recipe.flops_per_unit(recipe.model_config(config.train)):
        raise UsageError(f"--recipe {recipe.name}: its model's FLOPs are not known (Recipe.flops_per_unit)")
    if ns.probe:  # a rank under launch: run_main (cli) tears the job down cleanly on every rank
        probe(config, out)
        return 0
    if not out.parent.is_dir():
        raise UsageError(f"--out {ns.out}: folder {out.parent} does not exist")
    if out.is_dir():
        raise UsageError(f"--out {ns.out} is a folder; give the path of the JSON file to write")
    if ns.ranks < 2:
        raise UsageError(f"--ranks {ns.ranks}: bandwidth needs at least 2 ranks; give the ranks per node of your job")
    launch = str(Path(sys.executable).parent / "launch")
    cmd = [launch, "-q", "-n", str(ns.ranks), sys.executable, "-m", "mmm.plan.calibrate", "--probe"]
    cmd += ["--out", str(out), *trainer_argv]
    res = subprocess.run(cmd, stdin=subprocess.DEVNULL)
    if res.returncode != 0:
        return res.returncode
    hw = json.loads(out.read_text())
    print(
        f"{out}: {hw['name']}: {hw['peak_tflops']['fp32'] * 1e3:.1f} GFLOP/s fp32 per rank, step efficiency "
        f"{hw['matmul_efficiency']:.2f}, {hw['intra_node_gbps']:.2f} GB/s per rank, latency {hw['latency_us']:.0f} us"
    )
    return 0


def _refuse_layout_flags(config) -> None:
    """Calibration measures the machine with the model's shape and batch, fp32, one model per rank: a
    layout or run flag would change nothing, so it is refused rather than ignored."""
    default = type(config.parallel)()
    changed = [
        f"--{f.name.replace('_', '-')}"
        for f in fields(config.parallel)
        if getattr(config.parallel, f.name) != getattr(default, f.name)
    ]
    if config.recipe.picks_layout(config):
        changed.append("--pick-layout")
    changed += [flag for flag in run_only_flags(config) if flag not in changed]  # where a run writes, how long
    if changed:
        raise UsageError(
            f"{', '.join(changed)}: calibration measures the machine (fp32 matmuls, one model per rank, gloo), "
            "not a layout or a run; drop them (give only the model's shape and --batch-size)"
        )


def cli() -> None:
    if "--probe" in sys.argv[1:]:
        mdist.run_main(main, prog="python -m mmm.plan.calibrate")
    try:
        sys.exit(main())
    except UsageError as e:
        print_error(str(e), prog="python -m mmm.plan.calibrate")
        sys.exit(2)


if __name__ == "__main__":
    cli()
