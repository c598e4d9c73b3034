"""Train a Vision Transformer on synthetic images with DDP, FSDP2, HSDP, ZeRO-1/2/3, or TP x FSDP2.

    launch -n 4 python3 -m mmm.examples.vit                        # FSDP2 over 4 ranks
    launch -n 4 python3 -m mmm.examples.vit --tp 2                 # TP 2 x FSDP2 2 on a 2-D mesh
    launch -n 4 python3 -m mmm.examples.vit --strategy zero2       # DeepSpeed ZeRO-2

Images are a fixed random template per class plus noise (learnable, no download). --batch-size
is the GLOBAL batch; the same --seed and global batch give the same losses on any mesh.
"""

from __future__ import annotations

from collections.abc import Sequence

from mmm.cli import (
    ArgumentParser,
    add_output_args,
    add_run_args,
    add_strategy_args,
    degree,
    positive_int,
    run_arg_problems,
)
from mmm.errors import UsageError

EXAMPLE = "vit"


def build_parser() -> ArgumentParser:
    from mmm.parallel.activation_checkpoint import AC_MODES
    from mmm.training.evaluation import add_eval_args
    from mmm.training.schedule import add_schedule_args

    p = ArgumentParser(
        prog=f"python -m mmm.examples.{EXAMPLE}",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
    )
    g = add_strategy_args(p)
    g.add_argument(
        "--tp",
        "--tpsize",
        dest="tp",
        type=degree,
        default=1,
        metavar="N",
        help="tensor-parallel degree for the ViT blocks (with fsdp/hsdp) [1]",
    )
    g = p.add_argument_group("model")
    g.add_argument("--img-size", "--img_size", dest="img_size", type=positive_int, default=32, help="image side [32]")
    g.add_argument(
        "--patch-size",
        "--patch_size",
        dest="patch_size",
        type=positive_int,
        default=4,
        help="patch side, divides the image side [4]",
    )
    g.add_argument("--depth", type=positive_int, default=4, help="transformer blocks [4]")
    g.add_argument(
        "--num-heads",
        "--num_heads",
        dest="num_heads",
        type=positive_int,
        default=4,
        help="attention heads (divisible by tp) [4]",
    )
    g.add_argument(
        "--head-dim",
        "--head_dim",
        dest="head_dim",
        type=positive_int,
        default=32,
        help="width per head; model width = heads x head dim [32]",
    )
    g.add_argument(
        "--num-classes", "--num_classes", dest="num_classes", type=positive_int, default=10, help="classes [10]"
    )
    g = p.add_argument_group("training")
    g.add_argument(
        "--batch-size",
        "--batch_size",
        dest="batch_size",
        type=positive_int,
        default=32,
        help="GLOBAL batch, divisible by the data-parallel ranks [32]",
    )
    g.add_argument(
        "--max-iters", "--max_iters", dest="max_iters", type=positive_int, default=30, help="optimizer steps [30]"
    )
    g.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate [1e-3]")
    g.add_argument("--seed", type=int, default=0, help="seed of weights and data [0]")
    g.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="compute dtype [fp32]")
    g.add_argument("--compile", action="store_true", help="torch.compile each block")
    g.add_argument("--ac", choices=AC_MODES, default="none", help="activation checkpointing [none]")
    add_schedule_args(p)
    add_eval_args(p)
    add_output_args(p, EXAMPLE)
    add_run_args(p)
    return p


def model_config(args):
    from mmm.models.vit import ViTConfig

    return ViTConfig(
        img_size=args.img_size,
        patch_size=args.patch_size,
        depth=args.depth,
        num_heads=args.num_heads,
        head_dim=args.head_dim,
        num_classes=args.num_classes,
    )


def check_args(args, world_size: int) -> None:
    from mmm.parallel import ParallelDims, check_degrees
    from mmm.parallel.compose import compile_problems
    from mmm.parallel.strategy import strategy_problems
    from mmm.parallel.tensor import vit_tp_problems
    from mmm.training import batch_problems
    from mmm.training.evaluation import eval_problems
    from mmm.training.schedule import schedule_problems

    degrees = {"dp_replicate": args.dp_replicate, "dp_shard": -1, "tp": args.tp}
    _, problems = check_degrees(world_size, **degrees)
    mesh_ok = not problems
    problems += model_config(args).problems()
    if mesh_ok:
        dims = ParallelDims(world_size=world_size, **degrees)
        problems += strategy_problems(args.strategy, dims, offload_optimizer=args.offload_optimizer)
        problems += compile_problems(args.compile, dims)
        problems += vit_tp_problems(tp=dims.tp, num_heads=args.num_heads)
        problems += batch_problems(args.batch_size, dims.dp)
    problems += run_arg_problems(args)
    problems += schedule_problems(args, total_steps=args.max_iters)
    problems += eval_problems(args)
    if problems:
        raise UsageError("; ".join(problems))


def main(argv: Sequence[str] | None = None) -> int:
    from mmm.training import start

    args, info, outdir, startup = start(EXAMPLE, build_parser(), argv, check_args)
    return train(args, info, outdir, startup)


def train(args, info, outdir, startup) -> int:
    import time

    import torch
    import torch.nn.functional as F

    from mmm import dist
    from mmm.data.images import SyntheticImages
    from mmm.log import get_logger
    from mmm.models.vit import ViT
    from mmm.parallel import ParallelSpec, describe_sharding, init_mesh, meta_init
    from mmm.parallel.strategy import build_engine
    from mmm.parallel.tensor import VIT_TP_PLAN
    from mmm.training import Run, StepSync, compiled_graphs, make_checkpointer, resume, torchinfo_summary, train_step
    from mmm.training.evaluation import eval_due
    from mmm.training.schedule import schedule_from_args, set_lr
    from mmm.training.step import evaluate

    log = get_logger()
    mesh = init_mesh(tp=args.tp, dp_replicate=args.dp_replicate, dp_shard=-1)
    startup.mark("mesh")
    cfg = model_config(args)
    device = info.device
    data = SyntheticImages(img_size=cfg.img_size, num_classes=cfg.num_classes, channels=cfg.in_chans)
    with meta_init():  # parameters materialise after sharding, seeded by --seed and their names
        model = ViT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    if info.is_main:
        log.info("model: %s (width %d)", cfg, cfg.dim)
        log.info("%s", torchinfo_summary(model))
    mesh.seed_streams(args.seed)  # own dropout masks per dp rank from here on
    startup.mark("model")
    spec = ParallelSpec(tp_plan=VIT_TP_PLAN, blocks="blocks", ac=args.ac, compile=args.compile, dtype=args.dtype)
    engine = build_engine(
        model,
        mesh,
        spec,
        strategy=args.strategy,
        device=device,
        global_batch=args.batch_size,
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr),
        optimizer_args={"lr": args.lr},
        offload_optimizer=args.offload_optimizer,
        seed=args.seed,
    )
    if info.is_main:
        log.info(
            "model after parallelisation (%s, %s):\n%s", args.strategy, mesh.dims, describe_sharding(engine.module)
        )
    startup.mark("parallelize")

    dp_rank, local = mesh.coord("dp"), args.batch_size // mesh.dp
    meta = {
        "example": EXAMPLE,
        "model": dict(vars(cfg)),
        "mesh": mesh.dims.degrees,
        "strategy": args.strategy,
        "seed": args.seed,
        "global_batch": args.batch_size,
        "lr_schedule": schedule_from_args(args, total_steps=args.max_iters).as_dict(),
    }
    ckpt = make_checkpointer(args, engine, meta=meta, log=log)
    start = resume(args, ckpt, startup)
    run = Run(
        EXAMPLE,
        info=info,
        outdir=outdir,
        startup=startup,
        warmup=args.warmup,
        log_every=args.log_every,
        resume_step=start - 1,
        sync=StepSync.for_engine(engine, device=device),
    )
    if info.is_main:
        log.info(
            "training steps %d-%d: global batch %d images of %dx%d (%d per dp rank), dtype=%s, out=%s",
            start,
            args.max_iters,
            args.batch_size,
            cfg.img_size,
            cfg.img_size,
            local,
            args.dtype,
            outdir,
        )

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.float(), labels)

    lr_at = schedule_from_args(args, total_steps=args.max_iters)  # the step's learning rate: warmup, decay
    heldout = []  # this rank's part of the --eval-iters held-out global batches (the same ones each time)
    for k in range(args.eval_iters if args.eval_every else 0):
        x, y = data.global_batch(args.seed, k, args.batch_size, split="val")
        heldout.append(
            (
                x[dp_rank * local : (dp_rank + 1) * local].to(device),
                y[dp_rank * local : (dp_rank + 1) * local].to(device),
            )
        )
    dist.graceful_sigterm()
    engine.train()
    with run:  # leaving on an error, the step read late is still written
        for step in range(start, args.max_iters + 1):
            poison = run.begin_step(step)
            lr = lr_at(step)
            set_lr(engine, lr)
            images, labels = data.global_batch(args.seed, step, args.batch_size)
            images = images[dp_rank * local : (dp_rank + 1) * local].to(device)
            labels = labels[dp_rank * local : (dp_rank + 1) * local].to(device)
            last = step == args.max_iters
            _, reduced, times = train_step(
                engine,
                images,
                labels,
                loss_fn,
                sync=run.sync,
                poison=poison,
                skip_nonfinite=args.on_nonfinite == "skip",
                after_backward=(lambda: run.capture_memory(engine)) if last else None,
            )
            val = {}
            if eval_due(args, step, last=last):  # the held-out loss, left out of the step's dt
                t_eval = time.perf_counter()
                val = {
                    "val_loss": evaluate(engine, heldout, loss_fn, sync=run.sync),
                    "dt_eval": time.perf_counter() - t_eval,
                }
                run.exclude(val["dt_eval"])
            if run.end_step(
                step,
                reduced,
                times,
                args=args,
                checkpointer=ckpt,
                last=last,
                rates={"samples_per_s": args.batch_size},
                grad_norm=engine.grad_norm,
                lr=lr,
                **val,
            ):
                break

    extra = {
        "mesh": mesh.dims.degrees,
        "strategy": args.strategy,
        "dtype": args.dtype,
        "ac": args.ac,
        "compile": args.compile,
        "compiled_graphs": compiled_graphs(),
        "model": {**vars(cfg), "num_params": n_params},
        "global_batch": args.batch_size,
    }
    from mmm.flops import counted_flops_per_sample

    flops = counted_flops_per_sample(lambda: ViT(cfg), (cfg.in_chans, cfg.img_size, cfg.img_size))
    run.finish(
        engine,
        extra,
        mesh=mesh,
        num_params=n_params,
        plots=not args.no_plots,
        rate_key="samples_per_s",
        flops_per_unit=flops,
        dtype=args.dtype,
    )
    return 0


if __name__ == "__main__":
    from mmm.dist import run_main

    run_main(main, prog=f"python -m mmm.examples.{EXAMPLE}")
