"""Pipeline-parallel training of your own model with mmm, in one short script.

    launch -n 2 python3 examples/pipeline_own_model.py          # 2 stages, GPipe, 4 microbatches

The model only has to keep its repeated blocks in a ModuleDict and skip pre/post modules that
are None (see mmm.parallel.pipeline). It prints the loss per step, and checks it against the
same model trained in one process on the same data.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage

from mmm import dist
from mmm.parallel import init_mesh
from mmm.parallel.pipeline import build_schedule, split_model, stage_ids, stage_layer_ranges


class MLPStack(nn.Module):
    """Your model: an input layer, a ModuleDict of residual blocks, an output head."""

    def __init__(self, width=32, depth=4, classes=5):
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
                                     for i in range(depth)})
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        h = self.inp(x) if self.inp is not None else x
        for block in self.layers.values():
            h = h + block(h)
        return self.head(h) if self.head is not None else h


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

    pp, rank = mesh.pp, mesh.coord("pp")
    ranges = stage_layer_ranges(n_layers=len(model.layers), num_stages=pp)
    (sid,) = stage_ids(rank, pp, 1)
    part = split_model(model, ranges[sid], first=sid == 0, last=sid == pp - 1, pre=("inp",), post=("head",))
    stage = PipelineStage(part, sid, pp, info.device, group=mesh.group("pp"))
    schedule = build_schedule([stage], schedule="gpipe", microbatches=4, loss_fn=F.cross_entropy)
    opt = torch.optim.SGD(part.parameters(), lr=0.1)

    losses_by_step = []
    for step in range(5):
        x, y = data(step)
        losses = []
        schedule.step(*((x,) if sid == 0 else ()), target=y if sid == pp - 1 else None,
                      losses=losses if sid == pp - 1 else None)
        opt.step()
        opt.zero_grad()
        loss = torch.stack(losses).mean() if losses else torch.zeros(())
        torch.distributed.all_reduce(loss, group=mesh.group("pp"))  # the last stage has it; share it
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
