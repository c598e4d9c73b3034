"""The fsdp_tp trainer's model and plan applied by hand with raw torch APIs: the overhead reference.

    torchrun --nproc-per-node 4 benchmarks/raw_fsdp_tp.py --tp 2 --max-iters 20 --out raw.json

Same Llama, same data (mmm.data's synthetic batches for the same seed), same TP + sequence parallel
plan with loss parallel, same FSDP2 units (each block resharded after forward, the root not), same
AdamW, fp32, the same weights (built on meta and materialised by mmm.parallel.materialize, as the
trainer does: setup is not what this measures). No mmm bootstrap, mesh, engine, History or logging
in the loop: init_device_mesh, parallelize_module, fully_shard and a plain loop that does only data,
forward, backward and the optimizer step; its dt is, as the trainer's, the wall time of the whole
iteration. The losses stay on the device and are averaged over dp ranks after the loop (outside
the timing). Rank 0 writes every step's loss and dt to --out.
benchmarks/overhead.py runs it beside the trainer.
"""

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from mmm.data import local_batches, make_dataset
from mmm.models.llama import Llama, LlamaConfig
from mmm.parallel import materialize, meta_init
from mmm.parallel.optim import fused_problem


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree; dp is the world size / tp [2]")
    p.add_argument("--dim", type=int, default=256, help="the Llama's width [256]")
    p.add_argument("--n-layers", type=int, default=4, help="its blocks [4]")
    p.add_argument("--seq-len", type=int, default=128, help="tokens a sequence [128]")
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences) [16]")
    p.add_argument("--max-iters", type=int, default=20, help="steps [20]")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate [3e-3]")
    p.add_argument("--seed", type=int, default=0, help="weights and batches, as the trainer's --seed [0]")
    p.add_argument("--out", required=True, help="rank 0 writes every step's loss and dt here (JSON)")
    args = p.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    for ours, theirs in (
        ("RANK", "OMPI_COMM_WORLD_RANK"),
        ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"),
        ("RANK", "PMI_RANK"),
        ("WORLD_SIZE", "PMI_SIZE"),
    ):
        if ours not in os.environ and theirs in os.environ:  # under mpiexec (MASTER_ADDR/PORT from launch)
            os.environ[ours] = os.environ[theirs]
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // args.tp
    mesh = init_device_mesh("cpu", (dp, args.tp), mesh_dim_names=("dp", "tp"))
    cfg = LlamaConfig(dim=args.dim, n_layers=args.n_layers, vocab_size=256, seq_len=args.seq_len)
    with meta_init():
        model = Llama(cfg)

    tp_plan = args.tp > 1  # as the trainer: no TP plan (nor its DTensor ops) on a tp axis of one rank
    if tp_plan:
        parallelize_module(
            model,
            mesh["tp"],
            {
                "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                "norm": SequenceParallel(),
                "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
            },
        )
        for block in model.layers.values():
            parallelize_module(
                block,
                mesh["tp"],
                {
                    "attention_norm": SequenceParallel(),
                    "attention": PrepareModuleInput(
                        input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
                    ),
                    "attention.wq": ColwiseParallel(),
                    "attention.wk": ColwiseParallel(),
                    "attention.wv": ColwiseParallel(),
                    "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                    "ffn_norm": SequenceParallel(),
                    "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                    "feed_forward.w1": ColwiseParallel(),
                    "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                    "feed_forward.w3": ColwiseParallel(),
                },
            )
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=True)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)
    materialize(model, device="cpu", seed=args.seed)
    params = list(model.parameters())  # torch's fused AdamW where it takes these parameters, as the trainer's
    fused = fused_problem(params) is None
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, fused=fused or None)

    data = make_dataset("synthetic", vocab_size=cfg.vocab_size, seq_len=cfg.seq_len)
    batches = local_batches(
        data,
        seed=args.seed,
        global_batch=args.batch_size,
        dp_rank=mesh["dp"].get_local_rank(),
        dp_size=dp,
        device=torch.device("cpu"),
    )
    dp_group = mesh["dp"].get_group()
    losses, dts = [], []
    t_prev = time.perf_counter()
    for _ in range(args.max_iters):
        inputs, labels = next(batches)
        with loss_parallel() if tp_plan else contextlib.nullcontext():
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()  # (under a TP plan a replicated DTensor: its local value, no communication)
        losses.append(loss.to_local() if tp_plan else loss)
        now = time.perf_counter()
        dts.append(now - t_prev)  # the whole iteration, as the trainer's dt
        t_prev = now
    losses = torch.stack(losses).float()
    dist.all_reduce(losses, group=dp_group)  # after the loop: the mean over dp ranks, as the trainer logs
    losses = (losses / dp).tolist()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"loss": losses, "dt": dts}, f)
    # gloo's worker threads may free the last collective's tensors during interpreter shutdown and abort the
    # process ("terminate called without an active exception"): leave together, then at once
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
