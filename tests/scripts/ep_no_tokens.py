"""Expert parallel over 2 ranks where every token of both ranks goes to the experts of ep rank 0, so rank 1's
experts get none: the backward must still run every all-to-all on both ranks (no hang) and give one
process's gradients. ``stall``: rank 1 skips a collective on the ep axis instead, and rank 0 must fail
within the job's collective timeout (a mesh axis's group holds to it), not torch's 30 minutes.

    torchrun --nproc-per-node 2 ep_no_tokens.py route
    torchrun --nproc-per-node 4 ep_no_tokens.py stall
"""

import copy
import sys
import time

import torch
import torch.distributed as dist

from mmm import dist as mdist
from mmm.models.llama.moe import MoE
from mmm.parallel import init_mesh
from mmm.parallel.experts import apply_ep

TIMEOUT_S = 4


def main(mode: str) -> None:
    info = mdist.setup(timeout=TIMEOUT_S, seed=0)
    mesh = init_mesh(ep=2)
    if mode == "stall":
        group = mesh["ep"].get_group()
        # a group of its own (on 2 ranks torch reuses the default group, which has the timeout anyway)
        assert dist.get_world_size(group) < info.world_size, "run the stall on 4 ranks"
        t0 = time.monotonic()
        if info.rank == 0:
            try:
                dist.all_reduce(torch.ones(1), group=group)
            except RuntimeError:
                print(f"rank 0: the stuck collective failed after {time.monotonic() - t0:.1f} s", flush=True)
        else:
            time.sleep(TIMEOUT_S + 10)  # past the bound the test holds rank 0 to
        return
    moe = MoE(16, num_experts=4, top_k=2, hidden=24)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    with torch.no_grad():
        moe.router.expert_bias[:2] = 10.0  # every token picks experts 0 and 1: both held by ep rank 0
    one = copy.deepcopy(moe)
    apply_ep(moe, mesh, {"experts": "experts"})
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 8, 16, generator=gen, requires_grad=True) for _ in range(2)]  # each rank's batch
    x = xs[info.rank].detach().clone().requires_grad_()
    moe(x).square().sum().backward()
    # one process: both ranks' tokens
    one(torch.cat(xs)).square().sum().backward()
    here = slice(2 * info.rank, 2 * info.rank + 2)  # the experts this rank holds
    diffs = {"input": (x.grad - xs[info.rank].grad).abs().max().item()}
    for name in ("w1", "w2", "w3"):
        local = getattr(moe.experts, name).grad.to_local()
        diffs[name] = (local - getattr(one.experts, name).grad[here]).abs().max().item()
    got = torch.tensor([local.abs().sum().item()])
    assert max(diffs.values()) < 1e-5, diffs
    print(f"rank {info.rank}: gradients as one process's ({max(diffs.values()):.1e}), expert grads {got.item():.3g}")


if __name__ == "__main__":
    main(sys.argv[1])
