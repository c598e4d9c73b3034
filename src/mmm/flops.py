"""Model FLOPs per token, peak FLOP/s of the device, and model FLOPs utilisation (MFU).

FLOPs per token of a training step (forward + backward) for a decoder transformer, the PaLM
accounting (Chowdhery et al. 2022, appendix B)::

    6 * N  +  12 * n_layers * dim * seq_len

N counts the parameters that take part in matrix multiplies: every block and the output
projection, not the token embedding table (a lookup). The second term is attention's
``q k^T`` and ``scores v`` (2 matmuls x 2 FLOPs per multiply-add x 3 for forward + backward),
over the full sequence as the PaLM paper counts it (a causal kernel that skips the masked half
does less work than this figure credits it with).

MFU = achieved model FLOP/s (tokens/s x FLOPs per token) / the sum of the ranks' peak FLOP/s.
Peaks come from :data:`PEAK_FLOPS` (dense, no sparsity, per device PyTorch sees) by device name
and compute dtype, from ``MMM_PEAK_TFLOPS`` (per rank) when set, or on CPU from a short matmul
calibration that runs on every rank at once with the training thread count, so that it sees the
same share of the cores as training did.
"""

from __future__ import annotations

import platform
import time
from typing import Any

from mmm import env
from mmm.dist import gather_objects

# (substring of the device name, case-insensitive) -> {dtype: FLOP/s}; first match wins.
# fp32 is the plain fp32 rate (PyTorch's default matmul precision "highest"); tf32 applies when
# torch.backends.cuda.matmul.allow_tf32 is on or float32 matmul precision is "high"/"medium".
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("H100 PCIe", {"bf16": 756.5e12, "fp16": 756.5e12, "tf32": 378.0e12, "fp32": 51.2e12}),
    ("H100", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("GH200", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("A10", {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    ("L40S", {"bf16": 362.1e12, "fp16": 362.1e12, "tf32": 183.2e12, "fp32": 91.6e12}),
    ("V100", {"fp16": 125e12, "fp32": 15.7e12}),
    ("MI300X", {"bf16": 1307.4e12, "fp16": 1307.4e12, "tf32": 653.7e12, "fp32": 163.4e12}),
    ("MI250X", {"bf16": 191.5e12, "fp16": 191.5e12, "fp32": 47.9e12}),  # per GCD (one device)
    # Intel Data Center GPU Max 1550: per stack, which is one device under the default FLAT hierarchy
    ("Max 1550", {"bf16": 419.4e12, "fp16": 419.4e12, "tf32": 209.7e12, "fp32": 26.2e12}),
    ("Max 1100", {"bf16": 352e12, "fp16": 352e12, "tf32": 176e12, "fp32": 22.2e12}),
]


def llama_flops_per_token(cfg) -> float:
    """Training FLOPs per token of :class:`mmm.models.llama.Llama` (see the module docstring); a mixture of
    experts counts the parameters a token uses (its top-k experts, the shared ones, the router)."""
    n = (
        cfg.num_params(embedding=False, active=True)
        if getattr(cfg, "moe_experts", 0)
        else cfg.num_params(embedding=False)
    )
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.dim * cfg.seq_len


def counted_flops_per_sample(build, sample_shape: tuple[int, ...], dtype=None) -> float:
    """Training FLOPs per sample of any model: 3 x the forward FLOPs that PyTorch's FlopCounterMode
    counts for one sample of ``dtype`` (backward costs about twice forward). ``build()`` makes the model; it is
    built on the meta device, so this costs no memory and no real compute."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = build()
        x = torch.zeros((1, *sample_shape), dtype=dtype or torch.float32)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(x)
    return 3.0 * counter.get_total_flops()


def _matmul_precision_key(dtype: str) -> str:
    if dtype != "fp32":
        return dtype
    import torch

    return (
        "tf32" if torch.get_float32_matmul_precision() != "highest" or torch.backends.cuda.matmul.allow_tf32 else "fp32"
    )


def table_peak(device_name: str, dtype: str) -> float | None:
    """Peak FLOP/s of a known accelerator for a compute dtype (``fp32``/``bf16``), else None."""
    name = device_name.lower()
    for key, peaks in PEAK_FLOPS:
        if key.lower() in name:
            return peaks.get(_matmul_precision_key(dtype), peaks.get(dtype))
    return None


def calibrate_cpu(dtype: str = "fp32", seconds: float = 0.3, n: int = 256) -> float:
    """FLOP/s of repeated ``n x n`` matmuls in this process on its current threads."""
    import torch

    tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    a = torch.randn(n, n, dtype=tdtype)
    b = torch.randn(n, n, dtype=tdtype)
    for _ in range(3):
        a @ b
    iters, t0 = 0, time.perf_counter()
    while True:
        a @ b
        iters += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            break
    return 2.0 * n**3 * iters / elapsed


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "xpu":
        return torch.xpu.get_device_name(device)

    return platform.processor() or platform.machine() or "cpu"


def peak_flops(device, dtype: str = "fp32") -> tuple[float | None, str]:
    """This rank's peak FLOP/s and where the figure came from (``env``, ``table``, ``calibrated``,
    or ``unknown`` with None). Calibration is a collective-free local measurement; call it on every
    rank at the same moment so that ranks sharing cores measure their share."""
    tflops = env.get("MMM_PEAK_TFLOPS")
    if tflops is not None:
        return tflops * 1e12, "env"
    if device.type == "cpu":
        return calibrate_cpu(dtype), "calibrated"
    peak = table_peak(device_name(device), dtype)
    return (peak, "table") if peak else (None, "unknown")


def mfu(*, tokens_per_s: float | None, flops_per_token: float | None, peaks: list[float | None]) -> float | None:
    """Model FLOPs utilisation of the whole job (None when a figure is missing)."""
    if not tokens_per_s or not flops_per_token or not peaks or any(p is None for p in peaks):
        return None
    return tokens_per_s * flops_per_token / sum(peaks)


def mfu_report(device, dtype: str, *, rate: float | None, flops_per_unit: float | None) -> dict[str, Any]:
    """Every rank's peak (gathered), and the job's MFU: the ``mfu`` block of summary.json."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()  # calibrate together: ranks that share cores measure their share
    peak, source = peak_flops(device, dtype)
    peaks = gather_objects(peak)
    return {
        "mfu": mfu(tokens_per_s=rate, flops_per_token=flops_per_unit, peaks=peaks),
        "flops_per_unit": flops_per_unit,
        "peak_flops_per_rank": peaks,
        "peak_source": source,
        "device_name": device_name(device),
    }
