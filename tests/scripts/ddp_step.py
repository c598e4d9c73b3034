"""One DDP forward/backward/step on a tiny model, then mmm's clean exit (teardown test)."""

import torch

from mmm import dist


def main(argv=None):
    info = dist.setup(seed=0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    g = dist.data_generator(0, info.rank)
    x = torch.randn(8, 16, generator=g)
    loss = ddp(x).pow(2).mean()
    loss.backward()
    opt.step()
    summed = loss.detach().clone()
    torch.distributed.all_reduce(summed)
    if info.rank == 0:
        print(f"ok loss_sum={summed.item():.6f}", flush=True)
    return 0


if __name__ == "__main__":
    dist.run_main(main)
