"""The ViT's recipe (:data:`VIT`): what ``python -m mmm.examples.vit`` trains, its flags and its
checks. A recipe sits in the training layer beside its model (:mod:`mmm.training.recipe`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from mmm.cli import FLAGS, flag_problems, option, override, positive_int
from mmm.data import rank_rows
from mmm.data.images import SyntheticImages
from mmm.flops import counted_flops_per_sample
from mmm.models.vit.model import ViT, ViTConfig
from mmm.models.vit.tp import VIT_TP_PLAN, vit_tp_problems
from mmm.parallel.compose import ParallelSpec
from mmm.training.config import Config
from mmm.training.evaluation import EvalConfig
from mmm.training.recipe import Context, Loop, Recipe, Shape
from mmm.training.schedule import ScheduleConfig
from mmm.training.startup import batch_problems
from mmm.training.step import evaluate


@dataclass
class ViTTrainConfig(EvalConfig, ScheduleConfig):
    """What to train: the ViT's shape, the global batch and steps, AdamW and its schedule, evaluation."""

    img_size: int = option(32, "--img-size", parse=positive_int, group="model", help="image side")
    patch_size: int = option(
        4, "--patch-size", parse=positive_int, group="model", help="patch side, divides the image side"
    )
    depth: int = option(4, "--depth", parse=positive_int, group="model", help="transformer blocks")
    num_heads: int = option(
        4, "--num-heads", parse=positive_int, group="model", help="attention heads (divisible by tp)"
    )
    head_dim: int = option(
        32, "--head-dim", parse=positive_int, group="model", help="width per head; model width = heads x head dim"
    )
    num_classes: int = option(10, "--num-classes", parse=positive_int, group="model", help="classes")
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

    def model_config(self) -> ViTConfig:
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


class ViTRecipe(Recipe):
    """A Vision Transformer on synthetic images (a fixed random template per class plus noise)."""

    name = "vit"
    config = ViTTrainConfig
    # a dp x tp mesh: its degrees, the data-parallel strategy, dtype, compile and AC
    parallel_flags = (
        "tp",
        "dp_replicate",
        "strategy",
        "offload_optimizer",
        "dtype",
        "compile",
        "float8",
        "ac",
        "microbatches",
    )
    titles = {
        "mesh": "device mesh (dp_replicate x dp_shard x tp = world size; dp_shard is inferred)",
        "pipeline": "gradient accumulation",
    }

    def not_offered(self, field: str) -> str:
        if field == "dp_shard":
            return "the ViT trainer infers dp_shard (dp_replicate x dp_shard x tp = world size)"
        if field == "reshard_after_forward":
            return "the ViT trainer does not offer it (python -m mmm.examples.fsdp_tp does)"
        return (
            "the ViT trainer runs a dp x tp mesh: no pipeline, context or expert parallel (python -m "
            "mmm.examples.fsdp_tp has them)"
        )

    def problems(self, config: Config[ViTTrainConfig], world_size: int) -> list[str]:
        train, par = config.train, config.parallel
        out = par.problems(world_size) + train.problems()
        if par.pp != 1 or par.cp != 1:
            out.append(f"pp={par.pp}, cp={par.cp}: the ViT trainer runs a dp x tp mesh; leave pp and cp at 1")
        dims = par.dims(world_size)
        if dims is not None:
            out += vit_tp_problems(tp=dims.tp, num_heads=train.num_heads, spell=FLAGS)
            out += batch_problems(train.batch_size, dims.dp, microbatches=par.microbatches if dims.pp == 1 else None)
        return out + config.run.problems(strategy=par.strategy)

    def build(self, model_config: ViTConfig) -> ViT:
        return ViT(model_config)

    def describe(self, model_config: ViTConfig) -> str:
        return f"model: {model_config} (width {model_config.dim})"

    def spec(self, how, model_config) -> ParallelSpec:
        return ParallelSpec(
            tp_plan=VIT_TP_PLAN, blocks="blocks", ac=how.ac, compile=how.compile, dtype=how.dtype, float8=how.float8
        )

    def loss(self, outputs, targets):
        return F.cross_entropy(outputs.float(), targets)

    def flops_per_unit(self, model_config: ViTConfig) -> float:
        shape = (model_config.in_chans, model_config.img_size, model_config.img_size)
        return counted_flops_per_sample(lambda: ViT(model_config), shape)

    def example_batch(self, model_config: ViTConfig, *, rows: int, cp: int = 1):
        c = model_config
        return torch.zeros(rows, c.in_chans, c.img_size, c.img_size), torch.zeros(rows, dtype=torch.long)

    def shape(self, model_config: ViTConfig) -> Shape:
        c = model_config
        return Shape(
            blocks=c.depth,
            seq_len=(c.img_size // c.patch_size) ** 2 + 1,
            heads=c.num_heads,
            kv_heads=c.num_heads,
            head_dim=c.head_dim,
        )

    def with_blocks(self, model_config: ViTConfig, blocks: int) -> ViTConfig:
        return replace(model_config, depth=blocks)

    def loop(self, ctx: Context) -> Loop:
        what, cfg, mesh, seed = ctx.config.train, ctx.model_config, ctx.mesh, ctx.config.run.seed
        data = SyntheticImages(img_size=cfg.img_size, num_classes=cfg.num_classes, channels=cfg.in_chans)
        dp_rank = mesh.coord("dp")

        def batch(step, split="train"):  # this dp rank's rows of the step's global batch
            images, labels = data.global_batch(seed, step, what.batch_size, split=split)
            return rank_rows(images, dp_rank, mesh.dp).to(ctx.device), rank_rows(labels, dp_rank, mesh.dp).to(
                ctx.device
            )

        # this rank's part of the --eval-iters held-out global batches (the same ones each time)
        heldout = [batch(k, split="val") for k in range(what.eval_batches if what.eval_every else 0)]

        def held_out(step, last):  # the held-out loss every --eval-every steps (left out of the step's dt)
            if not what.eval_due(step, last=last):
                return {}
            return {"val_loss": evaluate(ctx.engine, heldout, self.loss, sync=ctx.run.sync)}

        schedule = what.schedule(total_steps=what.max_iters)
        return Loop(
            last_step=what.max_iters,
            lr_at=schedule,
            batch=batch,
            evaluate=held_out,
            meta={"lr_schedule": schedule.as_dict()},
        )


VIT = ViTRecipe()
