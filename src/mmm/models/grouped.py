"""Grouped matmuls over experts' tokens (``F.grouped_mm``), plain single-device code shared by mmm's
mixture of experts (:mod:`mmm.models.llama.moe`) and the expert-parallel forward of Hugging Face experts
modules (:mod:`mmm.parallel.experts`).

Also :func:`counts_tokens`, when a forward counts toward the expert load.

Tokens arrive sorted by expert, ``counts[e]`` of them for expert e. :func:`padded_groups` places each
expert's rows at the start of a group padded to ``GROUP_ALIGN`` rows (the rest zeros) in a buffer whose
size is known without the counts (every group padded by at most ``GROUP_ALIGN - 1`` rows), so counts on
the device stay there and the host never waits for the routing; ``xp @ w[e].T`` for every expert at once
is then ``F.grouped_mm(xp, w.transpose(-2, -1), offs=offs)``, and ``out.index_select(0, rows)`` gives the
tokens' rows back in their order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# rows of each expert's group padded to a multiple of this for the grouped matmul (16 bytes of bf16 is 8;
# 16 suits every dtype the kernel takes)
GROUP_ALIGN = 16


def no_tokens(x: torch.Tensor, features: int, *weights: torch.Tensor) -> torch.Tensor:
    """The experts' output when none of their tokens is here (``x`` has no rows): empty, ``features`` wide,
    yet holding ``x`` and every weight in the autograd graph. Under expert parallel each peer waits on this
    rank's backward: the all-to-all that returns the gradients of the tokens it sent (reached through
    ``x``) and the gradient reduction of the weights. An output cut off from them would let this rank's
    backward skip both, and its peers would wait forever. Its dtype is the one the experts' matmuls give
    (an autocast's), as on the ranks that got tokens: the all-to-all sends it back to them."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype  # as a matmul's
    held = x.sum() + sum(w.sum() for w in weights)
    return x.new_zeros((0, features), dtype=dtype) + 0.0 * held.to(dtype)


def counts_tokens(module: torch.nn.Module) -> bool:
    """Whether a router's or experts module's forward now is a training forward whose tokens count toward
    the expert load: ``module.counting`` and training with grad on, and not an activation checkpoint's
    recomputation (that runs inside backward), a pipeline's shape inference or a simulated step (those
    turn ``counting`` off)."""
    if not (module.counting and module.training and torch.is_grad_enabled()):
        return False
    return torch._C._current_graph_task_id() == -1


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether the experts of ``x``'s device run as grouped matmuls by default: CUDA of compute capability
    9.0+ (torch's grouped kernel) with ``F.grouped_mm`` in the installed torch."""
    if not hasattr(F, "grouped_mm") or x.device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(x.device) >= (9, 0)


def padded_groups(x: torch.Tensor, counts: list[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(xp, rows, offs)``: ``x``'s rows in groups padded to ``GROUP_ALIGN``, where each row went, and the
    groups' ends (int32) for ``F.grouped_mm``."""
    sizes = torch.as_tensor(counts, device=x.device)
    padded = (sizes + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    ends, padded_ends = sizes.cumsum(0), padded.cumsum(0)
    shift = (padded_ends - padded) - (ends - sizes)  # where each group starts, padded less packed
    rows = torch.arange(x.shape[0], device=x.device) + torch.repeat_interleave(shift, sizes, output_size=x.shape[0])
    room = x.shape[0] + sizes.numel() * (GROUP_ALIGN - 1)
    xp = x.new_zeros((room, x.shape[1])).index_copy(0, rows, x)
    return xp, rows, padded_ends.to(torch.int32)


def grouped_linear(xp: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``xp``'s group e times ``weight[e].T`` (``weight``: experts x out x in, as ``F.linear`` takes), in
    ``xp``'s dtype (the kernel takes one)."""
    return F.grouped_mm(xp, weight.to(xp.dtype).transpose(-2, -1), offs=offs)
