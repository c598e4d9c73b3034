"""Train a small CNN on real handwritten digits with DDP, FSDP2, HSDP or DeepSpeed ZeRO-1/2/3.

    launch -n 2 python3 -m mmm.examples.fsdp                        # FSDP2, bundled 8x8 digits
    launch -n 4 python3 -m mmm.examples.fsdp --strategy zero3       # DeepSpeed ZeRO-3
    launch -n 4 python3 -m mmm.examples.fsdp --data-dir ~/data/mnist  # MNIST IDX files

Data: MNIST when --data-dir holds its IDX files (plain or .gz), else scikit-learn's bundled
8x8 digits (no download). --batch-size is the GLOBAL batch, split over data-parallel ranks;
the same --seed and global batch give the same losses on any number of ranks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from mmm.cli import ArgumentParser, add_output_args, add_run_args, add_strategy_args, positive_int, run_arg_problems
from mmm.errors import UsageError

EXAMPLE = "fsdp"


def build_parser() -> ArgumentParser:
    from mmm.training.schedule import add_schedule_args

    p = ArgumentParser(
        prog=f"python -m mmm.examples.{EXAMPLE}",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
    )
    add_strategy_args(p)
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=positive_int, default=8, help="passes over the training set [8]")
    g.add_argument(
        "--steps-per-epoch",
        type=positive_int,
        default=None,
        help="stop each epoch after N steps (quick runs) [all full batches]",
    )
    g.add_argument(
        "--batch-size",
        "--batch_size",
        dest="batch_size",
        type=positive_int,
        default=64,
        help="GLOBAL training batch, divisible by the data-parallel ranks [64]",
    )
    g.add_argument(
        "--test-batch-size",
        "--test_batch_size",
        dest="test_batch_size",
        type=positive_int,
        default=256,
        help="evaluation batch per rank [256]",
    )
    g.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate [3e-3]")
    g.add_argument(
        "--gamma",
        type=float,
        default=None,
        help="with --lr-schedule epoch: learning-rate factor after each epoch [0.7]",
    )
    g.add_argument("--dropout", type=float, default=0.0, help="dropout probability [0]")
    g.add_argument("--seed", type=int, default=1, help="seed of weights and data order [1]")
    g.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="compute dtype [fp32]")
    g.add_argument(
        "--data-dir",
        "--data_dir",
        dest="data_dir",
        default=None,
        help="folder with MNIST IDX files [bundled 8x8 digits]",
    )
    g.add_argument(
        "--save-model",
        "--save_model",
        dest="save_model",
        action="store_true",
        help="save the trained weights (full state dict) to <outdir>/model.pt",
    )
    add_schedule_args(p, extra_kinds=("epoch",))  # epoch: x --gamma after each epoch, as before
    add_output_args(p, EXAMPLE, log_every=50)
    add_run_args(p)
    return p


def check_args(args, world_size: int) -> None:
    from mmm.parallel import ParallelDims, check_degrees
    from mmm.parallel.strategy import strategy_problems
    from mmm.training import batch_problems
    from mmm.training.schedule import schedule_problems

    degrees = {"dp_replicate": args.dp_replicate, "dp_shard": -1}
    _, problems = check_degrees(world_size, **degrees)
    if not problems:
        dims = ParallelDims(world_size=world_size, **degrees)
        problems += strategy_problems(args.strategy, dims, offload_optimizer=args.offload_optimizer)
        problems += batch_problems(args.batch_size, dims.dp)
    if not 0.0 <= args.dropout < 1.0:
        problems.append(f"--dropout {args.dropout} must be in [0, 1)")
    if args.lr <= 0:
        problems.append(f"--lr {args.lr} must be > 0")
    problems += run_arg_problems(args)
    if (args.lr_schedule or "epoch") == "epoch":
        if args.warmup_steps or args.min_lr is not None or args.lr_decay_steps is not None:
            problems.append(
                "--warmup-steps, --min-lr and --lr-decay-steps need a per-step schedule: add "
                "--lr-schedule cosine, linear or constant (the default, epoch, multiplies by --gamma)"
            )
        if args.gamma is not None and args.gamma <= 0:
            problems.append(f"--gamma {args.gamma} must be > 0")
    else:
        if args.gamma is not None:
            problems.append(f"--gamma {args.gamma} applies to --lr-schedule epoch only (not {args.lr_schedule})")
        problems += schedule_problems(args, total_steps=None)
    if problems:
        raise UsageError("; ".join(problems))


def main(argv: Sequence[str] | None = None) -> int:
    from mmm.training import start

    args, info, outdir, startup = start(EXAMPLE, build_parser(), argv, check_args)
    return train(args, info, outdir, startup)


def train(args, info, outdir, startup) -> int:
    import torch

    from mmm import dist
    from mmm.data.images import epoch_batches, load_digits_data
    from mmm.history import History
    from mmm.log import get_logger
    from mmm.models.cnn import DigitsCNN, log_softmax_nll
    from mmm.parallel import ParallelSpec, init_mesh, meta_init
    from mmm.parallel.strategy import build_engine
    from mmm.training import Run, StepSync, make_checkpointer, resume, should_save, torchinfo_summary, train_step
    from mmm.training.schedule import schedule_from_args, set_lr

    log = get_logger()
    data = load_digits_data(args.data_dir)
    if len(data.train.labels) < args.batch_size:
        raise UsageError(
            f"--batch-size {args.batch_size} is larger than the {len(data.train.labels)} training "
            f"samples of {data.name}"
        )
    mesh = init_mesh(dp_replicate=args.dp_replicate, dp_shard=-1)
    startup.mark("mesh")
    device = info.device
    with meta_init():  # parameters materialise after sharding, seeded by --seed and their names
        model = DigitsCNN(img_size=data.img_size, dropout=args.dropout)
    n_params = sum(p.numel() for p in model.parameters())
    if info.is_main:
        log.info(
            "data: %s, %d train / %d test images of %dx%d",
            data.name,
            len(data.train.labels),
            len(data.test.labels),
            data.img_size,
            data.img_size,
        )
        log.info("%s", torchinfo_summary(model))
    mesh.seed_streams(args.seed)  # own dropout masks per dp rank from here on
    startup.mark("model")
    engine = build_engine(
        model,
        mesh,
        ParallelSpec(blocks=None, dtype=args.dtype),
        strategy=args.strategy,
        device=device,
        global_batch=args.batch_size,
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr),
        optimizer_args={"lr": args.lr},
        offload_optimizer=args.offload_optimizer,
        seed=args.seed,
    )
    if info.is_main:
        log.info("model after parallelisation (%s over %d ranks):\n%s", args.strategy, mesh.dp, engine.module)
    startup.mark("parallelize")

    dp_group, dp_rank, dp = mesh.group("dp"), mesh.coord("dp"), mesh.dp
    local = args.batch_size // dp
    per_epoch = len(epoch_batches(len(data.train.labels), global_batch=args.batch_size, seed=args.seed, epoch=1))
    per_epoch = min(per_epoch, args.steps_per_epoch or per_epoch)
    meta = {
        "example": EXAMPLE,
        "model": {"type": "DigitsCNN", "img_size": data.img_size, "num_params": n_params},
        "mesh": mesh.dims.degrees,
        "strategy": args.strategy,
        "seed": args.seed,
        "global_batch": args.batch_size,
        "steps_per_epoch": per_epoch,
        "lr_schedule": {"kind": "epoch", "lr": args.lr, "gamma": 0.7 if args.gamma is None else args.gamma}
        if (args.lr_schedule or "epoch") == "epoch"
        else schedule_from_args(args, total_steps=args.epochs * per_epoch).as_dict(),
    }
    ckpt = make_checkpointer(args, engine, meta=meta, log=log)
    start = resume(args, ckpt, startup)  # optimizer state carries the decayed learning rate
    first_epoch, skip = (start - 1) // per_epoch + 1, (start - 1) % per_epoch
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
    epochs = History(
        outdir,
        write=info.is_main,
        warmup=0,
        name="epochs",
        step_key="epoch",
        resume=first_epoch - 1 if start > 1 else None,
    )
    train_x, train_y = data.train.images.to(device), data.train.labels.to(device)
    step, stopping = start - 1, False
    per_step_lr = (
        None
        if (args.lr_schedule or "epoch") == "epoch"
        else schedule_from_args(args, total_steps=args.epochs * per_epoch)
    )
    dist.graceful_sigterm()
    for epoch in range(first_epoch, args.epochs + 1):
        t_epoch = time.perf_counter()
        engine.train()
        batches = epoch_batches(len(train_y), global_batch=args.batch_size, seed=args.seed, epoch=epoch)[:per_epoch]
        run.restart_clock()  # the previous epoch's evaluation is not part of this epoch's first step
        losses = []
        for i, idx in enumerate(batches):
            if epoch == first_epoch and i < skip:
                continue  # done before the checkpoint this run resumed from
            poison = run.begin_step(step + 1)
            step += 1
            if per_step_lr is not None:
                set_lr(engine, per_step_lr(step))
            mine = idx[dp_rank * local : (dp_rank + 1) * local].to(device)
            end_of_epoch = i == len(batches) - 1
            last = epoch == args.epochs and end_of_epoch
            _, reduced, times = train_step(
                engine,
                train_x[mine],
                train_y[mine],
                log_softmax_nll,
                sync=run.sync,
                poison=poison,
                skip_nonfinite=args.on_nonfinite == "skip",
                after_backward=(lambda: run.capture_memory(engine)) if last else None,
            )
            # the epoch's mean training loss needs every step's loss: read each step at once (a small model)
            loss_value, stopping = run.reduce_now(
                step,
                reduced,
                times,
                rates={"samples_per_s": args.batch_size},
                grad_norm=engine.grad_norm,
                checkpointer=ckpt,
                lr=engine.param_groups[0]["lr"],
            )
            losses.append(loss_value)
            if end_of_epoch:
                break  # an epoch's last step is saved after its evaluation and learning-rate decay
            if should_save(args, step, last=False, stopping=stopping):
                ckpt.save(step, {"loss": loss_value, "epoch": epoch})
            if stopping:
                break
        if stopping and not end_of_epoch:
            break
        test_loss, test_acc = evaluate(
            engine, data.test, batch=args.test_batch_size, rank=dp_rank, world=dp, group=dp_group, device=device
        )
        test_acc *= 100  # percent: 97.62, not 0.9762
        finite = [x for x in losses if math.isfinite(x)]
        rec = epochs.update(
            epoch,
            dt=time.perf_counter() - t_epoch,
            train_loss=sum(finite) / len(finite) if finite else math.nan,
            test_loss=test_loss,
            test_acc=test_acc,
            lr=engine.param_groups[0]["lr"],
        )
        log.info(
            "epoch=%d dt=%.2f train_loss=%.4f test_loss=%.4f test_acc=%.2f",
            epoch,
            rec["dt"],
            rec["train_loss"],
            test_loss,
            test_acc,
        )
        if per_step_lr is None:  # --lr-schedule epoch
            for group in engine.param_groups:
                group["lr"] *= 0.7 if args.gamma is None else args.gamma
        if should_save(args, step, last=epoch == args.epochs, stopping=stopping):
            ckpt.save(step, {"loss": losses[-1] if losses else None, "epoch": epoch})
        if stopping:
            break
    epochs.finalize(plots=not args.no_plots, print_plots=False, summary_file=None)
    if args.save_model:
        from mmm.training import save_full_model

        save_full_model(engine, outdir / "model.pt", is_main=info.is_main)
    last_epoch = epochs.rows[-1] if epochs.rows else {}  # none when stopped inside the first epoch
    extra = {
        "mesh": mesh.dims.degrees,
        "strategy": args.strategy,
        "dtype": args.dtype,
        "dataset": data.name,
        "model": {"type": "DigitsCNN", "num_params": n_params},
        "global_batch": args.batch_size,
        "epochs": epochs.rows,
        "test_acc": last_epoch.get("test_acc"),
        "test_loss": last_epoch.get("test_loss"),
    }
    from mmm.flops import counted_flops_per_sample

    flops = counted_flops_per_sample(lambda: DigitsCNN(img_size=data.img_size), (1, data.img_size, data.img_size))
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


def evaluate(engine, split, *, batch: int, rank: int, world: int, group, device) -> tuple[float, float]:
    """Loss and accuracy (a fraction) over the whole test set: each rank a padded shard, sums reduced over ranks."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from mmm.data.images import padded_shard

    idx, mask = padded_shard(len(split.labels), rank=rank, world=world)
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    engine.eval()
    with torch.no_grad():
        for i in range(0, len(idx), batch):
            j, m = idx[i : i + batch], mask[i : i + batch].to(device)
            x, y = split.images[j].to(device), split.labels[j].to(device)
            logits = engine(x).float()
            nll = F.cross_entropy(logits, y, reduction="none")
            totals[0] += (nll * m).sum().double()
            totals[1] += ((logits.argmax(1) == y) & m).sum().double()
            totals[2] += m.sum().double()
    if group is not None:
        dist.all_reduce(totals, group=group)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


if __name__ == "__main__":
    from mmm.dist import run_main

    run_main(main, prog=f"python -m mmm.examples.{EXAMPLE}")
