"""AdamW as fast as the parameters allow: torch's fused kernel (one launch per parameter group) where
it can run, its ``foreach`` form otherwise, and the reason said once in the log.

    from mmm.parallel.optim import adamw
    opt = adamw(model.parameters(), lr=3e-4)        # fused on CUDA, XPU and CPU alike

The fused kernel needs every parameter floating point, on a device type that has it, and all of them
plain tensors or all DTensors: a set that mixes the two fails inside the kernel (``got mixed
torch.Tensor and DTensor``). DTensors on several meshes (the experts of a mixture on their own mesh
beside FSDP's) need torch >= 2.13, where one kernel call takes them; older versions get torch's
default (foreach on CUDA).
Fused and foreach agree to rounding (about 1e-7 relative after a step).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from mmm.log import get_logger

log = get_logger("parallel")

# the first version seen to run one fused AdamW over DTensors of several meshes
SEVERAL_MESHES = (2, 13)
_said: set[str] = set()


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def fused_problem(params: list[torch.Tensor], *, version: tuple[int, int] | None = None) -> str | None:
    """Why torch's fused AdamW cannot take ``params`` (None: it can)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    if not params:
        return "no parameters"
    kinds = {p.device.type for p in params}
    supported = set(_get_fused_kernels_supported_devices())
    if kinds - supported:
        return f"no fused kernel on {', '.join(sorted(kinds - supported))}"
    if any(not torch.is_floating_point(p) for p in params):
        return "a parameter is not floating point"
    dtensors = [p for p in params if isinstance(p, DTensor)]
    if dtensors and len(dtensors) < len(params):
        return "parameters mix plain tensors and DTensors"
    meshes = {id(p.device_mesh) for p in dtensors}
    version = version or torch_version()
    if len(meshes) > 1 and version < SEVERAL_MESHES:
        return (
            f"DTensor parameters on {len(meshes)} meshes need torch >= {'.'.join(map(str, SEVERAL_MESHES))} "
            f"(this is {torch.__version__})"
        )
    return None


def adamw(params: Iterable[Any], **args) -> torch.optim.AdamW:
    """``torch.optim.AdamW(params, **args)``, fused wherever :func:`fused_problem` finds no reason
    against it (``fused=``/``foreach=`` given by the caller are kept). The choice is logged once."""
    params = list(params)
    if "fused" in args or "foreach" in args:
        return torch.optim.AdamW(params, **args)
    tensors = [p for g in params for p in g["params"]] if params and isinstance(params[0], dict) else params
    if tensors and all(p.device.type == "meta" for p in tensors):  # a simulation's: decided on its fake device
        return torch.optim.AdamW(params, **args)
    problem = fused_problem(tensors)
    say_choice(problem)
    return torch.optim.AdamW(params, **args) if problem else torch.optim.AdamW(params, fused=True, **args)


def say_choice(problem: str | None) -> None:
    """Log, once, whether AdamW is fused (``problem`` None) or why not."""
    _say_once("optimizer: AdamW, fused" if problem is None else f"optimizer: AdamW, not fused ({problem})")


def implementation(optimizer: torch.optim.Optimizer) -> str:
    """How ``optimizer`` steps: ``fused``, ``foreach``, ``for-loop``, or ``default`` (torch picks:
    foreach on CUDA, a loop elsewhere)."""
    groups = getattr(optimizer, "param_groups", None) or [getattr(optimizer, "defaults", {})]
    if all(g.get("fused") for g in groups):
        return "fused"
    return {True: "foreach", False: "for-loop"}.get(groups[0].get("foreach"), "default")


def _say_once(line: str) -> None:
    if line not in _said:
        _said.add(line)
        log.info(line)
