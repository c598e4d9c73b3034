"""Train a Hugging Face ``LlamaForCausalLM`` with mmm's public API: no change to the model.

    python3 examples/bring_your_own_model.py                      # one process
    launch -n 4 python3 examples/bring_your_own_model.py --tp 2   # dp 2 x tp 2 (FSDP2 + TP)
    launch -n 4 python3 examples/bring_your_own_model.py --pp 2   # pp 2 x dp 2 (FSDP2 in each stage)

The model is built from a config on the meta device and each rank materialises only its shards, with
random weights seeded by name (no download). Every layout prints the same
per-step loss and global gradient norm as one process, given the same seed and global batch.
Needs ``pip install 'mmm[hf]'`` (transformers).
"""

import argparse

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from mmm import dist
from mmm.history import History
from mmm.models.hf import HF_LLAMA_TP_PLAN
from mmm.parallel import ParallelSpec, build_pipeline, clip_grad_norm_, init_mesh, meta_init, parallelize
from mmm.training import mean_over


def loss_fn(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree [1]")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree [1]")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps [5]")
    p.add_argument("--outdir", default=None, help="write history.jsonl and summary.json here")
    args = p.parse_args(argv)

    info = dist.setup(seed=0)
    mesh = init_mesh(tp=args.tp, pp=args.pp)  # dp inferred from the world size
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)
    config = LlamaConfig(vocab_size=128, num_key_value_heads=2, max_position_embeddings=64, use_cache=False, **shape)
    with meta_init():  # no parameter memory yet: each rank materialises only its shards below
        model = LlamaForCausalLM(config)

    spec = ParallelSpec(tp_plan=HF_LLAMA_TP_PLAN, blocks="model.layers")  # FSDP2 over dp, fp32
    # seed=0: every weight from the seed and its name (transformers' _init_weights), the same on any mesh
    if mesh.pp_enabled:
        pipe = build_pipeline(model, mesh, spec, loss_fn=loss_fn, microbatches=2, device=info.device, seed=0)
        model = pipe.module  # this rank's stages, parameters under the full model's names
    else:
        model = parallelize(model, mesh, spec, device=info.device, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    history = History(args.outdir, write=info.is_main)
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, 128, (8, 33), generator=torch.Generator().manual_seed(step))  # global batch
        mine = tokens.chunk(mesh.dp)[mesh.coord("dp")].to(info.device)  # this dp rank's slice
        inputs, labels = mine[:, :-1], mine[:, 1:]
        if mesh.pp_enabled:
            loss = pipe.step(inputs, labels)  # forward + backward over the microbatches
        else:
            loss = loss_fn(model(inputs).logits, labels)
            loss.backward()
        grad_norm = clip_grad_norm_(model.parameters(), 0.0, pp_group=mesh.group("pp"))  # 0: measure only
        opt.step()
        opt.zero_grad()
        history.update(step, loss=mean_over(loss, mesh.group("dp")), grad_norm=grad_norm)
        if info.is_main:
            print(f"step={step} loss={history.rows[-1]['loss']:.6f} grad_norm={grad_norm:.6f}", flush=True)
    history.finalize({"mesh": mesh.dims.degrees}, plots=False)
    return 0


if __name__ == "__main__":
    dist.run_main(main)
