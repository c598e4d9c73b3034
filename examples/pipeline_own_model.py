"""Pipeline-parallel training of your own model with mmm, in one short script.

    launch -n 2 python3 examples/pipeline_own_model.py          # 2 stages, GPipe, 4 microbatches

The model only has to keep its repeated blocks in a ModuleList or ModuleDict and run
"input layer -> blocks in order -> head" (see mmm.parallel.pipeline). It prints the loss per
step, and checks it against the same model trained in one process on the same data.
"""

import torch
import torch.nn.functional as F
from torch import nn

from mmm import dist
from mmm.parallel import ParallelSpec, build_pipeline, init_mesh


class MLPStack(nn.Module):
    """Your model: an input layer, a ModuleList of residual blocks, an output head."""

    def __init__(self, width=32, depth=4, classes=5):
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.layers = nn.ModuleList(
            [nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()) for _ in range(depth)]
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        h = self.inp(x)
        for block in self.layers:
            h = h + block(h)
        return self.head(h)


def data(step, batch=16):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch, 16, generator=g)
    return x, (x[:, :5].argmax(1))  # a learnable rule


def main(argv=None):
    info = dist.setup(seed=0)
    mesh = init_mesh(pp=info.world_size, dp_shard=1)
    torch.manual_seed(0)
    model = MLPStack()
    reference = [p.detach().clone() for p in model.parameters()]  # to replay the run in one process

    # 2 stages of 2 blocks; "inp" stays on the first stage, "head" on the last
    pipe = build_pipeline(
        model, mesh, ParallelSpec(dp="none"), loss_fn=F.cross_entropy, microbatches=4, schedule="gpipe"
    )
    opt = torch.optim.SGD(pipe.module.parameters(), lr=0.1)

    losses_by_step = []
    for step in range(5):
        x, y = data(step)
        loss = pipe.step(x, y)  # forward + backward over 4 microbatches; the mean loss on every rank
        opt.step()
        opt.zero_grad()
        losses_by_step.append(loss.item())
        if info.is_main:
            print(f"step={step} loss={loss.item():.6f}", flush=True)

    # the same training in one process, for comparison
    single = MLPStack()
    with torch.no_grad():
        for p, r in zip(single.parameters(), reference):
            p.copy_(r)
    opt1 = torch.optim.SGD(single.parameters(), lr=0.1)
    for step, got in enumerate(losses_by_step):
        x, y = data(step)
        loss = F.cross_entropy(single(x), y)
        loss.backward()
        opt1.step()
        opt1.zero_grad()
        assert abs(loss.item() - got) <= 1e-5 * abs(loss.item()), (step, loss.item(), got)
    if info.is_main:
        print(f"pipeline losses match one process over {len(losses_by_step)} steps", flush=True)
    return 0


if __name__ == "__main__":
    dist.run_main(main)
