"""Per-rank bytes that a DeepSpeed ZeRO engine holds: parameters, gradients, optimizer state.

Counted from the tensors DeepSpeed keeps (each storage once, views not double counted):
module parameters (ZeRO-3: each parameter's partition ``ds_tensor``), their gradients and
the reduced gradient partitions, and the optimizer's state: fp32 master partitions plus the
wrapped optimizer's moments.
"""

from __future__ import annotations

import torch


class _Counter:
    def __init__(self) -> None:
        self.seen: set[int] = set()

    def bytes(self, tensors) -> int:
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.numel() == 0:
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.seen or key == 0:
                continue
            self.seen.add(key)
            total += storage.nbytes()
        return total


def _flatten(obj):
    if obj is None:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _flatten(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _flatten(v)


def zero_state_bytes(engine) -> dict[str, int]:
    opt = engine.optimizer
    stage3 = hasattr(opt, "fp32_partitioned_groups_flat")
    count = _Counter()
    params = list(engine.module.parameters())
    if stage3:
        param_bytes = count.bytes(p.ds_tensor for p in params if hasattr(p, "ds_tensor"))
    else:
        param_bytes = count.bytes(_flatten(getattr(opt, "bit16_groups_flat", None)))
        param_bytes += count.bytes(params)
    masters = list(_flatten(getattr(opt, "fp32_partitioned_groups_flat", None)))
    masters += list(_flatten(getattr(opt, "single_partition_of_fp32_groups", None)))
    grads = [p.grad for p in params if p.grad is not None]
    grads += [m.grad for m in masters if m.grad is not None]
    for name in (
        "averaged_gradients",
        "grad_partitions_flat_buffer",
        "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition",
    ):
        grads += list(_flatten(getattr(opt, name, None)))
    grad_bytes = count.bytes(grads)
    inner = getattr(opt, "optimizer", None)
    optim_bytes = count.bytes(masters)
    if inner is not None:
        optim_bytes += count.bytes(t for t in _flatten(list(inner.state.values())) if t.dim() > 0)
    return {
        "param_bytes": param_bytes,
        "grad_bytes": grad_bytes,
        "optim_bytes": optim_bytes,
        "total_bytes": param_bytes + grad_bytes + optim_bytes,
    }
