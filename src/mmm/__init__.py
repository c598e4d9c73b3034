"""mmm: compose, verify and benchmark PyTorch parallelism over a named DeviceMesh.

`import mmm` is light: it does not import torch. Submodules load on first use::

    import mmm
    info = mmm.dist.setup()          # rank discovery, device, backend, process group
    mesh = mmm.parallel.init_mesh(tp=2)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_SUBMODULES = (
    "cli",
    "data",
    "dist",
    "errors",
    "faults",
    "flops",
    "history",
    "launch",
    "log",
    "measure",
    "models",
    "parallel",
    "plan",
    "training",
    "verify",
)

if TYPE_CHECKING:  # pragma: no cover
    from mmm import (
        cli,
        data,
        dist,
        errors,
        faults,
        flops,
        history,
        launch,
        log,
        measure,
        models,  # noqa: F401
        parallel,
        plan,
        training,
        verify,
    )


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"mmm.{name}")
    raise AttributeError(f"module 'mmm' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_SUBMODULES])
