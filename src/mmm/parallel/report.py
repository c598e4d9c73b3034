"""Human-readable view of how a parallelised model's parameters are laid out."""

from __future__ import annotations

import re

from torch import nn

_BLOCK = re.compile(r"layers\.(\d+)\.")


def describe_sharding(model: nn.Module) -> str:
    """A table of parameters: global shape, this rank's local shape, placement per mesh axis (DTensors),
    DeepSpeed ZeRO's partition (a DeepSpeed engine), or a whole copy (DDP, one rank).

    Repeated blocks (``layers.N.``) are shown once: the first block carries the pattern.
    """
    stage = model.zero_optimization_stage() if hasattr(model, "zero_optimization_stage") else None
    whole = (
        f"replicated (ZeRO-{stage}: {'optimizer state and gradients' if stage == 2 else 'optimizer state'} partitioned)"
        if stage in (1, 2)
        else "replicated by DDP"
        if isinstance(model, nn.parallel.DistributedDataParallel)
        else "whole on this rank"
    )
    rows = [("parameter", "global", "local", "placement")]
    params, skipped, first_block = [], 0, None
    for name, p in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        name = name[len("module.") :] if name.startswith("module.") else name
        m = _BLOCK.search(name)
        if m:
            first_block = m.group(1) if first_block is None else first_block
            if m.group(1) != first_block:
                skipped += 1
                continue
        params.append((name, p))
    for name, p in params:
        if hasattr(p, "placements"):
            local = tuple(p.to_local().shape)
            names = p.device_mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(p.device_mesh.ndim))
            axes = list(zip(names, p.placements, p.device_mesh.shape))
            # an axis of one rank changes nothing (the experts' efsdp where ep takes every rank): left out
            placement = ", ".join(f"{n}:{_short(pl)}" for n, pl, size in axes if size > 1)
            placement = placement or ", ".join(f"{n}:{_short(pl)}" for n, pl, _ in axes)
        elif hasattr(p, "ds_shape"):  # ZeRO-3: this rank holds a flat slice of the parameter's elements
            held = p.ds_tensor.numel() if getattr(p, "ds_tensor", None) is not None else 0
            rows.append((name, "x".join(map(str, p.ds_shape)), str(held), f"ZeRO-3 partition ({held} of {p.ds_numel})"))
            continue
        else:
            local, placement = tuple(p.shape), whole
        rows.append((name, "x".join(map(str, p.shape)), "x".join(map(str, local)), placement))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}" for r in rows]
    if skipped:
        lines.append(f"(+ {skipped} parameters of the other blocks, laid out like block {first_block})")
    return "\n".join(lines)


def _short(placement) -> str:
    text = type(placement).__name__
    dim = getattr(placement, "dim", None)
    return f"{text}({dim})" if dim is not None else text
