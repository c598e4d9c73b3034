"""Simulate ranks of an N-rank fsdp_tp job in this machine's processes, before the job queues.

    python -m mmm.plan.simulate --world 512 --tp 8 --init-from ~/models/Llama-3.1-8B   # config.json is enough
    python -m mmm.plan.simulate --world 16384 --tp 8 --dp-replicate 64 --strategy hsdp --dim 4096 ...
    python -m mmm.plan.simulate --world 8 --pp 2 --tp 2 --ranks 0,7 --json sim.json

Each simulated rank joins, in this process and one after another, a fake process group of --world
ranks (collectives return at once, nothing is sent). It runs the trainer's own checks, the real
``init_mesh`` and the real ``parallelize`` (``build_pipeline`` under --pp) on the model built on
meta, and reads what the rank would hold from the sharded parameters themselves (shapes and
placements exact, no memory used): parameter, gradient and AdamW state bytes, in the trainer's own
accounting (``summary.json``'s ``memory_per_rank``). A layout that cannot start at that scale (a
shape that does not split, a plan that does not match) fails here with the trainer's one-line
error. It also times mmm's setup on that rank (mesh, model, parallelize) and reads its peak host
memory: what grows with the world size shows here. By default rank 0 and the last rank (the first
and last pipeline stage) are simulated. Every model and parallel flag of
``python -m mmm.examples.fsdp_tp`` is accepted; --init-from needs only the Hugging Face
config.json (no weights are read).

Not simulated yet: activations and communication per step (``python -m mmm.plan`` estimates them),
and the ZeRO strategies (DeepSpeed needs real collectives to build its engine).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mmm import dist as mdist
from mmm.cli import ArgumentParser, positive_int
from mmm.errors import UsageError, print_error
from mmm.history import atomic_write_text
from mmm.models.llama import Llama, apply_cp_llama
from mmm.parallel import init_mesh, meta_init, parallelize
from mmm.parallel.pipeline import build_pipeline
from mmm.training import llama as recipe
from mmm.training.config import Config
from mmm.training.llama import LlamaTrainConfig, command_line

MIB = 2**20


@dataclass
class RankReport:
    """What one simulated rank holds and what its setup cost."""

    rank: int
    world: int
    coords: dict[str, int]
    """This rank's coordinate on each enabled mesh axis."""
    num_params: int
    """Parameters of the whole model."""
    local_params: int
    """Parameter elements this rank holds (its TP shard of its pipeline stage, over its FSDP share)."""
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    total_bytes: int
    setup_s: dict[str, float] = field(default_factory=dict)
    """Seconds of mmm's setup on this rank: mesh, model (on meta), parallelize."""
    peak_rss_bytes: int = 0


def build_parser() -> ArgumentParser:
    p = command_line().parser()
    p.prog = "python -m mmm.plan.simulate"
    p.description = __doc__.split("\n\n")[0]
    p.epilog = __doc__.split("\n\n", 2)[2]
    g = p.add_argument_group("simulation")
    g.add_argument("--world", type=positive_int, required=True, help="ranks of the job to simulate")
    g.add_argument(
        "--ranks",
        default=None,
        metavar="R,R,...",
        help="which ranks to simulate, comma-separated [0 and the last: the first and last pipeline stage]",
    )
    g.add_argument(
        "--devices-per-node", type=positive_int, default=8, help="ranks per host, for each rank's local rank [8]"
    )
    g.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="also write the reports as JSON")
    return p


def _local_bytes(t) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def simulate_rank(config: Config[LlamaTrainConfig], *, world: int, rank: int, devices_per_node: int = 8) -> RankReport:
    """Rank ``rank`` of a ``world``-rank job with ``config``, simulated in this process: it joins a fake
    process group of ``world`` ranks, which it leaves before returning (so the next rank can)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # torch's test helper: load it only here

    what, how = config.train, config.parallel
    if how.strategy.startswith("zero"):
        raise UsageError(
            f"--strategy {how.strategy} is not simulated (DeepSpeed needs real collectives to build its engine); "
            "simulate fsdp, hsdp or ddp, or estimate it with python -m mmm.plan"
        )
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank % devices_per_node),
        LOCAL_WORLD_SIZE=str(min(devices_per_node, world)),
        MMM_DEVICE="cpu",
    )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    mdist.setup(seed=config.run.seed)
    found = recipe.problems(config, world)
    if found:
        raise UsageError("; ".join(found))
    times = {}
    t0 = time.perf_counter()
    mesh = init_mesh(**how.degrees, device_type="cpu", log_coordinates=False)
    times["mesh"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    cfg = what.model_config()
    with meta_init():
        model = Llama(cfg)
    num_params = sum(p.numel() for p in model.parameters())
    times["model"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if mesh.cp_enabled:
        apply_cp_llama(model, mesh["cp"], seq_len=cfg.seq_len)
    spec = recipe.parallel_spec(how).replace(dp=how.strategy, compile=False)  # the trainer's own
    meta = torch.device("meta")  # shard on meta and stay there: exact shapes, no memory
    if mesh.pp_enabled:

        def loss_fn(logits, labels):
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))

        module = build_pipeline(
            model,
            mesh,
            spec,
            device=meta,
            seed=config.run.seed,
            loss_fn=loss_fn,
            microbatches=how.microbatches,
            schedule=how.pipeline_schedule,
            stages_per_rank=how.stages_per_rank,
            split_points=how.split_points,
        ).module
    else:
        module = parallelize(model, mesh, spec, device=meta, seed=config.run.seed)
    times["parallelize"] = time.perf_counter() - t0
    params = [p for p in module.parameters() if p.requires_grad]
    param_bytes = sum(_local_bytes(p) for p in module.parameters())
    grad_bytes = sum(_local_bytes(p) for p in params)  # fp32 gradients, shaped as the parameters
    optim_bytes = 2 * sum(_local_bytes(p) for p in params)  # AdamW: exp_avg and exp_avg_sq (fp32)
    coords = {axis: mesh.coord(axis) for axis in mesh.dims.enabled_axes()}
    return RankReport(
        rank=rank,
        world=world,
        coords=coords,
        num_params=num_params,
        local_params=sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in module.parameters()),
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optim_bytes=optim_bytes,
        total_bytes=param_bytes + grad_bytes + optim_bytes,
        setup_s=times,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )


def _ranks(spec: str | None, world: int) -> list[int]:
    if spec is None:
        return sorted({0, world - 1})
    try:
        ranks = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--ranks {spec!r}: give rank numbers, comma-separated (e.g. 0,{world - 1})") from None
    bad = [r for r in ranks if not 0 <= r < world]
    if bad or not ranks:
        raise UsageError(f"--ranks {spec!r}: ranks go from 0 to {world - 1} for --world {world}")
    return ranks


def format_reports(reports: list[RankReport]) -> str:
    first = reports[0]
    lines = [
        f"{first.world} ranks simulated ({len(reports)} shown), model of {first.num_params / 1e9:.3g}B parameters",
        f"{'rank':>6}  {'coords':<32} {'params':>12} {'param MiB':>10} {'grad MiB':>9} {'optim MiB':>10} "
        f"{'total MiB':>10}  setup (mesh / model / parallelize)",
    ]
    for r in reports:
        coords = " ".join(f"{k}={v}" for k, v in r.coords.items()) or "-"
        s = r.setup_s
        lines.append(
            f"{r.rank:>6}  {coords:<32} {r.local_params:>12,} {r.param_bytes / MIB:>10.1f} {r.grad_bytes / MIB:>9.1f} "
            f"{r.optim_bytes / MIB:>10.1f} {r.total_bytes / MIB:>10.1f}  "
            f"{s.get('mesh', 0):.2f} / {s.get('model', 0):.2f} / {s.get('parallelize', 0):.2f} s, "
            f"peak host {r.peak_rss_bytes / MIB:.0f} MiB"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    ns = parser.parse_args(argv)
    config = command_line().parse(_trainer_argv(argv))  # the trainer's flags, typed and checked as it does
    reports = []
    for rank in _ranks(ns.ranks, ns.world):
        try:
            reports.append(simulate_rank(config, world=ns.world, rank=rank, devices_per_node=ns.devices_per_node))
        finally:
            mdist.teardown()
    print(format_reports(reports))
    if ns.json_path:
        atomic_write_text(Path(ns.json_path), json.dumps([asdict(r) for r in reports], indent=2) + "\n")
    return 0


def _trainer_argv(argv: list[str]) -> list[str]:
    """``argv`` without the simulation's own flags (and their values): the trainer's flags."""
    own = {"--world", "--ranks", "--devices-per-node", "--json"}
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in own:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def cli() -> None:
    try:
        sys.exit(main())
    except UsageError as e:
        print_error(str(e), prog="python -m mmm.plan.simulate")
        sys.exit(2)


if __name__ == "__main__":
    cli()
