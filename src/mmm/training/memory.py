"""What a process holds: peak and current host (and cuda/xpu device) memory, for the run's summary."""

from __future__ import annotations

import os
import resource

import torch


def peak_memory(device: torch.device) -> dict[str, int]:
    """Peak device memory (cuda/xpu), and the process's peak resident memory."""
    out: dict[str, int] = {}
    if device.type in {"cuda", "xpu"}:
        out["peak_allocated_bytes"] = int(getattr(torch, device.type).max_memory_allocated(device))
    out["peak_rss_bytes"] = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    return out


def memory_now(device: torch.device) -> dict[str, int]:
    """The peaks so far (:func:`peak_memory`) and what is held now: resident memory (Linux) and,
    on cuda/xpu, allocated device memory."""
    out = peak_memory(device)
    if device.type in {"cuda", "xpu"}:
        out["allocated_bytes"] = int(getattr(torch, device.type).memory_allocated(device))
    try:
        with open("/proc/self/statm") as f:
            out["rss_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - not Linux
        pass
    return out
