"""Data parallelism: FSDP2 (``fully_shard``), HSDP (2-D replicate x shard mesh) and DDP."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mmm.parallel.fsdp_setup import lean_fully_shard

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    blocks: list[nn.Module],
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool | None = None,
    cpu_offload: bool = False,
    experts: list[nn.Module] = (),
    experts_mesh: DeviceMesh | None = None,
    experts_divide: int = 1,
) -> nn.Module:
    """FSDP2 each block, then the root. ``dp_mesh`` 1-D shards (FSDP); 2-D (replicate, shard) is HSDP.

    Parameters are kept in fp32 and cast to ``param_dtype`` for compute; gradients are
    reduced in ``reduce_dtype`` (fp32 by default). ``reshard_after_forward=None`` frees
    block parameters after forward and keeps the root's (the last to be used in backward
    anyway). CPU offload uses unpinned memory (pinning fails on CPU-only builds).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": dp_mesh}
    if param_dtype != torch.float32 or reduce_dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    with lean_fully_shard():  # no per-shard-rank work per parameter: flat setup as the job grows
        if param_dtype != torch.float32:
            fp32 = {**kwargs, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=reduce_dtype)}
            for module in model.modules():
                if getattr(module, "keep_fp32", False):
                    fully_shard(module, reshard_after_forward=True, **fp32)
        for module in experts:
            after = True if reshard_after_forward is None else reshard_after_forward
            fully_shard(module, reshard_after_forward=after, **(kwargs | {"mesh": experts_mesh}))
            module.set_gradient_divide_factor(float(experts_divide))
            # gloo has no PREMUL_SUM: sum, then divide. Not on a mesh of one, where torch (2.13) would divide
            # twice (its single-rank copy divides, and the post-division too)
            if experts_mesh.device_type == "cpu" and experts_mesh.size() > 1:
                module.set_force_sum_reduction_for_comms(True)
        for block in blocks:
            after = True if reshard_after_forward is None else reshard_after_forward
            fully_shard(block, reshard_after_forward=after, **kwargs)
        after = False if reshard_after_forward is None else reshard_after_forward
        fully_shard(model, reshard_after_forward=after, **kwargs)
    return model


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, *, device: torch.device) -> nn.Module:
    """Classic DDP over the data-parallel group (1-D only: DDP does not compose with TP/DTensor)."""
    device_ids = [device.index] if device.type in {"cuda", "xpu"} else None
    return DistributedDataParallel(model, process_group=dp_mesh.get_group(), device_ids=device_ids)
