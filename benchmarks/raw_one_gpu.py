"""The fsdp_tp trainer's one-device step written as a plain torch loop, and where its time goes.

    python benchmarks/raw_one_gpu.py --dim 2048 --n-layers 16 --n-heads 16 --vocab-size 32000 --seq-len 2048

The same Llama and synthetic batches as ``python -m mmm.examples.fsdp_tp`` on one rank with the same
flags, and the same speed habits written by hand with torch alone: fp32 master weights with bf16
compute copies (FSDP2's ``fully_shard`` with a ``MixedPrecisionPolicy`` on a one-device mesh), torch's
RMSNorm kernel (the model's own), ``torch.optim.AdamW(fused=True)``, the loss ``F.cross_entropy`` of the
logits in fp32; ``--compile`` compiles each block, ``--float8`` swaps the blocks' linear layers for
torchao's Float8Linear. Forward, backward, optimizer step and nothing else. Prints the mean step over
``--iters`` steps after ``--warmup`` (device synchronised before and after: the device's pace, not
the host's), then a profile of ``--profile`` steps: the kernels that take the most device time and the
share of the step the device is busy (a low share: the host launching kernels is the limit).
``--habits none`` is the loop without them: fp32 weights under ``torch.autocast``, torch's default
AdamW. benchmarks/one_gpu.py measures the trainer against this loop on the same model.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from mmm.data import local_batches, make_dataset
from mmm.models.llama import Llama, LlamaConfig
from mmm.parallel import materialize, meta_init

MATMUL_KERNELS = ("gemm", "cutlass", "nvjet", "xmma", "cublas", "sm90_", "sm80_", "ampere_", "hopper_")
ATTENTION_KERNELS = ("flash", "fmha", "attention", "attn")


def kernel_kind(name: str) -> str:
    """A device kernel's kind by its name: a matrix multiply (cuBLAS, CUTLASS), fused attention, or other."""
    low = name.lower()
    if any(k in low for k in ATTENTION_KERNELS):
        return "attention"
    return "matmul" if any(k in low for k in MATMUL_KERNELS) else "other"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--n-layers", type=int, default=16)
    p.add_argument("--n-heads", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--habits", choices=["fast", "none"], default="fast", help="the speed habits, or none of them")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--float8", action="store_true", help="the blocks' linear layers in float8 (torchao)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--profile", type=int, default=3, help="steps profiled after the timed ones (0: none)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cfg = LlamaConfig(
        dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, vocab_size=args.vocab_size, seq_len=args.seq_len
    )
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    fast = args.habits == "fast"
    with meta_init():
        model = Llama(cfg)
    materialize(model, device=device, seed=args.seed)
    if args.float8:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=lambda m, name: name.startswith("layers."))
    if args.compile:
        for key, block in list(model.layers.items()):
            model.layers[key] = torch.compile(block)
    autocast = dtype != torch.float32
    if fast and dtype != torch.float32:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29512")
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
        mesh = init_device_mesh(device.type, (1,))
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for block in model.layers.values():
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        autocast = False
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=fast or None)
    data = make_dataset("synthetic", vocab_size=cfg.vocab_size, seq_len=cfg.seq_len)
    batches = local_batches(data, seed=args.seed, global_batch=args.batch_size, dp_rank=0, dp_size=1, device=device)

    def step():
        inputs, labels = next(batches)
        with torch.autocast(device.type, dtype=dtype, enabled=autocast):
            logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    for _ in range(args.warmup):
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    losses = [step() for _ in range(args.iters)]
    sync()
    mean = (time.perf_counter() - t0) / args.iters
    row = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else device.type,
        "dtype": args.dtype,
        "habits": args.habits,
        "compile": args.compile,
        "float8": args.float8,
        "step_s": mean,
        "peak_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
        "last_loss": losses[-1].item(),
    }
    print(json.dumps(row), flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            sync()
            t0 = time.perf_counter()
            for _ in range(args.profile):
                step()
            sync()
            wall = time.perf_counter() - t0
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.self_device_time_total for e in events) / 1e6  # microseconds to seconds
        print(f"device busy {busy / wall:.0%} of {wall / args.profile * 1e3:.1f} ms per profiled step")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
        split = {"matmul": 0.0, "attention": 0.0, "other": 0.0}  # device seconds per step by kind of kernel
        for e in events:
            split[kernel_kind(e.key)] += e.self_device_time_total / 1e6 / args.profile
        print(
            "device time per step by kernel: "
            + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in split.items())
            + " (other: elementwise, norms, softmax, casts, copies, the optimizer: memory-bound)"
        )
        row |= {"device_busy_share": busy / wall, "device_s_by_kernel": split}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=2)


if __name__ == "__main__":
    main()
