"""Which device and process-group backend this rank uses, and the collective timeout."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from mmm import env
from mmm.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    import torch


DEFAULT_TIMEOUT_S = 600.0
DEVICE_CHOICES = ("auto", "cpu", "cuda", "xpu", "mps")
_BACKEND_FOR = {"cuda": "nccl", "cpu": "gloo", "mps": "gloo"}


# --------------------------------------------------------------------------- device
def _available(kind: str) -> int:
    import torch

    if kind == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "xpu":
        xpu = getattr(torch, "xpu", None)
        return xpu.device_count() if xpu is not None and xpu.is_available() else 0
    if kind == "mps":
        return 1 if torch.backends.mps.is_available() else 0
    return 1


def pick_device(local_rank: int = 0, requested: str | None = None) -> torch.device:
    """The device for this rank: ``requested`` or ``MMM_DEVICE``, else cuda > xpu > mps > cpu."""
    import torch

    origin = "requested" if requested else "MMM_DEVICE"
    kind = (requested or env.get("MMM_DEVICE") or "auto").strip().lower()
    if kind not in DEVICE_CHOICES:
        raise UsageError(f"unknown device {kind!r} ({origin}); choose one of: {', '.join(DEVICE_CHOICES)}")
    if kind == "auto":
        kind = next((k for k in ("cuda", "xpu", "mps") if _available(k)), "cpu")
    count = _available(kind)
    if count == 0:
        have = [k for k in ("cuda", "xpu", "mps") if _available(k)] + ["cpu"]
        where = f"device {kind!r} was requested" if requested else f"MMM_DEVICE={kind}"
        fix = "ask for auto or one of those (--device)" if requested else "set MMM_DEVICE=auto or one of those"
        raise UsageError(
            f"{where} but this machine has none (torch {torch.__version__}); available: {', '.join(have)}; {fix}"
        )
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, local_rank % count)


def pick_backend(device: torch.device) -> str:
    """Process-group backend for a device: nccl for cuda, xccl (or oneCCL's ccl) for xpu, else gloo."""
    forced = env.get("MMM_BACKEND")
    if forced:
        return forced if ":" in forced else _forced_backend(forced, device)  # "cpu:gloo,cuda:nccl": as given
    if device.type == "xpu":
        import torch.distributed as dist

        if getattr(dist, "is_xccl_available", lambda: False)():
            return "xccl"
        try:  # older stacks: Intel's oneCCL bindings register the "ccl" backend on import
            import oneccl_bindings_for_pytorch  # noqa: F401
        except ImportError:
            raise UsageError(
                "device xpu needs a collective backend: use a torch built with XCCL, or install the oneCCL "
                "bindings (pip install 'mmm[xpu]'); or set MMM_DEVICE=cpu"
            ) from None
        return "ccl"
    return _BACKEND_FOR.get(device.type, "gloo")


def _forced_backend(backend: str, device: torch.device) -> str:
    """``backend`` (MMM_BACKEND, any case), refused in one line where this torch has none or the device
    cannot use it."""
    import torch
    import torch.distributed as dist

    backend = backend.strip().lower()
    if backend == "ccl":  # Intel's oneCCL bindings register it on import; CPU or XPU process groups
        try:
            import oneccl_bindings_for_pytorch  # noqa: F401
        except ImportError:
            raise UsageError(
                "MMM_BACKEND=ccl: Intel's oneCCL bindings are not installed (pip install 'mmm[xpu]')"
            ) from None
        return backend
    available = getattr(dist, "is_backend_available", None)
    have = available(backend) if available else getattr(dist, f"is_{backend}_available", lambda: True)()
    if not have:
        raise UsageError(
            f"MMM_BACKEND={backend}: this torch ({torch.__version__}) has no {backend} backend; unset it (mmm picks "
            f"{_BACKEND_FOR.get(device.type, 'gloo')} for {device.type}) or use a torch built with it"
        )
    needs = {"nccl": "cuda", "xccl": "xpu"}.get(backend)
    if needs and device.type != needs:
        raise UsageError(
            f"MMM_BACKEND={backend} runs on {needs} devices, not {device.type}; unset it, or set MMM_DEVICE={needs}"
        )
    return backend


def timeout_seconds(value: float | None = None) -> float:
    if value is None:
        return env.get("MMM_TIMEOUT", DEFAULT_TIMEOUT_S)
    if not 0 < value <= env.MAX_SECONDS:  # a value given in code (the trainers' --timeout is checked when parsed)
        raise UsageError(f"timeout={value!r}: the collective timeout takes {env.SECONDS.what}")
    return float(value)


HOST_MMAP_THRESHOLD = 1 << 20  # bytes
LARGE_MODEL_BYTES = 256 << 20  # a CPU model this large has mmm give freed host memory back


def return_freed_host_memory(model_bytes: int | None = None) -> bool:
    """On glibc (Linux), serve host allocations of 1 MiB and more by mmap, so freeing a tensor gives its
    memory back to the system at once. glibc's default raises that threshold as large blocks are freed
    (up to 32 MiB), after which FSDP's per-block gathered parameters and gradients are carved from the
    heap and stay resident when freed: a CPU rank's resident memory then climbs by about the whole
    model over one step (8-rank FSDP of a 608M Llama: 1.07x of its fp32 bytes; with this, 0.53x),
    though it never holds more than its shards and a block. The price is a page fault per large
    allocation: ~10% step time on a small model whose activations exceed 1 MiB. Decide before the first
    large tensors come and go (building a model under :func:`mmm.parallel.meta_init` makes each parameter
    on the host first: called after, it left half the ranks of an 8-rank 254M run at 0.85x). It is applied for
    models of ``model_bytes`` >= 256 MiB (:func:`mmm.parallel.materialize` asks), always with
    ``MMM_HOST_MALLOC=return``, never with ``MMM_HOST_MALLOC=default`` or when the user set
    ``MALLOC_MMAP_THRESHOLD_`` (glibc then honours theirs). True when applied."""
    choice = env.get("MMM_HOST_MALLOC", "auto")
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or choice == "default":
        return False
    if choice != "return" and (model_bytes is None or model_bytes < LARGE_MODEL_BYTES):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, HOST_MMAP_THRESHOLD))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc
        return False
