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
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mmm.cli import flag_problems, option, override, positive_int
from mmm.data import rank_rows
from mmm.data.images import epoch_batches, load_digits_data, padded_shard
from mmm.errors import UsageError
from mmm.flops import counted_flops_per_sample
from mmm.history import History
from mmm.log import get_logger
from mmm.models.cnn import DigitsCNN, log_softmax_nll
from mmm.parallel import ParallelSpec, init_mesh, meta_init
from mmm.parallel.strategy import build_engine
from mmm.training.checkpoints import open_checkpoints, save_full_model
from mmm.training.config import Config, RunConfig, trainer_flags
from mmm.training.loop import fit
from mmm.training.recorder import Recorder
from mmm.training.schedule import SCHEDULES, ScheduleConfig
from mmm.training.startup import batch_problems, start
from mmm.training.step import StepSync
from mmm.training.summary import torchinfo_summary, write_summary

EXAMPLE = "fsdp"


@dataclass
class DigitsTrainConfig(ScheduleConfig):
    """What to train: a small CNN on digits for some epochs, AdamW with a decay after each epoch
    (``--lr-schedule epoch``, as the seed's example had) or a per-step schedule."""

    epochs: int = option(8, "--epochs", parse=positive_int, group="training", help="passes over the training set")
    steps_per_epoch: int | None = option(
        None,
        "--steps-per-epoch",
        parse=positive_int,
        shown="all full batches",
        group="training",
        help="stop each epoch after N steps (quick runs)",
    )
    batch_size: int = option(
        64,
        "--batch-size",
        "--batch_size",
        parse=positive_int,
        group="training",
        help="GLOBAL training batch, divisible by the data-parallel ranks",
    )
    test_batch_size: int = option(
        256,
        "--test-batch-size",
        "--test_batch_size",
        parse=positive_int,
        group="training",
        help="evaluation batch per rank",
    )
    gamma: float | None = option(
        None,
        "--gamma",
        parse=float,
        shown="0.7",
        group="training",
        help="with --lr-schedule epoch: learning-rate factor after each epoch",
    )
    dropout: float = option(0.0, "--dropout", group="training", help="dropout probability")
    data_dir: str | None = option(
        None,
        "--data-dir",
        "--data_dir",
        metavar="DIR",
        shown="bundled 8x8 digits",
        group="training",
        help="folder with MNIST IDX files",
    )
    save_model: bool = option(
        False,
        "--save-model",
        "--save_model",
        group="training",
        help="save the trained weights (full state dict) to <outdir>/model.pt",
    )
    lr_schedule: str | None = override(
        ScheduleConfig,
        "lr_schedule",
        choices=(*SCHEDULES, "epoch"),
        shown="epoch",
        help="decay after the warmup; epoch: x --gamma after each epoch",
    )

    @property
    def per_epoch(self) -> bool:
        """True: the learning rate decays by ``decay`` after each epoch (no per-step schedule)."""
        return (self.lr_schedule or "epoch") == "epoch"

    @property
    def decay(self) -> float:
        return 0.7 if self.gamma is None else self.gamma

    def problems(self) -> list[str]:
        out = flag_problems(self)
        if not 0.0 <= self.dropout < 1.0:
            out.append(f"--dropout {self.dropout} must be in [0, 1)")
        if self.lr <= 0:
            out.append(f"--lr {self.lr} must be > 0")
        if self.per_epoch:
            if self.warmup_steps or self.min_lr is not None or self.lr_decay_steps is not None:
                out.append(
                    "--warmup-steps, --min-lr and --lr-decay-steps need a per-step schedule: add "
                    "--lr-schedule cosine, linear or constant (the default, epoch, multiplies by --gamma)"
                )
            if self.gamma is not None and self.gamma <= 0:
                out.append(f"--gamma {self.gamma} must be > 0")
        else:
            if self.gamma is not None:
                out.append(f"--gamma {self.gamma} applies to --lr-schedule epoch only (not {self.lr_schedule})")
            out += self.schedule_problems(total_steps=None)
        return out


@dataclass
class DigitsRunConfig(RunConfig):
    """The CNN's runs: seed 1 (as the seed's example had), a step line every 50 steps."""

    seed: int = override(RunConfig, "seed", 1)
    log_every: int = override(RunConfig, "log_every", 50)


# the flags: every field of DigitsTrainConfig and DigitsRunConfig, and these of ParallelConfig (data parallel only)
COMMAND_LINE = trainer_flags(
    EXAMPLE,
    __doc__,
    DigitsTrainConfig,
    parallel=("dp_replicate", "strategy", "offload_optimizer", "dtype"),
    run=DigitsRunConfig,
    titles={"mesh": "device mesh (dp_replicate x dp_shard = world size; dp_shard is inferred)"},
)


def build_parser():
    return COMMAND_LINE.parser()


def problems(config: Config[DigitsTrainConfig], world_size: int) -> list[str]:
    """Every problem with this configuration on ``world_size`` ranks, at once."""
    train, par = config.train, config.parallel
    out = par.problems(world_size)
    if (par.tp, par.pp, par.cp) != (1, 1, 1):
        out.append(f"tp={par.tp}, pp={par.pp}, cp={par.cp}: the CNN trainer is data parallel only; leave them at 1")
    dims = par.dims(world_size)
    if dims is not None:
        out += batch_problems(train.batch_size, dims.dp)
    return out + train.problems() + config.run.problems(strategy=par.strategy)


def main(argv: Sequence[str] | None = None) -> int:
    config = COMMAND_LINE.parse(argv)  # the flags, parsed once into typed configs
    info, outdir, startup = start(EXAMPLE, config, problems)
    return train(config, info, outdir, startup)


def train(config: Config[DigitsTrainConfig], info, outdir, startup) -> int:
    log = get_logger()
    what, how = config.train, config.parallel  # what to train, how to parallelise it (config.run: how to run)
    seed = config.run.seed  # weights, data order, dropout
    data = load_digits_data(what.data_dir)
    if len(data.train.labels) < what.batch_size:
        raise UsageError(
            f"--batch-size {what.batch_size} is larger than the {len(data.train.labels)} training "
            f"samples of {data.name}"
        )
    mesh = init_mesh(**how.degrees)  # dp_replicate x dp_shard
    startup.mark("mesh")
    device = info.device
    with meta_init():  # parameters materialise after sharding, seeded by --seed and their names
        model = DigitsCNN(img_size=data.img_size, dropout=what.dropout)
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
    mesh.seed_streams(seed)  # own dropout masks per dp rank from here on
    startup.mark("model")
    engine = build_engine(
        model,
        mesh,
        ParallelSpec(blocks=None, dtype=how.dtype),
        strategy=how.strategy,
        device=device,
        global_batch=what.batch_size,
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=what.lr),
        optimizer_args={"lr": what.lr},
        offload_optimizer=how.offload_optimizer,
        seed=seed,
    )
    if info.is_main:
        log.info("model after parallelisation (%s over %d ranks):\n%s", how.strategy, mesh.dp, engine.module)
    startup.mark("parallelize")

    dp_group, dp_rank, dp = mesh.group("dp"), mesh.coord("dp"), mesh.dp
    per_epoch = len(epoch_batches(len(data.train.labels), global_batch=what.batch_size, seed=seed, epoch=1))
    per_epoch = min(per_epoch, what.steps_per_epoch or per_epoch)
    total = what.epochs * per_epoch  # the epochs are steps: step s is batch (s - 1) % per_epoch of its epoch

    def epoch_of(step: int) -> int:
        return (step - 1) // per_epoch + 1

    meta = {
        "example": EXAMPLE,
        "model": {"type": "DigitsCNN", "img_size": data.img_size, "num_params": n_params},
        "mesh": mesh.dims.degrees,
        "strategy": how.strategy,
        "seed": seed,
        "global_batch": what.batch_size,
        "steps_per_epoch": per_epoch,
        "lr_schedule": {"kind": "epoch", "lr": what.lr, "gamma": what.decay}
        if what.per_epoch
        else what.schedule(total_steps=total).as_dict(),
    }
    checkpoints, start = open_checkpoints(
        engine, config.run, meta=meta, startup=startup, log=log, extra_at=lambda step: {"epoch": epoch_of(step)}
    )
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
    epochs = History(  # one record per epoch: mean training loss, test loss and accuracy
        outdir,
        write=info.is_main,
        warmup=0,
        name="epochs",
        step_key="epoch",
        resume=epoch_of(start) - 1 if start > 1 else None,
    )
    train_x, train_y = data.train.images.to(device), data.train.labels.to(device)
    order: dict[int, list] = {}  # the epoch's index batches: a permutation fixed by --seed and the epoch

    def batch(step):  # this dp rank's rows of the step's global batch
        epoch = epoch_of(step)
        if epoch not in order:
            order.clear()
            order[epoch] = epoch_batches(len(train_y), global_batch=what.batch_size, seed=seed, epoch=epoch)
        mine = rank_rows(order[epoch][(step - 1) % per_epoch], dp_rank, dp).to(device)
        return train_x[mine], train_y[mine]

    if what.per_epoch:  # --lr-schedule epoch: x --gamma after each epoch

        def lr_at(step: int) -> float:
            lr = what.lr
            for _ in range(epoch_of(step) - 1):
                lr *= what.decay
            return lr

    else:
        lr_at = what.schedule(total_steps=total)

    def test(step, last):  # after each epoch's last step: loss and accuracy on the whole test set
        if step % per_epoch:
            return {}
        loss, acc = evaluate(
            engine, data.test, batch=what.test_batch_size, rank=dp_rank, world=dp, group=dp_group, device=device
        )
        return {"test_loss": loss, "test_acc": 100 * acc}  # percent: 97.62, not 0.9762

    epoch_began = [time.perf_counter()]

    def epoch_record(step):  # after each epoch's last step is recorded: the epoch's own record
        if step % per_epoch:
            return
        epoch, now = epoch_of(step), time.perf_counter()
        rows = run.hist.rows
        losses = [r["loss"] for r in rows if step - per_epoch < r["iter"] <= step and math.isfinite(r["loss"])]
        rec = epochs.update(
            epoch,
            dt=now - epoch_began[0],
            train_loss=sum(losses) / len(losses) if losses else math.nan,
            test_loss=rows[-1]["test_loss"],
            test_acc=rows[-1]["test_acc"],
            lr=lr_at(step),
        )
        epoch_began[0] = now
        log.info(
            "epoch=%d dt=%.2f train_loss=%.4f test_loss=%.4f test_acc=%.2f",
            epoch,
            rec["dt"],
            rec["train_loss"],
            rec["test_loss"],
            rec["test_acc"],
        )

    fit(
        engine,
        run,
        checkpoints,
        steps=range(start, total + 1),
        batch=batch,
        loss_fn=log_softmax_nll,
        rates={"samples_per_s": what.batch_size},
        lr_at=lr_at,
        evaluate=test,
        after_step=epoch_record,
        skip_nonfinite=config.run.on_nonfinite == "skip",
    )
    epochs.finalize(plots=not config.run.no_plots, print_plots=False, summary_file=None)
    if what.save_model:
        save_full_model(engine, outdir / "model.pt", is_main=info.is_main)
    last_epoch = epochs.rows[-1] if epochs.rows else {}  # none when stopped inside the first epoch
    extra = {
        "mesh": mesh.dims.degrees,
        "strategy": how.strategy,
        "dtype": how.dtype,
        "dataset": data.name,
        "model": {"type": "DigitsCNN", "num_params": n_params},
        "global_batch": what.batch_size,
        "epochs": epochs.rows,
        "test_acc": last_epoch.get("test_acc"),
        "test_loss": last_epoch.get("test_loss"),
    }

    flops = counted_flops_per_sample(lambda: DigitsCNN(img_size=data.img_size), (1, data.img_size, data.img_size))
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


def evaluate(engine, split, *, batch: int, rank: int, world: int, group, device) -> tuple[float, float]:
    """Loss and accuracy (a fraction) over the whole test set: each rank a padded shard, sums reduced over ranks."""
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
