"""Train a Vision Transformer on synthetic images with DDP, FSDP2, HSDP, ZeRO-1/2/3, or TP x FSDP2.

    launch -n 4 python3 -m mmm.examples.vit                        # FSDP2 over 4 ranks
    launch -n 4 python3 -m mmm.examples.vit --tp 2                 # TP 2 x FSDP2 2 on a 2-D mesh
    launch -n 4 python3 -m mmm.examples.vit --strategy zero2       # DeepSpeed ZeRO-2

Images are a fixed random template per class plus noise (learnable, no download). --batch-size
is the GLOBAL batch; the same --seed and global batch give the same losses on any mesh.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mmm.cli import FLAGS, flag_problems, option, override, positive_int
from mmm.data import rank_rows
from mmm.data.images import SyntheticImages
from mmm.flops import counted_flops_per_sample
from mmm.log import get_logger
from mmm.models.vit import VIT_TP_PLAN, ViT, ViTConfig, vit_tp_problems
from mmm.parallel import ParallelSpec, describe_sharding, init_mesh, meta_init
from mmm.parallel.strategy import build_engine
from mmm.training.checkpoints import open_checkpoints
from mmm.training.config import Config, trainer_flags
from mmm.training.evaluation import EvalConfig
from mmm.training.loop import fit
from mmm.training.recorder import Recorder
from mmm.training.schedule import ScheduleConfig
from mmm.training.startup import batch_problems, start
from mmm.training.step import StepSync, evaluate
from mmm.training.summary import compiled_graphs, torchinfo_summary, write_summary

EXAMPLE = "vit"


@dataclass
class ViTTrainConfig(EvalConfig, ScheduleConfig):
    """What to train: the ViT's shape, the global batch and steps, AdamW and its schedule, evaluation."""

    img_size: int = option(32, "--img-size", "--img_size", parse=positive_int, group="model", help="image side")
    patch_size: int = option(
        4, "--patch-size", "--patch_size", parse=positive_int, group="model", help="patch side, divides the image side"
    )
    depth: int = option(4, "--depth", parse=positive_int, group="model", help="transformer blocks")
    num_heads: int = option(
        4, "--num-heads", "--num_heads", parse=positive_int, group="model", help="attention heads (divisible by tp)"
    )
    head_dim: int = option(
        32,
        "--head-dim",
        "--head_dim",
        parse=positive_int,
        group="model",
        help="width per head; model width = heads x head dim",
    )
    num_classes: int = option(10, "--num-classes", "--num_classes", parse=positive_int, group="model", help="classes")
    batch_size: int = option(
        32,
        "--batch-size",
        "--batch_size",
        parse=positive_int,
        group="training",
        help="GLOBAL batch, divisible by the data-parallel ranks",
    )
    max_iters: int = option(
        30, "--max-iters", "--max_iters", parse=positive_int, group="training", help="optimizer steps"
    )
    lr: float = override(ScheduleConfig, "lr", 1e-3)

    def model_config(self):
        return ViTConfig(
            img_size=self.img_size,
            patch_size=self.patch_size,
            depth=self.depth,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            num_classes=self.num_classes,
        )

    def problems(self) -> list[str]:
        out = flag_problems(self) + self.model_config().problems()
        return out + self.schedule_problems(total_steps=self.max_iters) + self.eval_problems()


# the flags: every field of ViTTrainConfig and RunConfig, and these of ParallelConfig (a dp x tp mesh)
COMMAND_LINE = trainer_flags(
    EXAMPLE,
    __doc__,
    ViTTrainConfig,
    parallel=("tp", "dp_replicate", "strategy", "offload_optimizer", "dtype", "compile", "ac"),
    titles={"mesh": "device mesh (dp_replicate x dp_shard x tp = world size; dp_shard is inferred)"},
)


def build_parser():
    return COMMAND_LINE.parser()


def problems(config: Config[ViTTrainConfig], world_size: int) -> list[str]:
    """Every problem with this configuration on ``world_size`` ranks, at once."""
    train, par = config.train, config.parallel
    out = par.problems(world_size) + train.problems()
    if par.pp != 1 or par.cp != 1:
        out.append(f"pp={par.pp}, cp={par.cp}: the ViT trainer runs a dp x tp mesh; leave pp and cp at 1")
    dims = par.dims(world_size)
    if dims is not None:
        out += vit_tp_problems(tp=dims.tp, num_heads=train.num_heads, spell=FLAGS)
        out += batch_problems(train.batch_size, dims.dp)
    return out + config.run.problems(strategy=par.strategy)


def main(argv: Sequence[str] | None = None) -> int:
    config = COMMAND_LINE.parse(argv)  # the flags, parsed once into typed configs
    info, outdir, startup = start(EXAMPLE, config, problems)
    return train(config, info, outdir, startup)


def train(config: Config[ViTTrainConfig], info, outdir, startup) -> int:
    log = get_logger()
    what, how = config.train, config.parallel  # what to train, how to parallelise it (config.run: how to run)
    mesh = init_mesh(**how.degrees)  # dp_replicate x dp_shard x tp
    startup.mark("mesh")
    cfg = what.model_config()
    device = info.device
    data = SyntheticImages(img_size=cfg.img_size, num_classes=cfg.num_classes, channels=cfg.in_chans)
    with meta_init():  # parameters materialise after sharding, seeded by --seed and their names
        model = ViT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    if info.is_main:
        log.info("model: %s (width %d)", cfg, cfg.dim)
        log.info("%s", torchinfo_summary(model))
    mesh.seed_streams(config.run.seed)  # own dropout masks per dp rank from here on
    startup.mark("model")
    spec = ParallelSpec(tp_plan=VIT_TP_PLAN, blocks="blocks", ac=how.ac, compile=how.compile, dtype=how.dtype)
    engine = build_engine(
        model,
        mesh,
        spec,
        strategy=how.strategy,
        device=device,
        global_batch=what.batch_size,
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=what.lr),
        optimizer_args={"lr": what.lr},
        offload_optimizer=how.offload_optimizer,
        seed=config.run.seed,
    )
    if info.is_main:
        log.info("model after parallelisation (%s, %s):\n%s", how.strategy, mesh.dims, describe_sharding(engine.module))
    startup.mark("parallelize")

    dp_rank = mesh.coord("dp")
    meta = {
        "example": EXAMPLE,
        "model": dict(vars(cfg)),
        "mesh": mesh.dims.degrees,
        "strategy": how.strategy,
        "seed": config.run.seed,
        "global_batch": what.batch_size,
        "lr_schedule": what.schedule(total_steps=what.max_iters).as_dict(),
    }
    # the first step: 1, or after the checkpoint --resume names
    checkpoints, start = open_checkpoints(engine, config.run, meta=meta, startup=startup, log=log)
    run = Recorder(
        EXAMPLE,
        info=info,
        outdir=outdir,
        startup=startup,
        config=config,
        resume_step=start - 1,
        sync=StepSync.for_engine(engine, device=device),
        last_good=checkpoints.last_good,
    )
    if info.is_main:
        log.info(
            "training steps %d-%d: global batch %d images of %dx%d (%d per dp rank), dtype=%s, out=%s",
            start,
            what.max_iters,
            what.batch_size,
            cfg.img_size,
            cfg.img_size,
            what.batch_size // mesh.dp,
            how.dtype,
            outdir,
        )

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.float(), labels)

    def batch(step, split="train"):  # this dp rank's rows of the step's global batch
        images, labels = data.global_batch(config.run.seed, step, what.batch_size, split=split)
        return rank_rows(images, dp_rank, mesh.dp).to(device), rank_rows(labels, dp_rank, mesh.dp).to(device)

    # this rank's part of the --eval-iters held-out global batches (the same ones each time)
    heldout = [batch(k, split="val") for k in range(what.eval_iters if what.eval_every else 0)]

    def held_out(step, last):  # the held-out loss every --eval-every steps (left out of the step's dt)
        return {"val_loss": evaluate(engine, heldout, loss_fn, sync=run.sync)} if what.eval_due(step, last=last) else {}

    fit(
        engine,
        run,
        checkpoints,
        steps=range(start, what.max_iters + 1),
        batch=batch,
        loss_fn=loss_fn,
        rates={"samples_per_s": what.batch_size},
        lr_at=what.schedule(total_steps=what.max_iters),  # the step's learning rate: warmup, decay
        evaluate=held_out,
        skip_nonfinite=config.run.on_nonfinite == "skip",
    )

    extra = {
        "mesh": mesh.dims.degrees,
        "strategy": how.strategy,
        "dtype": how.dtype,
        "ac": how.ac,
        "compile": how.compile,
        "compiled_graphs": compiled_graphs(),
        "model": {**vars(cfg), "num_params": n_params},
        "global_batch": what.batch_size,
    }

    flops = counted_flops_per_sample(lambda: ViT(cfg), (cfg.in_chans, cfg.img_size, cfg.img_size))
    write_summary(
        run,
        engine,
        extra,
        mesh=mesh,
        num_params=n_params,
        plots=not config.run.no_plots,
        rate_key="samples_per_s",
        flops_per_unit=flops,
        dtype=how.dtype,
    )
    return 0


if __name__ == "__main__":
    from mmm.dist import run_main

    run_main(main, prog=f"python -m mmm.examples.{EXAMPLE}")
