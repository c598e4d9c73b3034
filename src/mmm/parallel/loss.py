"""Cross-entropy in fp32 without an fp32 copy of the whole logits.

``F.cross_entropy(logits.float(), targets)`` on bf16 logits makes an fp32 copy of them and keeps their
fp32 log-softmax for backward: 4 bytes a logit kept (2 GiB for a batch of 8 x 2,048 tokens over 32,000
words) and 4 more while the loss is computed. :func:`cross_entropy` computes the same loss a chunk of
rows at a time, in fp32, and its gradient at once (softmax minus one-hot, what backward would compute),
kept in the logits' own dtype: 2 bytes a logit in bf16, and for an unscaled loss the same gradient the
``.float()`` form hands back (its cast to bf16 rounds the same fp32 values; a scaled loss rounds once
more, within a bf16 ulp). In fp32 it equals ``F.cross_entropy`` to rounding (about 1e-7).

Logits that are DTensors (tensor parallel's loss parallel: the vocabulary sharded) take
``F.cross_entropy`` under ``loss_parallel()``, as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# rows per chunk: at most this many fp32 logits live at once (256 MiB)
CHUNK_ELEMENTS = 2**26


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, chunk_elements: int):
        rows, vocab = logits.shape
        ctx.step = step = max(1, chunk_elements // max(vocab, 1))
        keep = targets != ignore_index
        count = keep.sum().to(torch.float32)  # no kept target: nan, as F.cross_entropy's mean
        weight = keep.to(torch.float32)[:, None] / count
        # ignored rows pick word 0, weighted 0; any other target out of range fails in gather, as in F.cross_entropy
        picked = torch.where(keep, targets, 0)[:, None]
        grad = torch.empty_like(logits) if ctx.needs_input_grad[0] else None
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, rows, step):
            part = slice(start, start + step)
            x = logits[part].float()
            lse = torch.logsumexp(x, dim=-1, keepdim=True)
            total += ((lse - x.gather(1, picked[part])) * weight[part]).sum()
            if grad is not None:  # d loss / d logits: (softmax - one-hot) / count, rounded once
                g = (x - lse).exp_()  # not in place: fp32 logits' .float() is the logits themselves
                g.scatter_add_(1, picked[part], torch.full_like(lse, -1.0))
                grad[part] = g.mul_(weight[part])
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (grad,) = ctx.saved_tensors
        if grad.dtype == torch.float32:
            return grad * grad_out, None, None, None
        out = torch.empty_like(grad)  # scaled in fp32 a chunk at a time: no fp32 copy of it all
        for start in range(0, grad.shape[0], ctx.step):
            part = slice(start, start + ctx.step)
            out[part] = grad[part].float().mul_(grad_out)
        return out, None, None, None


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100, chunk_elements: int = CHUNK_ELEMENTS
) -> torch.Tensor:
    """The mean cross-entropy of ``logits`` (..., vocab) against ``targets`` (...), in fp32 whatever
    the logits' dtype, without their fp32 copy (see the module doc). ``ignore_index`` targets count for
    nothing, as in ``F.cross_entropy``."""
    from torch.distributed.tensor import DTensor

    flat, flat_targets = logits.flatten(0, -2), targets.flatten()
    if isinstance(logits, DTensor):
        return F.cross_entropy(flat.float(), flat_targets, ignore_index=ignore_index)
    return _ChunkedCrossEntropy.apply(flat, flat_targets, ignore_index, chunk_elements)
