"""Every mesh materialises, from meta, the same full weights as one process (bit for bit).

    launch -n 4 python tests/scripts/meta_init_check.py --tp 2 --dp fsdp --ac full
Prints "rank R: N parameters, M differ" and exits 1 when any differs.
"""

import argparse
import sys

import torch

from mmm import dist


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dp", default="fsdp")
    ap.add_argument("--ac", default="none")
    args = ap.parse_args(argv)
    info = dist.setup()
    from mmm.models.llama import Llama, LlamaConfig, llama_tp_plan
    from mmm.parallel import ParallelSpec, init_mesh, materialize, meta_init, parallelize
    from mmm.parallel.meta import canonical_name

    cfg = LlamaConfig(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=97, seq_len=16)
    with meta_init():
        one = Llama(cfg)
    materialize(one, device="cpu", seed=3)
    expected = dict(one.named_parameters())
    with meta_init():
        model = Llama(cfg)
    model = parallelize(
        model,
        init_mesh(tp=args.tp),
        ParallelSpec(tp_plan=llama_tp_plan(), dp=args.dp, ac=args.ac),
        device=info.device,
        seed=3,
    )
    differ = []
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        name = canonical_name(name.removeprefix("module."))
        if not torch.equal(full.detach().cpu(), expected[name].detach()):
            differ.append(name)
    buffers = dict(model.named_buffers())
    if not torch.equal(buffers["rope"].cpu(), one.rope):
        differ.append("rope (buffer)")
    sys.stdout.write(f"rank {info.rank}: {len(expected)} parameters, {len(differ)} differ {differ[:3]}" + "\n")
    return 1 if differ else 0


if __name__ == "__main__":
    dist.run_main(main)
