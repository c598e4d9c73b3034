"""Context parallelism for your own attention, in one short script.

    launch -n 2 python3 examples/context_parallel_own_attention.py

Give your attention an ``attn_fn(q, k, v)`` hook, let ``context_parallel`` set it to mmm's ring
or all-to-all (Ulysses) attention (in every module that has one), shard the
sequence with ``shard_sequence`` (load-balanced chunks), and use ``local_positions`` for any
positional encoding. The script checks the output and the gradients against full attention
computed in one process.
"""

import torch
import torch.nn.functional as F
from torch import nn

from mmm import dist
from mmm.parallel import init_mesh
from mmm.parallel.context import context_parallel, local_positions, shard_sequence


class TinyAttention(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.pos = nn.Embedding(64, dim)
        self.attn_fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # the hook

    def forward(self, x, positions):
        b, s, d = x.shape
        x = x + self.pos(positions)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return self.attn_fn(q, k, v).transpose(1, 2).reshape(b, s, d)


def main(argv=None):
    info = dist.setup(seed=0)
    mesh = init_mesh(cp=info.world_size, dp_shard=1)
    cp, rank = mesh.cp, mesh.coord("cp")
    torch.manual_seed(0)
    model = TinyAttention()
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))

    # one process, full sequence
    full = model(x, torch.arange(16))
    full.square().mean().backward()
    want_grad = model.qkv.weight.grad.clone()
    model.zero_grad()

    # context parallel: this rank's chunks; ring attention, then all-to-all (Ulysses: heads split over cp)
    for kind in ("ring", "ulysses"):
        model.zero_grad()
        context_parallel(model, mesh["cp"], kind=kind)  # every attn_fn hook -> this kind over the cp ranks
        out = model(shard_sequence(x, rank, cp), local_positions(16, rank, cp))
        assert torch.allclose(out, shard_sequence(full, rank, cp), rtol=1e-5, atol=1e-6), kind
        (out.square().sum() / full.numel()).backward()  # this rank's share of the same mean
        torch.distributed.all_reduce(model.qkv.weight.grad)  # sum the shares over the cp ranks
        assert torch.allclose(model.qkv.weight.grad, want_grad, rtol=1e-4, atol=1e-7), kind
        if info.is_main:
            print(f"{kind} attention over {cp} ranks matches full attention: outputs and gradients", flush=True)
    return 0


if __name__ == "__main__":
    dist.run_main(main)
