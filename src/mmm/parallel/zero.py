"""ZeRO-1/2/3 through DeepSpeed's engine (optional dependency, imported only here).

The config is built from the trainer's flags: stage, micro-batch per rank (global batch /
dp), bf16, and optimizer offload to CPU when asked. With no offload the trainer's own
``torch.optim`` optimizer is handed to DeepSpeed; offload needs DeepSpeed's own optimizer
(named in the config), which it builds (a one-time JIT compile of its CPU Adam).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from mmm import dist as mdist
from mmm import env
from mmm.errors import UsageError
from mmm.log import get_logger

ZERO_STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}
# a JIT build's lock older than this was left by a build that was stopped (a build takes 1-2 minutes)
STALE_BUILD_S = 600.0
INSTALL_HINT = "pip install 'mmm[deepspeed]' (or pip install deepspeed)"


def import_deepspeed():
    """``import deepspeed`` quietly, or a UsageError that says how to install it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import deepspeed
    except ImportError:
        raise UsageError(
            f"the zero1/zero2/zero3 strategies need DeepSpeed, which is not installed: {INSTALL_HINT}; "
            "or use the fsdp strategy"
        ) from None
    level = logging.DEBUG if env.get("MMM_LOG_LEVEL") == "DEBUG" else logging.WARNING
    deepspeed.utils.logger.setLevel(level)
    # DeepSpeed calls the tensor collectives torch has renamed; their FutureWarnings say nothing to users.
    warnings.filterwarnings(
        "ignore",
        message=r".*torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)",
        category=FutureWarning,
    )
    return deepspeed


def deepspeed_available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def zero_config(
    *,
    stage: int,
    global_batch: int,
    dp: int,
    dtype: str,
    offload_optimizer: bool = False,
    gradient_clipping: float = 0.0,
    gradient_accumulation: int = 1,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    cfg: dict[str, Any] = {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": global_batch // dp // gradient_accumulation,
        "gradient_accumulation_steps": gradient_accumulation,
        "gradient_clipping": gradient_clipping,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        cfg["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": lr, "betas": list(betas), "eps": eps, "weight_decay": weight_decay},
        }
    return cfg


def _skip_inference_shm_kernel(deepspeed) -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce kernel at init (20 s to
    minutes on a fresh machine) that only its inference all-reduce uses; training collectives go
    through torch.distributed. Skip building it on CPU unless ``MMM_DS_SHM=1``."""
    if env.get("MMM_DS_SHM", False):
        return
    # by module name: the attribute deepspeed.comm.torch is the torch package itself (deepspeed.comm
    # imports torch), so `import deepspeed.comm.torch as m` would patch torch, and the kernel still built
    backend = importlib.import_module("deepspeed.comm.torch")
    backend.build_shm_op = lambda: None


def _build_directory(op: str) -> Path | None:
    """Where torch builds (and locks) DeepSpeed's JIT op ``op`` (``TORCH_EXTENSIONS_DIR``, else a cache)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory
    except ImportError:
        return None
    return Path(_get_build_directory(op, verbose=False))


def stale_build_lock(op: str = "cpu_adam") -> Path | None:
    """The lock file of an interrupted JIT build of DeepSpeed's op ``op`` (older than
    :data:`STALE_BUILD_S`), if there is one: torch's build waits for such a lock to go, for ever (a first
    ``--offload-optimizer`` run stopped while it compiled CPU Adam leaves one)."""
    folder = _build_directory(op)
    if folder is None:
        return None
    lock = folder / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except (FileNotFoundError, NotADirectoryError):
        return None
    return lock if age > STALE_BUILD_S else None


def initialize(model: nn.Module, optimizer, *, config: dict[str, Any], device_type: str):
    """``deepspeed.initialize`` on the existing process group; returns the DeepSpeed engine."""
    if optimizer is None and config.get("zero_optimization", {}).get("offload_optimizer"):
        lock = stale_build_lock("cpu_adam")
        if lock is not None:
            minutes = (time.time() - lock.stat().st_mtime) / 60
            raise UsageError(
                f"--offload-optimizer: DeepSpeed's CPU Adam build is locked by {lock}, left {minutes:.0f} min ago "
                "by a build that was stopped (torch would wait for it for ever): delete that file and run again"
            )
        if mdist.info().is_main:  # a first use compiles it, silently: say why the start may take minutes
            get_logger().info(
                "--offload-optimizer: DeepSpeed's CPU Adam is loaded (prebuilt, or from %s), or compiled there first "
                "(1-5 minutes, once per environment)",
                _build_directory("cpu_adam"),
            )
    if device_type == "cpu":  # said, not guessed: DeepSpeed's guess warns on every rank that it found no GPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    deepspeed = import_deepspeed()
    if device_type == "cpu":
        _skip_inference_shm_kernel(deepspeed)

    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    # DeepSpeed insists on LOCAL_RANK, which only torchrun and Open MPI set: give it ours (one
    # process, srun, Hydra, PALS)

    os.environ.setdefault("LOCAL_RANK", str(mdist.info().local_rank))
    before = set(mdist.process_groups())
    deepspeed.init_distributed(dist_backend=backend)
    kwargs = {"model": model, "config": config}
    if optimizer is not None:
        kwargs["optimizer"] = optimizer
    else:
        kwargs["model_parameters"] = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(**kwargs)
    # DeepSpeed reduces over groups of its own (a clone of the world group for ZeRO's data parallel), made
    # with torch's default timeout (30 min on gloo): held to the job's, as the mesh's axes are
    mdist.hold_to_timeout([g for g in mdist.process_groups() if g not in before])
    return engine
