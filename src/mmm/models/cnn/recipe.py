"""The digits CNN's recipe (:data:`DIGITS`): what ``python -m mmm.examples.fsdp`` trains, its flags
and its checks. A recipe sits in the training layer beside its model (:mod:`mmm.training.recipe`)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import cache

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mmm.cli import flag_problems, fraction, option, override, positive_float, positive_int
from mmm.data import rank_rows
from mmm.data.images import Digits, epoch_batches, load_digits_data, padded_shard
from mmm.errors import UsageError
from mmm.flops import counted_flops_per_sample
from mmm.history import History
from mmm.models.cnn.model import DigitsCNN, log_softmax_nll
from mmm.parallel.compose import ParallelSpec
from mmm.parallel.meta import count_params
from mmm.training.checkpoints import save_full_model
from mmm.training.config import Config, RunConfig
from mmm.training.recipe import Context, Loop, Recipe
from mmm.training.schedule import SCHEDULES, ScheduleConfig
from mmm.training.startup import batch_problems


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
        256, "--test-batch-size", parse=positive_int, group="training", help="evaluation batch per rank"
    )
    gamma: float | None = option(
        None,
        "--gamma",
        parse=positive_float,
        shown="0.7",
        group="training",
        help="with --lr-schedule epoch: learning-rate factor after each epoch",
    )
    dropout: float = option(0.0, "--dropout", parse=fraction, group="training", help="dropout probability")
    data_dir: str | None = option(
        None,
        "--data-dir",
        metavar="DIR",
        shown="bundled 8x8 digits",
        group="training",
        help="folder with MNIST IDX files",
    )
    save_model: bool = option(
        False, "--save-model", group="training", help="save the trained weights (full state dict) to <outdir>/model.pt"
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


@dataclass
class DigitsConfig:
    """The CNN's shape: the image side (8 for the bundled digits, 28 for MNIST) and its dropout."""

    img_size: int
    dropout: float = 0.0


@cache
def digits(data_dir: str | None) -> Digits:
    """The digits a run trains on (read once per process)."""
    return load_digits_data(data_dir)


class DigitsRecipe(Recipe):
    """A small CNN on real handwritten digits, data parallel only: epochs, a test set, accuracy."""

    name = "fsdp"
    config = DigitsTrainConfig
    run_only = frozenset({"epochs", "steps_per_epoch", "test_batch_size", "gamma", "save_model"})
    run_config = DigitsRunConfig
    parallel_flags = ("dp_replicate", "strategy", "offload_optimizer", "dtype", "microbatches")
    titles = {
        "mesh": "device mesh (dp_replicate x dp_shard = world size; dp_shard is inferred)",
        "pipeline": "gradient accumulation",
    }

    def not_offered(self, field: str) -> str:
        if field == "dp_shard":
            return "the CNN trainer infers dp_shard (dp_replicate x dp_shard = world size)"
        if field in ("compile", "float8", "ac", "reshard_after_forward"):
            return "the CNN trainer does not offer it (python -m mmm.examples.vit and mmm.examples.fsdp_tp do)"
        return (
            "the CNN trainer is data parallel only (python -m mmm.examples.vit adds tp; mmm.examples.fsdp_tp has "
            "every axis)"
        )

    def problems(self, config: Config[DigitsTrainConfig], world_size: int) -> list[str]:
        train, par = config.train, config.parallel
        out = par.problems(world_size)
        if (par.tp, par.pp, par.cp) != (1, 1, 1):
            out.append(f"tp={par.tp}, pp={par.pp}, cp={par.cp}: the CNN trainer is data parallel only; leave them at 1")
        dims = par.dims(world_size)
        if dims is not None:
            out += batch_problems(train.batch_size, dims.dp, microbatches=par.microbatches if dims.pp == 1 else None)
        return out + train.problems() + config.run.problems(strategy=par.strategy)

    def model_config(self, train: DigitsTrainConfig) -> DigitsConfig:
        return DigitsConfig(img_size=digits(train.data_dir).img_size, dropout=train.dropout)

    def build(self, model_config: DigitsConfig) -> DigitsCNN:
        return DigitsCNN(img_size=model_config.img_size, dropout=model_config.dropout)

    def summary(self, model_config: DigitsConfig) -> dict:
        n = count_params(lambda: self.build(model_config))  # as checkpoints recorded it before 0.2
        return {"type": "DigitsCNN", "img_size": model_config.img_size, "num_params": n}

    def spec(self, how, model_config) -> ParallelSpec:
        return ParallelSpec(blocks=None, dtype=how.dtype)

    def loss(self, outputs, targets):
        return log_softmax_nll(outputs, targets)

    def flops_per_unit(self, model_config: DigitsConfig) -> float:
        side = model_config.img_size
        return counted_flops_per_sample(lambda: DigitsCNN(img_size=side), (1, side, side))

    def example_batch(self, model_config: DigitsConfig, *, rows: int, cp: int = 1):
        side = model_config.img_size
        return torch.zeros(rows, 1, side, side), torch.zeros(rows, dtype=torch.long)

    def loop(self, ctx: Context) -> Loop:
        what, seed, device, engine = ctx.config.train, ctx.config.run.seed, ctx.device, ctx.engine
        data = digits(what.data_dir)
        if len(data.train.labels) < what.batch_size:
            raise UsageError(
                f"--batch-size {what.batch_size} is larger than the {len(data.train.labels)} training "
                f"samples of {data.name}"
            )
        ctx.log.info(
            "data: %s, %d train / %d test images of %dx%d",
            data.name,
            len(data.train.labels),
            len(data.test.labels),
            data.img_size,
            data.img_size,
        )
        mesh = ctx.mesh
        dp_group, dp_rank, dp = mesh.group("dp"), mesh.coord("dp"), mesh.dp
        per_epoch = len(epoch_batches(len(data.train.labels), global_batch=what.batch_size, seed=seed, epoch=1))
        per_epoch = min(per_epoch, what.steps_per_epoch or per_epoch)
        total = what.epochs * per_epoch  # the epochs are steps: step s is batch (s - 1) % per_epoch of its epoch

        def epoch_of(step: int) -> int:
            return (step - 1) // per_epoch + 1

        train_x, train_y = data.train.images.to(device), data.train.labels.to(device)
        order: dict[int, list] = {}  # the epoch's index batches: a permutation fixed by --seed and the epoch

        def batch(step):  # this dp rank's rows of the step's global batch
            if not epoch_began[0]:
                epoch_began[0] = time.perf_counter()
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

            schedule = {"kind": "epoch", "lr": what.lr, "gamma": what.decay}
        else:
            lr_at = what.schedule(total_steps=total)
            schedule = lr_at.as_dict()

        def test(step, last):  # after each epoch's last step: loss and accuracy on the whole test set
            if step % per_epoch:
                return {}
            loss, acc = evaluate(
                engine, data.test, batch=what.test_batch_size, rank=dp_rank, world=dp, group=dp_group, device=device
            )
            return {"test_loss": loss, "test_acc": 100 * acc}  # percent: 97.62, not 0.9762

        made: list[History] = []
        epoch_began = [0.0]  # set when the first step begins

        def epochs() -> History:  # one record per epoch: mean training loss, test loss and accuracy
            if not made:  # made once the first step (after --resume) is known
                resume = epoch_of(ctx.start) - 1 if ctx.start > 1 else None
                made.append(
                    History(
                        ctx.outdir, write=ctx.info.is_main, warmup=0, name="epochs", step_key="epoch", resume=resume
                    )
                )
            return made[0]

        def epoch_record(step):  # after each epoch's last step is recorded: the epoch's own record
            if step % per_epoch:
                return
            epoch, now = epoch_of(step), time.perf_counter()
            rows = ctx.run.hist.rows
            losses = [r["loss"] for r in rows if step - per_epoch < r["iter"] <= step and math.isfinite(r["loss"])]
            rec = epochs().update(
                epoch,
                dt=now - epoch_began[0],
                train_loss=sum(losses) / len(losses) if losses else math.nan,
                test_loss=rows[-1]["test_loss"],
                test_acc=rows[-1]["test_acc"],
                lr=lr_at(step),
            )
            epoch_began[0] = now
            ctx.log.info(
                "epoch=%d dt=%.2f train_loss=%.4f test_loss=%.4f test_acc=%.2f",
                epoch,
                rec["dt"],
                rec["train_loss"],
                rec["test_loss"],
                rec["test_acc"],
            )

        def finish():
            epochs().finalize(plots=not ctx.config.run.no_plots, print_plots=False, summary_file=None)
            rows = epochs().rows
            if what.save_model:
                save_full_model(engine, ctx.outdir / "model.pt")
            last_epoch = rows[-1] if rows else {}  # none when stopped inside the first epoch
            return {
                "dataset": data.name,
                "epochs": rows,
                "test_acc": last_epoch.get("test_acc"),
                "test_loss": last_epoch.get("test_loss"),
            }

        return Loop(
            last_step=total,
            lr_at=lr_at,
            batch=batch,
            evaluate=test,
            after_step=epoch_record,
            meta={"steps_per_epoch": per_epoch, "lr_schedule": schedule},
            extra_at=lambda step: {"epoch": epoch_of(step)},
            finish=finish,
        )


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


DIGITS = DigitsRecipe()
