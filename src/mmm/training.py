"""What every mmm trainer shares: output folder, step timing, startup phases, memory, run summary."""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from mmm.errors import UsageError


# --------------------------------------------------------------------------- timing
def synchronize(device: torch.device) -> None:
    """Wait for queued device work so that wall-clock timings mean something (no-op on CPU)."""
    if device.type in {"cuda", "xpu", "mps"}:
        getattr(torch, device.type).synchronize()


def process_start_time() -> float:
    """Wall-clock time this process started (Linux /proc, 10 ms resolution), else now."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


class Startup:
    """Phases from launch (``MMM_LAUNCH_TIME``, else process start) to the first finished step."""

    def __init__(self) -> None:
        from mmm.dist import launch_time

        self.process_start = process_start_time()
        self.launch = launch_time() or self.process_start
        self.marks: list[tuple[str, float]] = [("interpreter", self.process_start)]

    def mark(self, phase: str) -> None:
        """Record that ``phase`` just finished."""
        self.marks.append((phase, time.time()))

    def phases(self) -> dict[str, float]:
        out, prev = {}, self.launch
        for name, t in self.marks:
            out[f"{name}_s"] = max(0.0, t - prev)
            prev = t
        return out

    @property
    def total_s(self) -> float:
        return self.marks[-1][1] - self.launch

    def line(self) -> str:
        parts = " ".join(f"{k[:-2]}={v:.2f}s" for k, v in self.phases().items())
        return f"startup {self.total_s:.2f}s from launch to first finished step: {parts}"


# --------------------------------------------------------------------------- output folder
def resolve_outdir(outdir: str | os.PathLike | None, example: str) -> Path:
    """``--outdir`` or ``outputs/<example>/<UTC timestamp>``; a path that is a file is an error."""
    if outdir is None:
        stamp = os.environ.get("MMM_RUN_STAMP") or datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y%m%d-%H%M%S")
        return Path("outputs") / example / stamp
    path = Path(outdir)
    if path.exists() and not path.is_dir():
        raise UsageError(f"--outdir {str(outdir)!r} is a file; pass a directory (it is created if missing)")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"--outdir {str(outdir)!r}: {str(parent)!r} is a file, not a directory")
            if not os.access(parent, os.W_OK):
                raise UsageError(f"--outdir {str(outdir)!r}: cannot write in {str(parent)!r}")
            break
    return path


# --------------------------------------------------------------------------- memory
def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state (local shards only)."""
    params = list(model.parameters())
    out = {"param_bytes": sum(_local_bytes(p) for p in params),
           "grad_bytes": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
           "optim_bytes": 0}
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    out["optim_bytes"] += _local_bytes(v)
    out["total_bytes"] = out["param_bytes"] + out["grad_bytes"] + out["optim_bytes"]
    return out


def peak_memory(device: torch.device) -> dict[str, int]:
    """Peak device memory (cuda/xpu), and the process's peak resident memory."""
    out: dict[str, int] = {}
    if device.type in {"cuda", "xpu"}:
        out["peak_allocated_bytes"] = int(getattr(torch, device.type).max_memory_allocated(device))
    try:
        import resource

        out["peak_rss_bytes"] = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except ImportError:  # pragma: no cover
        pass
    return out


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` on every rank (an explicit collective, for end-of-run reports)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def versions(extra: Iterable[str] = ()) -> dict[str, str]:
    from mmm import __version__

    out = {"mmm": __version__, "python": platform.python_version(), "torch": torch.__version__}
    for name in ("numpy", "deepspeed", "mpi4py", *extra):
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, "__version__"):
            out[name] = mod.__version__
    return out


def format_step(values: dict[str, float]) -> str:
    """``iter=3 loss=4.1234 dt=0.123 ...``: the one-line-per-step format of every trainer."""
    parts = []
    for k, v in values.items():
        if isinstance(v, int) or k in {"iter", "epoch"}:
            parts.append(f"{k}={int(v)}")
        elif k in {"tps", "tokens_per_s", "samples_per_s"}:
            parts.append(f"{k}={v:.0f}")
        else:
            parts.append(f"{k}={v:.4f}")
    return " ".join(parts)
