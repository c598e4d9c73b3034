"""The device facts mmm's kernels and the planner assume, checked on the device at hand in under a minute:

    python benchmarks/gpu_check.py --out gpu_check.json          # on a CUDA device (cpu: --device cpu)

1. **Grouped experts** (``GroupedExperts(grouped=True)``, ``F.grouped_mm`` with each expert's rows padded to
   16 and a padded buffer longer than the last offset) against the loop of matmuls per expert, in bf16,
   forward and every gradient, one expert given no token; and which of the two runs by default here.
2. **The norm's kernels**: ``F.rms_norm`` forward and backward at the yardstick's activation size
   (8 x 2,048 tokens x 2,048, bf16) under the profiler: the device kernels it launches, their time, and
   the bytes a fused kernel moves, as ``python -m mmm.plan.simulate --hardware h100`` counts them
   (``mmm.measure.FusedNorms``: one kernel each way). Many kernels here would make the planner's
   memory-bound time too low.
3. **AdamW fused**: the kernels of one fused step over 64 Mi parameters (``mmm.parallel.optim.adamw``).
4. **float8** (where torchao imports and the device has float8 matmuls): a block's linear layers
   converted by ``mmm.parallel.float8.apply_float8``, a forward and backward, the output's difference from
   bf16's.

Each check prints one JSON line; ``--out`` writes them all. A check that fails prints its error and the
others still run (exit 1 at the end).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F


def _kernels(fn, device: torch.device) -> dict:
    """The device kernels (CPU: the ops) ``fn`` runs, with their total time."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm: the first call may load or tune kernels
    if device.type == "cuda":
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = [e for e in prof.events() if (e.device_type.name == "CUDA") == (device.type == "cuda")]
    if device.type != "cuda":
        events = [  # the outermost aten ops
            e
            for e in events
            if e.name.startswith("aten::") and not (e.cpu_parent and e.cpu_parent.name.startswith("aten::"))
        ]
    names: dict[str, int] = {}
    for e in events:
        names[e.name[:80]] = names.get(e.name[:80], 0) + 1
    total_us = sum(e.device_time if device.type == "cuda" else e.cpu_time for e in events)
    return {"kernels": sum(names.values()), "by_name": names, "time_ms": total_us / 1e3}


def grouped_experts(device: torch.device) -> dict:
    from mmm.models.grouped import grouped_mm_available
    from mmm.models.llama.moe import GroupedExperts

    torch.manual_seed(0)
    experts, dim, hidden = 8, 256, 512
    loop = GroupedExperts(experts, dim, hidden, grouped=False).to(device)
    for w in loop.parameters():
        torch.nn.init.normal_(w, std=0.05)
    grouped = GroupedExperts(experts, dim, hidden, grouped=True).to(device)
    grouped.load_state_dict(loop.state_dict())
    counts = torch.tensor([37, 0, 5, 120, 16, 1, 64, 13])  # expert 1 gets no token
    x = torch.randn(int(counts.sum()), dim, device=device, dtype=torch.bfloat16)
    grad = torch.randn(int(counts.sum()), dim, device=device, dtype=torch.bfloat16)
    out = {}
    for name, module in (("loop", loop), ("grouped", grouped)):
        module.to(torch.bfloat16).zero_grad()
        xi = x.clone().requires_grad_()
        y = module(xi, counts.to(device) if name == "grouped" else counts.tolist())
        y.backward(grad)
        out[name] = (y.float(), xi.grad.float(), *(p.grad.float() for p in module.parameters()))
    scale = [max(t.abs().max().item(), 1e-12) for t in out["loop"]]
    diffs = [(a - b).abs().max().item() / s for a, b, s in zip(out["loop"], out["grouped"], scale)]
    timed = {
        name: _kernels(lambda m=module: m(x, counts.to(device) if m is grouped else counts.tolist()), device)
        for name, module in (("loop", loop), ("grouped", grouped))
    }
    return {
        "check": "grouped experts vs loop (bf16, forward and grads)",
        "max_rel_diff": max(diffs),
        "by_tensor": dict(zip(["out", "x", "w1", "w2", "w3"], diffs)),
        "grouped_by_default": grouped_mm_available(x),
        "forward_kernels": {k: v["kernels"] for k, v in timed.items()},
        "forward_ms": {k: round(v["time_ms"], 3) for k, v in timed.items()},
        "ok": max(diffs) < 2e-2,  # a few bf16 roundings apart: the same sums in another order
    }


def norm_kernels(device: torch.device) -> dict:
    tokens, dim = 8 * 2048, 2048
    x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16)

    def step():
        y = F.rms_norm(x, (dim,), w, 1e-5)
        torch.autograd.grad(y, (x, w), g)

    seen = _kernels(step, device)
    # as the planner counts them (mmm.measure.FusedNorms): forward reads x, w and writes y, rstd (fp32);
    # backward reads dy, x, rstd, w and writes dx, dw
    fused_bytes = (2 + 2) * tokens * dim + 4 * tokens + 2 * dim
    fused_bytes += (2 + 2 + 2) * tokens * dim + 4 * tokens + 2 * 2 * dim
    return {
        "check": "F.rms_norm forward + backward, 16384 x 2048 bf16",
        "torch": torch.__version__,
        **seen,
        "planner_fused_bytes": fused_bytes,
        "planner_kernels": 2,
        "bytes_per_s_if_fused": fused_bytes / (seen["time_ms"] / 1e3) if seen["time_ms"] else None,
        "ok": seen["kernels"] <= 4 if device.type == "cuda" else True,  # fused: 1 forward, 1-2 backward
    }


def fused_adamw(device: torch.device) -> dict:
    from mmm.parallel.optim import adamw, implementation

    params = [torch.nn.Parameter(torch.randn(4096, 4096, device=device)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = adamw(params, lr=1e-3)
    seen = _kernels(opt.step, device)
    moved = 4 * 7 * sum(p.numel() for p in params)  # read p, g, m, v; write p, m, v (fp32)
    return {
        "check": "AdamW step over 64 Mi fp32 parameters",
        "implementation": implementation(opt),
        **seen,
        "bytes_moved": moved,
        "bytes_per_s": moved / (seen["time_ms"] / 1e3) if seen["time_ms"] else None,
        "ok": implementation(opt) == "fused",
    }


def float8(device: torch.device) -> dict:
    from mmm.models.llama import Llama, LlamaConfig
    from mmm.parallel.float8 import apply_float8, float8_device_problem

    problem = float8_device_problem(device)
    if problem is not None and device.type == "cuda":
        return {"check": "float8", "skipped": problem, "ok": True}
    torch.manual_seed(0)
    cfg = LlamaConfig(dim=512, n_layers=2, n_heads=8, n_kv_heads=8, vocab_size=1024, seq_len=256)
    model = Llama(cfg).to(device, torch.bfloat16)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), device=device)
    ref = model(tokens).float()
    converted = apply_float8(model)
    out = model(tokens)
    out.float().square().mean().backward()
    return {
        "check": "float8 (torchao Float8Linear) forward + backward",
        "converted": len(converted),
        "max_abs_diff_from_bf16": (out.float() - ref).abs().max().item(),
        "ok": len(converted) > 0 and torch.isfinite(out).all().item(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="[cuda if any, else cpu]")
    ap.add_argument("--out", default=None, help="also write the results as JSON")
    ns = ap.parse_args()
    device = torch.device(ns.device)
    rows, failed = [], False
    if device.type == "cuda":
        rows.append({"device": torch.cuda.get_device_name(device), "capability": torch.cuda.get_device_capability()})
    for check in (grouped_experts, norm_kernels, fused_adamw, float8):
        t0 = time.perf_counter()
        try:
            row = check(device)
        except Exception as e:  # the others still run
            traceback.print_exc()
            row = {"check": check.__name__, "error": f"{type(e).__name__}: {e}", "ok": False}
        row["seconds"] = round(time.perf_counter() - t0, 2)
        failed |= not row.get("ok", True)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if ns.out:
        Path(ns.out).write_text(json.dumps(rows, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
