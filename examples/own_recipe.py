"""Your own model through mmm's one trainer, planner and checker: a recipe says what differs.

    launch -n 4 python3 examples/own_recipe.py --tp 2               # train: dp 2 x tp 2, History, summary
    PYTHONPATH=examples python3 -m mmm.plan.simulate --recipe own_recipe:RECIPE --world 64 --batch-size 64 \
        --pick --hardware h100                                      # a global batch that splits over 64
    PYTHONPATH=examples launch -n 4 python3 -m mmm.verify --model own_recipe:RECIPE --tp 2

The model is plain single-device code (a small GPT); the recipe names its flags, builds it, gives its
TP plan (data) and blocks, its loss and its data. mmm's trainer does everything else: mesh, meta
init, parallelize, checkpoints, the loop, History, summary.json.
"""

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from mmm.cli import flag_problems, option, positive_int
from mmm.data import local_batches, make_dataset
from mmm.parallel import ParallelSpec
from mmm.training import trainer
from mmm.training.recipe import Loop, Recipe, Shape
from mmm.training.schedule import ScheduleConfig


class Block(nn.Module):
    def __init__(self, dim: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim, self.norm1, self.norm2 = head_dim, nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm1(x)  # heads of this rank's shard: -1 (TP shards q, k, v by heads)
        q, k, v = (m(h).view(b, t, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


@dataclass
class GPTShape:
    dim: int
    depth: int
    head_dim: int
    vocab: int
    seq_len: int


class GPT(nn.Module):
    def __init__(self, s: GPTShape) -> None:
        super().__init__()
        self.embed, self.norm = nn.Embedding(s.vocab, s.dim), nn.LayerNorm(s.dim)
        # no bias: a biased Linear on (batch, seq, dim) returns a view, which FSDP2 warns of at the model's output
        self.head = nn.Linear(s.dim, s.vocab, bias=False)
        self.blocks = nn.ModuleList(Block(s.dim, s.head_dim) for _ in range(s.depth))

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


@dataclass
class GPTTrainConfig(ScheduleConfig):  # the flags: the model's shape, the global batch and steps (+ --lr, ...)
    dim: int = option(64, "--dim", parse=positive_int, group="model", help="width")
    depth: int = option(4, "--depth", parse=positive_int, group="model", help="blocks")
    head_dim: int = option(16, "--head-dim", parse=positive_int, group="model", help="width per head")
    seq_len: int = option(32, "--seq-len", parse=positive_int, group="model", help="tokens per sequence")
    batch_size: int = option(8, "--batch-size", parse=positive_int, group="training", help="GLOBAL batch")
    max_iters: int = option(20, "--max-iters", parse=positive_int, group="training", help="optimizer steps")


class GPTRecipe(Recipe):
    name, config, parallel_flags, rate = "own_gpt", GPTTrainConfig, ("tp", "dp_replicate", "strategy", "ac"), "tps"

    def problems(self, config, world_size):
        train, par = config.train, config.parallel
        out = par.problems(world_size) + flag_problems(train) + train.schedule_problems(total_steps=train.max_iters)
        heads, dp = train.dim // train.head_dim, world_size // (par.tp * par.pp * par.cp)
        if par.pp != 1 or par.cp != 1:
            out.append("this model runs on a dp x tp mesh: leave --pp and --cp at 1")
        if train.dim % train.head_dim or heads % par.tp:
            out.append(f"--tp {par.tp} must divide the {heads} heads (--dim / --head-dim)")
        return out + (
            [f"--batch-size {train.batch_size} must split over {dp} dp ranks"] if train.batch_size % dp else []
        )

    def model_config(self, train):
        return GPTShape(train.dim, train.depth, train.head_dim, 256, train.seq_len)  # byte tokens

    def build(self, model_config):
        return GPT(model_config)

    def spec(self, how, model_config):  # the TP plan is data: column-wise in, row-wise out
        plan = {f"blocks.*.{m}": "colwise" for m in ("q", "k", "v", "up")} | {"blocks.*.o": "rowwise"}
        return ParallelSpec(tp_plan=plan | {"blocks.*.down": "rowwise"}, blocks="blocks", ac=how.ac)

    def loss(self, logits, targets):
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def per_step(self, train, model_config):
        return train.batch_size * train.seq_len  # tokens

    def example_batch(self, model_config, *, rows, cp=1):  # what the planner simulates a step on
        tokens = torch.zeros(rows, model_config.seq_len, dtype=torch.long)
        return tokens, tokens

    def shape(self, model_config):
        return Shape(blocks=model_config.depth, seq_len=model_config.seq_len)

    def with_blocks(self, model_config, blocks):
        return replace(model_config, depth=blocks)

    def loop(self, ctx):  # learnable synthetic sequences; each dp rank its slice of the global batch
        what, mesh = ctx.config.train, ctx.mesh
        data = make_dataset("synthetic", vocab_size=256, seq_len=what.seq_len)
        dp = dict(seed=ctx.config.run.seed, global_batch=what.batch_size, dp_rank=mesh.coord("dp"), dp_size=mesh.dp)
        stream = []

        def batch(step):
            if not stream:
                stream.append(local_batches(data, start_step=step - 1, device=ctx.device, **dp))
            return next(stream[0])

        return Loop(last_step=what.max_iters, lr_at=what.schedule(total_steps=what.max_iters), batch=batch)


RECIPE = GPTRecipe()

if __name__ == "__main__":
    from mmm.dist import run_main

    run_main(
        lambda argv: trainer.main(RECIPE, argv, doc=__doc__, prog="examples/own_recipe.py"),
        prog="examples/own_recipe.py",
    )
